"""A user optimizer inside `fs.optim.partition` may do with its group what it may do with a
state: `fs.unshard` its parameters (whole, by FQN), `fs.reshard` whole tensors back, and
`replace` the view's values. An EMA of the group's whole parameters and a hand-written
whole-parameter SGD, on 2 ranks, equal one process."""

import functools

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import testing

STEPS, LR, DECAY = 3, 0.1, 0.9
GLOBAL_BATCH = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def _matrices(fqn: str, p: torch.Tensor) -> str:
    return "whole" if p.ndim == 2 else "rest"


def _whole_sgd_with_ema() -> fs.optim.Optimizer:
    """SGD written on whole parameters (gather, step, slice back) that keeps an EMA of them."""

    def init(params):
        return {f: t.clone() for f, t in fs.unshard(params).items()}

    def update(grads, ema, params):
        full, full_grads = fs.unshard(params), fs.unshard(grads)
        stepped = {f: full[f] - LR * full_grads[f] for f in full}
        new = fs.reshard(params, stepped)  # the group's view again, this rank's pieces
        again = fs.unshard(params.replace(values=new.values))
        assert all(torch.equal(again[f], stepped[f]) for f in stepped)
        updates = fs.tree_map(torch.sub, new, params)
        return updates, {f: DECAY * ema[f] + (1 - DECAY) * full[f] for f in full}

    return fs.optim.Optimizer(init, update)


def _sharded_run(mesh: str, rank: int) -> dict:
    model = _model()
    plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
    if mesh == "fsdp":
        state = fs.shard(model, plan, fs.Mesh(shard=2))
    else:
        state = fs.replicate(model, fs.Mesh(replicate=2))
    opt = fs.optim.partition({"whole": _whole_sgd_with_ema(), "rest": fs.optim.sgd(LR)}, _matrices)
    opt_state = opt.init(state)
    loss_fn = fs.value_and_grad(lambda s, x, y: (fs.call(model, s, x) - y).square().mean())
    for step in range(STEPS):
        x, y = (t.chunk(2)[rank] for t in _batch(step))
        _, grads = loss_fn(state, x, y)
        state, opt_state = opt.step(grads, opt_state, state)
    return {"params": fs.unshard(state), "ema": dict(opt_state.states["whole"])}


def _reference() -> tuple[dict, dict]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ema = {f: p.detach().clone() for f, p in model.named_parameters() if p.ndim == 2}
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        ema = {f: DECAY * ema[f] + (1 - DECAY) * model.get_parameter(f).detach() for f in ema}
        opt.step()
    return {f: p.detach() for f, p in model.named_parameters()}, ema


@pytest.mark.parametrize("mesh", ["fsdp", "ddp"])
def test_a_partition_group_unshards_reshards_and_replaces_like_one_process(mesh):
    """Law: inside `partition`, `fs.unshard(group)` gives the group's whole parameters by
    FQN, `fs.reshard(group, whole)` and `group.replace(values=...)` give views of the group,
    so an EMA of whole parameters and a whole-parameter SGD equal one process.
    Regression: the group's view had no `replace`, and `unshard` raised AttributeError."""
    results = testing.run(functools.partial(_sharded_run, mesh), world_size=2)
    params, ema = _reference()
    for rank, r in enumerate(results):
        assert list(r["ema"]) == list(ema), (rank, list(r["ema"]))
        testing.compare.assert_trees_close(r["params"], params, rtol=1e-5, atol=1e-7)
        testing.compare.assert_trees_close(r["ema"], ema, rtol=1e-5, atol=1e-7)


def _refusals(rank: int) -> list[str]:
    model = _model()
    state = fs.shard(model, fs.plan(model, policy=lambda *a: False), fs.Mesh(shard=2))
    seen: list[str] = []

    def update(grads, s, params):
        for call in (
            lambda: fs.unshard(params, units=("",)),
            lambda: fs.reshard(params, {"0.weight": torch.zeros(8, 6)}),
            lambda: params.replace(shards=()),
        ):
            try:
                call()
            except (TypeError, ValueError) as e:
                seen.append(f"{type(e).__name__}: {e}")
        return fs.tree_map(torch.zeros_like, grads), s

    user = fs.optim.Optimizer(lambda p: fs.optim.EmptyState(), update)
    opt = fs.optim.partition({"whole": user, "rest": fs.optim.sgd(LR)}, _matrices)
    x, y = (t.chunk(2)[rank] for t in _batch(0))
    _, grads = fs.value_and_grad(lambda s: (fs.call(model, s, x) - y).square().mean())(state)
    opt.update(grads, opt.init(state), state)
    return seen


def test_a_group_refuses_units_and_whole_tensors_of_other_parameters():
    """Bad input: `unshard(group, units=...)`, a `reshard` whose tensors are not the
    group's and a `replace` of anything but values raise naming what to pass, before any
    collective."""
    for seen in testing.run(_refusals, world_size=2):
        assert len(seen) == 3, seen
        assert "units" in seen[0], seen[0]
        assert "2.weight" in seen[1], seen[1]
        assert "values" in seen[2], seen[2]
