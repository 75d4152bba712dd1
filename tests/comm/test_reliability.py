"""Faults: collectives that never complete, ranks that diverge, NaN/inf, and determinism."""

import functools
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.comm import _collectives as collectives
from funcshard.comm import _exchange as exchange
from funcshard.comm import _failures as failures
from funcshard.step._finite import NonFiniteError
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

BLOCKS = fs.policy.module_classes({Block})


def _gpt_loss(model, state, x, y):
    return F.cross_entropy(fs.call(model, state, x).flatten(0, 1), y.flatten())


def _gpt_state(mesh: fs.Mesh, n_layer: int = 2):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer))
    return model, fs.shard(model, fs.plan(model, policy=BLOCKS), mesh)


# -- a collective that never completes ------------------------------------------------------


def _rank1_never_joins(rank: int) -> tuple[str, float]:
    mesh = fs.Mesh(shard=2, timeout=timedelta(seconds=1))
    _, state = _gpt_state(mesh)
    if rank == 1:
        return "", 0.0  # rank 1 moves on; rank 0 gathers alone
    started = time.perf_counter()
    try:
        fs.unshard(state, units=["blocks.1"])
    except failures.CollectiveError as e:
        return str(e), time.perf_counter() - started
    return "no error", 0.0


def test_a_collective_that_never_completes_raises_within_the_timeout_naming_it():
    message, waited = testing.run(_rank1_never_joins, fresh=True, timeout=60)[0]
    assert message.startswith("rank 0: all_gather of unit 'blocks.1' over ranks [0, 1]"), message
    # where this rank's sequence stands, to compare with the other ranks' (e.g. under torchrun)
    last = re.search(r"The last funcshard collective this rank issued: #\d+, (.*)\.\n", message)
    assert last and last.group(1).startswith("all_gather of unit 'blocks.1' over ranks [0, 1]: ")
    assert "Mesh(check_collectives=True)" in message
    assert waited < 10


# -- ranks that take different paths --------------------------------------------------------


class ShapeDependent(nn.Module):
    """Runs `extra` only for long sequences: ranks with different batch shapes diverge."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 16)
        self.last = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if x.shape[0] > 4:
            h = h + self.extra(h)[:, :8]
        return self.last(h).sum()


def _diverging_batches(check: bool, rank: int) -> str:
    torch.manual_seed(0)
    model = ShapeDependent()
    mesh = fs.Mesh(shard=2, check_collectives=check, timeout=timedelta(seconds=2))
    policy = fs.policy.module_classes({nn.Linear})
    state = fs.shard(model, fs.plan(model, policy=policy), mesh)
    x = torch.randn(6 if rank == 0 else 3, 8)
    try:
        fs.value_and_grad(lambda s: fs.call(model, s, x))(state)
    except failures.CollectiveError as e:
        return str(e)
    return "no error"


def test_ranks_whose_batch_shapes_change_the_units_they_run_raise_together_when_checked():
    messages = testing.run(functools.partial(_diverging_batches, True), fresh=True, timeout=60)
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}: the ranks of group [0, 1] are about to issue")
        # rank 0 gathers `extra`; rank 1, which skipped it, is already in backward, reducing
        # `last`'s gradients (`first`, whose weight backward never reads, is not regathered)
        assert "rank 0: all_gather of 72 x torch.float32 for unit 'extra'" in message
        assert "rank 1: reduce_scatter of 10 x torch.float32 for unit 'last'" in message


def _timed_diverging_batches(rank: int) -> tuple[str, float]:
    started = time.perf_counter()
    return _diverging_batches(False, rank), time.perf_counter() - started


def test_unchecked_the_same_divergence_raises_on_both_ranks_within_the_timeout():
    # gloo aborted the process here (signal 6: 144 bytes arrived where 72 were expected)
    # before the exchanges' tags held their headers (see [Note: the exchange's header in its
    # tag] in funcshard/comm/_exchange.py); now each receive waits for its own collective
    results = testing.run(_timed_diverging_batches, fresh=True, timeout=60)
    for rank, (message, seconds) in enumerate(results):
        assert seconds < 2 + 20, seconds  # the mesh's timeout, and the reports
        assert message.startswith(f"rank {rank}: "), message
        assert "did not complete" in message, message
        assert f"rank {1 - rank}: last collective #" in message, message  # where the other is


# -- non-finite values ----------------------------------------------------------------------


def _poisoned_batch(rank: int, poison_rank: int, cfg: GPTConfig):
    x, y = random_tokens(cfg, 2, seed=rank)
    return x, y, rank == poison_rank


def _nan_loss(model, state, x, y, poison):
    loss = _gpt_loss(model, state, x, y)
    return loss * float("nan") if poison else loss


def _check_finite_raises(rank: int) -> str:
    model, state = _gpt_state(fs.Mesh(shard=2))
    x, y, poison = _poisoned_batch(rank, 1, model.cfg)
    grad_fn = fs.value_and_grad(functools.partial(_nan_loss, model), check_finite=True)
    try:
        grad_fn(state, x, y, poison)
    except NonFiniteError as e:
        return str(e)
    return "no error"


def test_check_finite_raises_on_every_rank_naming_where():
    messages = testing.run(_check_finite_raises)
    for message in messages:
        assert "NaN or inf in the loss on ranks [1]" in message
        assert "gradients of unit 'blocks.0' (on ranks [0, 1])" in message


def _inf_grad_of_first_weight(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Adds 0 to the output, and an infinite gradient to the module's first weight element:
    after the reduce-scatter only the rank owning that element sees it."""
    w = module.weight.flatten()[0]
    return out + torch.sqrt(w - w.detach())


def _skip_run(rank: int) -> dict:
    model, state = _gpt_state(fs.Mesh(shard=2))
    opt = fs.optim.skip_nonfinite(fs.optim.chain(fs.optim.clip_by_global_norm(1.0), _adamw()))
    opt_state = opt.init(state)
    grad_fn = fs.value_and_grad(functools.partial(_gpt_loss, model))
    before = fs.unshard(state)
    for step in range(3):
        x, y = random_tokens(model.cfg, 2, seed=rank)
        hook = None
        if step == 1 and rank == 1:  # rank 1's batch poisons blocks.0, shard of rank 0
            hook = model.blocks[0].ln1.register_forward_hook(_inf_grad_of_first_weight)
        _, grads = grad_fn(state, x, y)
        if hook is not None:
            hook.remove()
        updates, opt_state = opt.update(grads, opt_state, state, donate=True)
        state = fs.apply_updates(state, updates, donate=True)
        if step == 1:
            unchanged = all(torch.equal(before[k], v) for k, v in fs.unshard(state).items())
        before = fs.unshard(state)
    return {
        "skipped": int(opt_state.skipped),
        "unchanged_on_skip": unchanged,
        "params": fs.unshard(state),
        "finite": all(v.isfinite().all() for v in before.values()),
    }


def _adamw():
    return fs.optim.adamw(1e-2, eps=1e-3)


def test_skip_nonfinite_skips_on_every_rank_and_the_replicas_stay_equal():
    results = testing.run(_skip_run)
    for r in results:
        assert r["skipped"] == 1 and r["unchanged_on_skip"] and r["finite"]
    for k, v in results[0]["params"].items():
        assert torch.equal(v, results[1]["params"][k]), k


# -- determinism ----------------------------------------------------------------------------


def _train(mode: str, rank: int) -> dict:
    mesh = fs.Mesh(shard=2) if mode == "fsdp" else fs.Mesh(replicate=2)
    torch.manual_seed(1234)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2))
    if mode == "fsdp":
        state = fs.shard(model, fs.plan(model, policy=BLOCKS), mesh, seed=7)
    else:
        state = fs.replicate(model, mesh, seed=7)
    opt = _adamw()
    opt_state = opt.init(state)
    grad_fn = fs.value_and_grad(functools.partial(_gpt_loss, model))
    for step in range(3):
        x, y = random_tokens(model.cfg, 2, seed=100 * step + rank)
        _, grads = grad_fn(state, x, y)
        updates, opt_state = opt.update(grads, opt_state, state)
        state = fs.apply_updates(state, updates)
    return {"shards": [s.clone() for s in state.shards], "moments": opt_state.exp_avg_sq}


@pytest.mark.parametrize("mode", ["fsdp", "replicate"])
def test_two_runs_with_the_same_seeds_are_bitwise_identical(mode):
    first = testing.run(functools.partial(_train, mode))
    second = testing.run(functools.partial(_train, mode))
    for a, b in zip(first, second, strict=True):
        mine, again = [*a["shards"], *a["moments"]], [*b["shards"], *b["moments"]]
        for x, y in zip(mine, again, strict=True):
            assert torch.equal(x, y)


# -- donated records ------------------------------------------------------------------------


def _use_after_donation(rank: int) -> list[str]:
    model, state = _gpt_state(fs.Mesh(shard=2))
    opt = _adamw()
    opt_state = opt.init(state)
    x, y = random_tokens(model.cfg, 2, seed=rank)
    _, grads = fs.value_and_grad(functools.partial(_gpt_loss, model))(state, x, y)
    updates, opt_state = opt.update(grads, opt_state, state, donate=True)
    new_state = fs.apply_updates(state, updates, donate=True)
    messages = []
    for use in (
        lambda: fs.call(model, state, x),
        lambda: fs.unshard(state),
        lambda: opt.update(grads, opt_state, new_state),
        lambda: fs.apply_updates(state, updates),
    ):
        with pytest.raises(fs.DonatedError) as caught:
            use()
        messages.append(str(caught.value))
    fs.call(model, new_state, x)  # what the donating calls returned is live
    return messages


def _reads_after_a_fused_step(directory: str, rank: int) -> dict[str, str]:
    """Every way of reading a state, grads and optimizer state that `opt.step` donated."""
    model, state = _gpt_state(fs.Mesh(shard=2))
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), _adamw())
    opt_state = opt.init(state)
    x, y = random_tokens(model.cfg, 2, seed=rank)
    _, grads = fs.value_and_grad(functools.partial(_gpt_loss, model))(state, x, y)
    new_state, new_opt_state = opt.step(grads, opt_state, state)
    reads = {
        "a field": lambda: state.shards[0],
        "a buffer": lambda: state.buffers["attn_mask"],
        "replace": lambda: fs.unshard(state.replace()),
        "a tree map": lambda: torch.utils._pytree.tree_map(torch.clone, state),
        "the grads": lambda: grads.shards[0] * 2,
        "the optimizer state": lambda: opt_state.states[1].exp_avg[0],
        "a checkpoint": lambda: fs.checkpoint.save(directory, state, opt_state),
        "repr": lambda: repr(state),
    }
    seen = {}
    for name, read in reads.items():
        try:
            seen[name] = f"nothing raised: {read()!r}"[:80]
        except fs.DonatedError as e:
            seen[name] = str(e)
    seen["new"] = repr(fs.unshard(new_state)["wte.weight"].shape)  # the result is live
    torch.utils._pytree.tree_leaves(new_opt_state)
    return seen


def test_every_read_of_what_a_step_donated_raises(tmp_path):
    seen = testing.run(functools.partial(_reads_after_a_fused_step, str(tmp_path)))[0]
    assert seen.pop("repr") == "nothing raised: 'ShardedState(donated to Optimizer.step)'"
    assert seen.pop("new") == "torch.Size([61, 32])"
    for name, message in seen.items():
        assert "was donated to" in message, (name, message)
    assert "this value was donated to Optimizer.step" in seen["a field"]
    assert seen["replace"].startswith("funcshard.ShardedState.replace: this ShardedState")
    assert "this value was donated to Optimizer.step" in seen["the optimizer state"]
    assert "funcshard.checkpoint.save: this ShardedState was donated" in seen["a checkpoint"]


def test_a_donated_params_dict_raises_on_any_use():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    x = torch.randn(2, 4)
    _, grads = fs.value_and_grad(lambda p: fs.call(model, p, x).sum())(params)
    opt = fs.optim.adamw(1e-2)
    new, _ = opt.step(grads, opt.init(params), params)
    for use in (
        lambda: params["weight"] + 1,
        lambda: torch.mm(x, params["weight"].T),
        lambda: fs.call(model, params, x),
        lambda: grads["bias"].sum(),
        lambda: fs.apply_updates(params, grads),
    ):
        with pytest.raises(fs.DonatedError, match=r"donated to Optimizer\.step"):
            use()
    with pytest.raises(fs.DonatedError, match=r"funcshard\.call: this params dict was donated"):
        fs.call(model, params, x)
    assert fs.call(model, new, x).shape == (2, 3)


def test_a_donated_state_or_grads_cannot_be_used_again():
    messages = testing.run(_use_after_donation)[0]
    assert messages[0].startswith(
        "funcshard.call: this ShardedState was donated to apply_updates(donate=True)"
    )
    assert "funcshard.unshard: this ShardedState was donated" in messages[1]
    assert "this ShardedGrads was donated to an optimizer update(donate=True)" in messages[2]
    assert "Use the ShardedState that call returned" in messages[3]


# -- a rank that dies mid-step ----------------------------------------------------------------


def _die(module: nn.Module, args: tuple) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _rank1_killed_mid_forward(rank: int) -> None:
    model, state = _gpt_state(fs.Mesh(shard=2, timeout=timedelta(seconds=5)), n_layer=3)
    if rank == 1:
        model.blocks[1].register_forward_pre_hook(_die)
    x, y = random_tokens(model.cfg, 2, seed=rank)
    fs.value_and_grad(functools.partial(_gpt_loss, model))(state, x, y)


def test_a_rank_killed_mid_step_makes_the_survivor_raise_naming_the_collective():
    started = time.perf_counter()
    with pytest.raises(testing.RankDied, match="rank 1 died with signal 9") as caught:
        testing.run(_rank1_killed_mid_forward, fresh=True, timeout=60)
    survivor = caught.value.__cause__
    assert isinstance(survivor, failures.CollectiveError), survivor
    assert str(survivor).startswith("rank 0: all_gather of unit 'blocks.")
    assert "over ranks [0, 1] did not complete" in str(survivor)
    # the dead rank named as such: no hint about ranks that took different paths
    assert re.search(r"rank 1: its process \d+ has exited \(killed by a signal\?\)", str(survivor))
    assert "took different paths" not in str(survivor), survivor
    assert "SIGKILL: the out-of-memory killer" in str(caught.value)
    assert "mismatched collective" not in str(caught.value)
    assert time.perf_counter() - started < 20


# -- activation checkpointing inside funcshard.call ------------------------------------------


class Scaled(nn.Module):
    """A linear layer whose output is scaled by a buffer (read while it is recomputed)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) * self.scale).tanh()


class Checkpointed(nn.Module):
    """Three `Scaled` layers, each recomputed in backward when `checkpoint` is set."""

    def __init__(self, checkpoint: bool = True) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.layers = nn.ModuleList(Scaled() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x.square().mean()


class CheckpointedBlock(Block):
    """A GPT block recomputed in backward, as a whole and its MLP once more inside it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def inner(x):
            x = x + self.attn(self.ln1(x))
            mlp = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
            return x + mlp(self.mlp, self.ln2(x))

        return torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False)


class CheckpointedStack(GPT):
    """A GPT whose blocks are recomputed in backward together, by one checkpointed function."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))

        def blocks(x):
            for block in self.blocks:
                x = block(x)
            return x

        x = torch.utils.checkpoint.checkpoint(blocks, x, use_reentrant=False)
        return self.head(self.ln_f(x)) * self.cfg.d_model**-0.5


class CheckpointedRoot(GPT):
    """A GPT whose root modules are recomputed in backward: the final norm (right after the
    head's backward, the root's last reader) and, with `embedding`, the token embedding
    too (in the last backward node)."""

    embedding = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        recompute = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        tokens = recompute(self.wte, idx) if self.embedding else self.wte(idx)
        x = tokens + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(recompute(self.ln_f, x)) * self.cfg.d_model**-0.5


class CheckpointedEmbedding(CheckpointedRoot):
    embedding = True


def _grads_with_and_without_checkpointing(kind: str, rank: int) -> list:
    """The gradients of one step of a model whose layers are recomputed in backward, and of
    the same model computing them once: each (with, without) pair of leaves, and how many
    all-gathers each ran."""
    results, gathers = [], []
    for checkpoint in (True, False):
        torch.manual_seed(0)
        if kind.startswith("gpt"):
            with torch.device("meta"):
                model = GPT(GPTConfig(n_layer=2))
            if checkpoint and kind == "gpt spanning":
                model.__class__ = CheckpointedStack
            elif checkpoint and kind.startswith("gpt root"):
                embedding = kind == "gpt root and embedding"
                model.__class__ = CheckpointedEmbedding if embedding else CheckpointedRoot
            elif checkpoint:
                for block in model.blocks:
                    block.__class__ = CheckpointedBlock
            x, y = random_tokens(model.cfg, 2, seed=rank)
            reshard = kind != "gpt keep gathered"
            mp = fs.MixedPrecision(torch.bfloat16, torch.float32) if kind == "gpt bf16" else None
            mesh = fs.Mesh(replicate=2, shard=2) if kind == "gpt hsdp" else fs.Mesh(shard=2)
            plan = fs.plan(model, policy=fs.policy.module_classes({Block, CheckpointedBlock}))
            params = fs.shard(model, plan, mesh, mp=mp, reshard_after_forward=reshard)

            def loss(p, x=x, y=y, model=model):
                logits = fs.call(model, p, x)
                return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        else:
            model = Checkpointed(checkpoint)
            # an input that needs its gradient: backward reads every layer's weight, so a
            # recomputed unit is regathered exactly where backward regathers it anyway
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).requires_grad_()
            # trainable values that differ from the module's own weights
            params = {k: (v * 1.5).detach() for k, v in fs.extract(model)[0].items()}
            if kind == "fsdp":
                plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
                params = fs.reshard(fs.shard(model, plan, fs.Mesh(shard=2)), params)
            elif kind == "ddp":
                params = fs.reshard(fs.replicate(model, fs.Mesh(replicate=2)), params)
            else:
                params = {k: v.requires_grad_() for k, v in params.items()}

            def loss(p, x=x, model=model):
                return fs.call(model, p, x)

        with collectives.record() as log:
            grads = fs.value_and_grad(loss)(params)
        results.append(torch.utils._pytree.tree_leaves(grads))
        gathers.append(sum(r.op == "all_gather" for r in log))
    return list(zip(*results, strict=True)), gathers


@pytest.mark.parametrize(
    "kind",
    [
        "fsdp",
        "ddp",
        "dict",
        "gpt",
        "gpt keep gathered",
        "gpt bf16",
        "gpt hsdp",
        "gpt spanning",
        "gpt root",
        "gpt root and embedding",
    ],
)
def test_modules_recomputed_in_backward_get_the_calls_tensors_back(kind):
    world = 4 if kind == "gpt hsdp" else 2
    task = functools.partial(_grads_with_and_without_checkpointing, kind)
    # a recomputed unit is regathered only where backward regathers it anyway; the root,
    # which backward's saved views alone hold, once per step if recomputed after the head's
    # backward let go of it (see [Note: whole-call units in backward])
    regathered = 1 if kind.startswith("gpt root") else 0
    for pairs, gathers in testing.run(task, world):
        for with_checkpoint, without in pairs:
            torch.testing.assert_close(with_checkpoint, without, rtol=1e-6, atol=1e-7)
        assert gathers[0] == gathers[1] + regathered, gathers


def _two_calls_per_step(case: str, kind: str, rank: int) -> list:
    """Gradients with and without checkpointing of a loss that calls the model twice: the
    recomputation must use the tensors of the call whose graph it serves."""
    results = []
    for checkpoint in (True, False):
        torch.manual_seed(0)
        model = Checkpointed(checkpoint)
        params, _ = fs.extract(model)
        if kind == "fsdp":
            plan = fs.plan(model, policy=fs.policy.module_classes({Scaled}))
            params = fs.shard(model, plan, fs.Mesh(shard=2))
            teacher = fs.reshard(params, {k: v * 3 for k, v in fs.unshard(params).items()})
        else:
            params = {k: v.detach().requires_grad_() for k, v in params.items()}
            teacher = {k: v.detach() * 3 for k, v in params.items()}
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))

        def loss(p, x=x, model=model, teacher=teacher):
            if case == "other buffers":
                other = {f"layers.{i}.scale": 5 * x[0, i] for i in range(3)}
                return fs.call(model, p, x) + fs.call(model, p, x, buffers=other)
            with torch.no_grad():
                target = fs.call(model, teacher, x)
            return (fs.call(model, p, x) - target).square()

        results.append(torch.utils._pytree.tree_leaves(fs.value_and_grad(loss)(params)))
    return list(zip(*results, strict=True))


@pytest.mark.parametrize("kind", ["fsdp", "dict"])
@pytest.mark.parametrize("case", ["other buffers", "teacher without grad"])
def test_a_recomputed_module_gets_the_tensors_of_the_call_it_belongs_to(case, kind):
    for pairs in testing.run(functools.partial(_two_calls_per_step, case, kind)):
        for with_checkpoint, without in pairs:
            torch.testing.assert_close(with_checkpoint, without, rtol=1e-6, atol=1e-7)


def _checkpointed_whole_call(reentrant: bool, rank: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    policy = fs.policy.module_classes({nn.Linear})
    state = fs.shard(model, fs.plan(model, policy=policy), fs.Mesh(shard=2))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).requires_grad_()

    def checkpointed(s):
        run = functools.partial(fs.call, model, s)
        return torch.utils.checkpoint.checkpoint(run, x, use_reentrant=reentrant).square().sum()

    try:
        _, grads = fs.value_and_grad(checkpointed)(state)
    except RuntimeError as e:
        return str(e)
    _, expected = fs.value_and_grad(lambda s: fs.call(model, s, x).square().sum())(state)
    return all(torch.allclose(a, b) for a, b in zip(grads.shards, expected.shards, strict=True))


def test_a_reentrant_checkpoint_around_a_sharded_call_is_refused_the_other_kind_works():
    for message in testing.run(functools.partial(_checkpointed_whole_call, True)):
        assert "use_reentrant=True) around a call on a sharded state" in message
    assert all(testing.run(functools.partial(_checkpointed_whole_call, False)))


class _InnerCheckpoint(nn.Module):
    """A first layer checkpointed inside the model's own forward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.first, self.last, self.reentrant = nn.Linear(8, 8), nn.Linear(8, 1), reentrant

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.first, x, use_reentrant=self.reentrant)
        return self.last(torch.tanh(h))


def _checkpointed_inside_the_call(reentrant: bool, rank: int):
    torch.manual_seed(0)
    model = _InnerCheckpoint(reentrant)
    policy = fs.policy.module_classes({nn.Linear})
    state = fs.shard(model, fs.plan(model, policy=policy), fs.Mesh(shard=2))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    try:
        _, grads = fs.value_and_grad(lambda s: fs.call(model, s, x).square().sum())(state)
    except RuntimeError as e:
        return str(e)
    model.reentrant = None  # plain: no checkpoint
    model.forward = lambda x: model.last(torch.tanh(model.first(x)))
    _, expected = fs.value_and_grad(lambda s: fs.call(model, s, x).square().sum())(state)
    return all(torch.allclose(a, b) for a, b in zip(grads.shards, expected.shards, strict=True))


def test_a_reentrant_checkpoint_inside_a_sharded_call_is_refused_not_left_without_gradients():
    """Before: the checkpointed layer's parameters silently got zero gradients."""
    for message in testing.run(functools.partial(_checkpointed_inside_the_call, True)):
        assert "use_reentrant=True) around unit 'first' inside a call" in message
    assert all(testing.run(functools.partial(_checkpointed_inside_the_call, False)))


def test_collective_errors_name_the_root_unit_whose_name_is_empty():
    assert failures.unit_words("") == " of the root unit"
    assert failures.unit_words("blocks.0") == " of unit 'blocks.0'"
    assert failures.unit_words(None) == ""


@pytest.mark.timeout(120)
def test_under_torchrun_a_forced_hang_prints_each_ranks_last_collective():
    """Outside fs.testing.run too: rank 1 skips unit 'blocks.1''s all-gather and waits in a
    collective rank 0 never joins; each rank's CollectiveError, printed as the job fails,
    names the last funcshard collective it issued (op, unit, ranks, size), where the two
    sequences parted."""
    script = Path(__file__).parents[1] / "scripts" / "torchrun_hang.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=100, env=env)
    assert out.returncode != 0
    err = out.stderr
    assert "rank 0: all_gather of unit 'blocks.1' over ranks [0, 1] did not complete" in err, err
    assert re.search(
        r"\[rank0\]: The last funcshard collective this rank issued: #\d+, all_gather of unit "
        r"'blocks\.1' over ranks \[0, 1\]: \d+ x torch\.float32",
        err,
    ), err[-3000:]
    assert "rank 1: all_reduce over ranks [0, 1] did not complete" in err, err[-3000:]
    assert re.search(
        r"\[rank1\]: The last funcshard collective this rank issued: #\d+, all_reduce over "
        r"ranks \[0, 1\]: 5 x torch\.float32",
        err,
    ), err[-3000:]


def _each_eager_collective(rank: int) -> dict:
    """Every collective funcshard issues eagerly on gloo, with rank-dependent data: which
    API carried it (a held Work, or for all-gathers and reduce-scatters an exchange of held
    sends and receives, see [Note: eager collectives through Work objects]) and what came
    back."""
    group = fs.Mesh(shard=2).shard_group
    x = torch.arange(6.0) * (rank + 1)
    issued = {
        "all_gather": collectives.all_gather(x, group),
        "reduce_scatter avg": collectives.reduce_scatter(x.clone(), group, "avg", owned=True),
        "reduce_scatter sum": collectives.reduce_scatter(x, group, "sum"),
        "all_reduce": collectives.all_reduce(x, group, "sum"),
        "all_reduce in place": collectives.all_reduce(x.clone(), group, "avg", inplace=True),
        "all_to_all": collectives.all_to_all(x, group),
    }
    works = {
        name: isinstance(p._work, dist.Work | exchange.Exchange) for name, p in issued.items()
    }
    results = {name: p.wait().tolist() for name, p in reversed(issued.items())}
    assert x.tolist() == (torch.arange(6.0) * (rank + 1)).tolist()  # inputs not written
    return {"works": works, "results": results}


def test_eager_gloo_collectives_go_through_held_work_objects_with_the_same_results():
    """The functional ops' path through gloo crashes a process now and then
    (scripts/gloo_heap_repro.py); eager funcshard collectives on gloo hold a Work instead,
    with what the functional ops return. Waited out of issue order on purpose."""
    first, second = testing.run(_each_eager_collective, world_size=2)
    for got in (first, second):
        assert all(got["works"].values()), got["works"]
    a, b = torch.arange(6.0), torch.arange(6.0) * 2
    for rank, got in enumerate((first, second)):
        mine = slice(3 * rank, 3 * rank + 3)  # this rank's chunk of a reduce-scatter
        expected = {
            "all_gather": torch.cat([a, b]),
            "reduce_scatter avg": ((a + b) / 2)[mine],
            "reduce_scatter sum": (a + b)[mine],
            "all_reduce": a + b,
            "all_reduce in place": (a + b) / 2,
            "all_to_all": torch.cat([a[mine], b[mine]]),  # chunk `rank` of every rank's input
        }
        for name, want in expected.items():
            assert got["results"][name] == want.tolist(), (rank, name)


def _exchanges_in_flight(rank: int) -> tuple[list[list[float]], bool]:
    """Several gloo exchanges in flight at once on 3 ranks, of two sizes, waited newest
    first: each result must come from its own collective."""
    group = fs.Mesh(shard=3).shard_group
    sizes = (6, 12, 6, 3)
    issued = []
    for i, n in enumerate(sizes):
        x = torch.arange(float(n)) * (rank + 1) + 100 * i
        if i % 2:
            issued.append(collectives.reduce_scatter(x, group, "sum" if i == 1 else "avg"))
        else:
            issued.append(collectives.all_gather(x, group))
    results = [p.wait().tolist() for p in reversed(issued)][::-1]
    twin = exchange._carrier(group, 2, 0)  # messages to a lower rank: the group's twin
    same = twin is not group and dist.get_process_group_ranks(twin) == [0, 1, 2]
    return results, same and exchange._carrier(group, 0, 2) is group


def test_gloo_exchanges_in_flight_together_each_get_their_own_results_on_three_ranks():
    """Messages to higher ranks go through the group, to lower ranks through its twin (see
    [Note: gloo collectives as exchanges]); either way each result is its own."""
    results, twins = zip(*testing.run(_exchanges_in_flight, world_size=3), strict=True)
    assert all(twins), twins
    inputs = [
        [torch.arange(float(n)) * (r + 1) + 100 * i for r in range(3)]
        for i, n in enumerate((6, 12, 6, 3))
    ]
    for rank, got in enumerate(results):
        expected = [
            torch.cat(inputs[0]),
            sum(inputs[1]).view(3, -1)[rank],
            torch.cat(inputs[2]),
            (sum(inputs[3]) / 3).view(3, -1)[rank],
        ]
        assert got == [e.tolist() for e in expected], rank
