"""Recipes under `funcshard.compile` (issue 37): a step compiles once and equals the eager one.

1. A step with clipping, `fs.global_norm`, `fs.pmean` of its metrics, `check_finite` and a
   user `fs.Comm` compiles on its first call and never again: nothing dynamo traces reads
   funcshard's counters (see [Note: bookkeeping outside compiled graphs]).
2. A step whose blocks are activation-checkpointed (non-reentrant `torch.utils.checkpoint`
   inside a module's forward), LoRA-style with `plan(frozen="split")`, trains as the eager
   step and as one plain process; with attention inside the recomputed region it breaks
   at `torch.autograd.grad` (see [Note: activation checkpointing in a compiled step]), and
   with `fullgraph=True` it refuses, naming the module.

Run: `.venv/bin/python -m pytest tests/compiling/test_compile_recipes.py -q`.
"""

import copy
import functools
import re

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.comm import _failures as failures
from funcshard.testing.compare import assert_trees_close
from funcshard.testing.dynamo import isolated

D = 16  # model width


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _clone(tree):
    return torch.utils._pytree.tree_map(lambda t: None if t is None else t.clone(), tree)


# -- 1. recipes compile once -----------------------------------------------------------------


def _user_gather(shard, axis):
    return axis.all_gather(shard)


def _user_reduce(full, axis):
    return axis.reduce_scatter(full)


@isolated()
def _recipe_step(check_finite: bool, rank: int) -> dict:
    """Four calls of one compiled step and of the same step eagerly: graphs compiled in each
    compiled call, both steps' outputs and final states, and what `last_issued` says after
    the last compiled call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 1))
    plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    mesh = state.layout.mesh
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.1), fs.optim.sgd(0.1, momentum=0.9))
    comm = fs.Comm(gather=_user_gather, reduce=_user_reduce)

    def loss_fn(state, x, y):
        return (fs.call(model, state, x) - y).square().mean()

    value_and_grad = fs.value_and_grad(loss_fn, comm=comm, check_finite=check_finite)

    def step(state, opt_state, x, y):
        loss, grads = value_and_grad(state, x, y)
        metrics = fs.pmean({"loss": loss.detach(), "grad norm": fs.global_norm(grads)}, mesh)
        state, opt_state = opt.step(grads, opt_state, state)
        return metrics, state, opt_state

    compiled_step = fs.compile(step, backend="aot_eager", fullgraph=not check_finite)
    eager, compiled = (_clone(state), opt.init(state)), (_clone(state), opt.init(state))
    graphs, metrics = [], []
    for i in range(4):
        g = torch.Generator().manual_seed(10 * rank + i)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        before = _graphs()
        compiled_metrics, *compiled = compiled_step(*compiled, x, y)
        graphs.append(_graphs() - before)
        issued = failures.last_issued()
        eager_metrics, *eager = step(*eager, x, y)
        metrics.append((compiled_metrics, eager_metrics))
    return {
        "graphs": graphs,
        "metrics": metrics,
        "shards": (compiled[0].shards, eager[0].shards),
        "last issued": issued,
    }


@pytest.mark.parametrize("check_finite", [False, True], ids=["fullgraph", "check_finite"])
def test_a_step_with_every_recipe_compiles_once_and_trains_like_the_eager_step(check_finite):
    """Each collective funcshard issued while dynamo traced advanced a module-level counter
    that dynamo guarded on, so a step with clipping, global_norm or pmean was compiled
    again on every call (graphs per call [1, 1, 1, 1]; with check_finite [4, 2, 2, 2]) and, past
    torch's recompile limit, ran eagerly or, with fullgraph=True, raised."""
    results = testing.run(functools.partial(_recipe_step, check_finite), 2, timeout=240)
    for r in results:
        first, *later = r["graphs"]
        assert first >= 1 and later == [0, 0, 0], r["graphs"]
        assert first == 1 or check_finite, r["graphs"]  # check_finite breaks where it reads
        for compiled_metrics, eager_metrics in r["metrics"]:
            assert_trees_close(compiled_metrics, eager_metrics)
        assert_trees_close(*r["shards"])
        # the compiled calls are counted from outside their graphs, alike on every rank
        counted = re.search(
            r"the last of its (\d+) collectives in call 4 of compiled step ", r["last issued"]
        )
        assert counted and int(counted[1]) > 0, r["last issued"]
    assert results[0]["last issued"] == results[1]["last issued"]


# -- 2. activation checkpointing -------------------------------------------------------------


class Adapted(nn.Module):
    """A frozen base linear beside a trainable low-rank adapter (LoRA)."""

    def __init__(self, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(D, D).requires_grad_(False)
        self.down = nn.Linear(D, rank, bias=False)
        self.up = nn.Linear(rank, D, bias=False)  # drawn, not zero: every adapter moves

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class Attention(nn.Module):
    """One head of causal self-attention whose query goes through an adapter: a random op
    (torch's attention kernels take a dropout seed) in the recomputed region."""

    def __init__(self) -> None:
        super().__init__()
        self.query = Adapted()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D)
        q, kv = self.query(x).unsqueeze(1), x.unsqueeze(1)  # (B, 1, T, D): one head
        return F.scaled_dot_product_attention(q, kv, kv, is_causal=True).squeeze(1)


class CheckpointedBlock(nn.Module):
    """A residual block, frozen and trainable parameters side by side, recomputed in
    backward (non-reentrant checkpoint of its own forward)."""

    def __init__(self, attention: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.mix = Attention() if attention else Adapted()
        self.out = nn.Linear(D, D)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.mix(self.ln(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)


class Net(nn.Module):
    """An embedding, `blocks` checkpointed blocks (units when sharded) and a head."""

    def __init__(self, attention: bool, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.blocks = nn.ModuleList(CheckpointedBlock(attention) for _ in range(blocks))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 8) -> (B, T, 1)
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 1, generator=g)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean()


STEPS, LR = 2, 0.1


@isolated()
def _checkpointed_training(attention: bool, reshard: bool, rank: int) -> dict:
    """Two SGD steps compiled, eagerly and (on every rank) in one plain process on the
    concatenated batches: losses, final parameters, graphs and breaks. One block: a
    checkpointed unit between the root's layers is all this needs, and tracing the
    recomputation grows with the blocks (tests/DURATIONS.md)."""
    torch.manual_seed(0)
    model = Net(attention, blocks=1)
    plain = copy.deepcopy(model)
    plan = fs.plan(model, policy=fs.policy.module_classes({CheckpointedBlock}), frozen="split")
    state = fs.shard(model, plan, fs.Mesh(shard=2), reshard_after_forward=reshard)
    opt = fs.optim.sgd(LR)

    def step(state, opt_state, x, y):
        loss, grads = fs.value_and_grad(lambda s: _mse(fs.call(model, s, x), y))(state)
        state, opt_state = opt.step(grads, opt_state, state)
        return loss, state, opt_state

    compiled_step = fs.compile(step, backend="aot_eager")
    compiled, eager = (_clone(state), opt.init(state)), (_clone(state), opt.init(state))
    losses = {"compiled": [], "eager": [], "plain": []}
    graphs = []
    trainable = [p for p in plain.parameters() if p.requires_grad]
    for i in range(STEPS):
        x, y = _batch(rank, i)
        before = _graphs()
        loss, *compiled = compiled_step(*compiled, x, y)
        graphs.append(_graphs() - before)
        losses["compiled"].append(loss.item())
        loss, *eager = step(*eager, x, y)
        losses["eager"].append(loss.item())
        both = [_batch(r, i) for r in range(2)]
        x_all, y_all = (torch.cat(t) for t in zip(*both, strict=True))
        loss = _mse(plain(x_all), y_all)
        losses["plain"].append(loss.item())
        grads = torch.autograd.grad(loss, trainable)
        with torch.no_grad():
            for p, g in zip(trainable, grads, strict=True):
                p -= LR * g
    return {
        "losses": losses,
        "params": (fs.unshard(compiled[0]), fs.unshard(eager[0]), dict(plain.named_parameters())),
        "graphs": graphs,
        "breaks": dict(torch._dynamo.utils.counters["graph_break"]),
    }


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep gathered"])
@pytest.mark.parametrize("attention", [False, True], ids=["adapters", "attention"])
def test_checkpointed_lora_blocks_compiled_train_like_eager_and_one_plain_process(
    attention, reshard
):
    """torch refuses to recompute a checkpointed region holding a random op (attention)
    inside one forward-loss-backward graph, and fs.compile raised its RuntimeError; now
    such a step breaks once at autograd.grad and compiles forward and backward apart."""
    task = functools.partial(_checkpointed_training, attention, reshard)
    results = testing.run(task, 2, timeout=240)
    ranks = [r["losses"]["compiled"] for r in results]
    mean = [sum(pair) / 2 for pair in zip(*ranks, strict=True)]
    for r in results:
        losses = r["losses"]
        assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)
        assert mean == pytest.approx(losses["plain"], rel=1e-5)  # a rank's loss is its half's
        compiled, eager, plain = r["params"]
        assert_trees_close(compiled, eager, rtol=1e-5, atol=1e-6)
        assert_trees_close(compiled, {k: v.detach() for k, v in plain.items()}, rtol=1e-5)
        assert r["graphs"][1:] == [0], r["graphs"]
        if attention:  # joint graph mode: the break at torch.autograd.grad
            assert any("torch.autograd.grad" in b for b in r["breaks"]), r["breaks"]
        else:  # one graph, recomputed inside it
            assert r["graphs"] == [1, 0] and r["breaks"] == {}, r


@isolated()
def _fullgraph_checkpointed(rank: int) -> str:
    torch.manual_seed(0)
    model = Net(attention=True)
    plan = fs.plan(model, policy=fs.policy.module_classes({CheckpointedBlock}), frozen="split")
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    x, y = _batch(rank, 0)
    value_and_grad = fs.value_and_grad(lambda s: _mse(fs.call(model, s, x), y))
    with pytest.raises(ValueError) as caught:
        fs.compile(value_and_grad, backend="aot_eager", fullgraph=True)(state)
    return str(caught.value)


def test_fullgraph_refuses_checkpointed_attention_naming_the_modules():
    for message in testing.run(_fullgraph_checkpointed, 2, timeout=240):
        assert message.startswith("funcshard.compile("), message
        assert "Attention 'blocks.0.mix'" in message and "'blocks.1.mix'" in message, message
        assert "fullgraph=False" in message, message
