"""Non-finite steps by default in a compiled step: `fs.compile(fullgraph=True)` keeps one
graph, the skip is a masked update, and the warning comes when the call returns; plain
torch.compile reads the flags where the optimizer is (a graph break), so it warns too.
"""

import functools
import warnings

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.testing.dynamo import isolated

MESHES = {
    "fsdp": (2, dict(shard=2)),
    "hsdp": (4, dict(replicate=2, shard=2)),
    "ddp": (2, dict(replicate=2)),
}
BATCHES = ("finite", "nan", "finite", "empty", "finite")  # rank 1's, step by step


def _batch(rank: int, step: int, kind: str) -> torch.Tensor:
    rows = 0 if kind == "empty" and rank == 1 else 4
    x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(10 * step + rank))
    if kind == "nan" and rank == 1:
        x[1, 3] = float("nan")
    return x


def _copy(params: dict) -> dict:
    """A copy (a replicated state's unshard hands out the parameters an update writes into)."""
    return {k: v.clone() for k, v in params.items()}


@isolated(trace_autograd_ops=False)  # (fs.compile turns it on for its own calls)
def _train(mesh_kwargs: dict, how: str, rank: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    if mesh_kwargs.get("shard", 1) == 1:
        state = fs.replicate(model, fs.Mesh(**mesh_kwargs))
    else:
        plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
        state = fs.shard(model, plan, fs.Mesh(**mesh_kwargs))
    opt = fs.optim.adamw(1e-2)

    def loss_fn(state, x):
        return fs.call(model, state, x).square().mean()

    def step(state, opt_state, x):
        _, grads = fs.value_and_grad(loss_fn)(state, x)
        if how == "update":
            updates, opt_state = opt.update(grads, opt_state, state)
            return fs.apply_updates(state, updates), opt_state
        return opt.step(grads, opt_state, state)

    if how == "plain torch.compile":
        compiled = torch.compile(step, backend="aot_eager")
    else:
        compiled = fs.compile(step, backend="aot_eager", fullgraph=True)
    opt_state, out = opt.init(state), []
    for i, kind in enumerate(BATCHES):
        before = _copy(fs.unshard(state))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, opt_state = compiled(state, opt_state, _batch(rank, i, kind))
        after = fs.unshard(state)
        said = [str(w.message) for w in caught if w.category is fs.NonFiniteWarning]
        out[len(out) :] = [(kind, all(torch.equal(before[k], after[k]) for k in before),
                            int(opt_state.step), said)]  # fmt: skip
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return {"steps": out, "breaks": breaks}


def _check(results: list[dict], fullgraph: bool) -> None:
    for rank, r in enumerate(results):
        steps = r["steps"]
        taken = [s for s in steps if s[0] == "finite"]
        assert all(not intact and not said for _, intact, _, said in taken), (rank, steps)
        assert [count for _, _, count, _ in steps] == [1, 1, 2, 2, 3], (rank, steps)
        (_, nan_intact, _, nan_said), (_, empty_intact, _, empty_said) = steps[1], steps[3]
        assert nan_intact and empty_intact, (rank, steps)
        assert len(nan_said) == 1 and "skipped this step on every rank" in nan_said[0]
        assert "NaN or inf in the loss on ranks [1]; gradients of unit" in nan_said[0]
        assert len(empty_said) == 1 and "an empty batch on those ranks?" in empty_said[0]
        if fullgraph:
            assert r["breaks"] == 0, r


# (the update path differs from opt.step in the optimizer alone: one mesh is enough)
@pytest.mark.parametrize(
    "mesh, how", [("fsdp", "step"), ("fsdp", "update"), ("hsdp", "step"), ("ddp", "step")]
)
def test_a_compiled_step_masks_a_bad_batch_on_one_rank_and_warns_on_every_rank(mesh, how):
    world, mesh_kwargs = MESHES[mesh]
    results = testing.run(functools.partial(_train, mesh_kwargs, how), world, timeout=300)
    _check(results, fullgraph=True)


def test_plain_torch_compile_reads_the_flags_where_the_optimizer_is_and_warns():
    results = testing.run(
        functools.partial(_train, MESHES["fsdp"][1], "plain torch.compile"), 2, timeout=300
    )
    _check(results, fullgraph=False)
