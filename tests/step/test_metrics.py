"""Reductions for metrics across data-parallel ranks: psum, pmean, the global gradient norm."""

import functools
import time

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
from funcshard.comm import _collectives as collectives
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

MESHES = {
    "fsdp 2": ({"shard": 2}, 2),
    "ddp 2": ({"replicate": 2}, 2),
    "hsdp 2x2": ({"replicate": 2, "shard": 2}, 4),
}


def _metrics(axes: dict, rank: int) -> dict:
    mesh = fs.Mesh(**axes)
    g = torch.Generator().manual_seed(rank)
    mine = {"loss": torch.rand((), generator=g), "acc": [torch.rand(3, generator=g), 2.0 * rank]}
    return {"mine": mine, "mean": fs.pmean(mine, mesh), "sum": fs.psum(mine, mesh)}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_pmean_and_psum_are_the_mean_and_sum_over_every_rank_on_every_rank(mesh):
    axes, world = MESHES[mesh]
    results = testing.run(functools.partial(_metrics, axes), world_size=world)
    leaves = [torch.utils._pytree.tree_leaves(r["mine"]) for r in results]
    total = [sum(torch.as_tensor(v[i], dtype=torch.float64) for v in leaves) for i in range(3)]
    for r in results:
        for got, want in zip(torch.utils._pytree.tree_leaves(r["sum"]), total, strict=True):
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        for got, want in zip(torch.utils._pytree.tree_leaves(r["mean"]), total, strict=True):
            torch.testing.assert_close(got.double(), want / world, rtol=1e-6, atol=1e-6)
        assert r["mean"]["loss"].dtype == torch.float32  # leaves keep their dtype


def _norm(axes: dict, world: int, rank: int) -> list[tuple[float, ...]]:
    """Per norm type 1, 2, inf: (ours, clip_grad_norm_'s; after clipping to a third of it,
    ours of the clipped sharded gradients, clip_grad_norm_'s of its clipped ones)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(**axes)
    )
    x, y = random_tokens(model.cfg, 2 * world, seed=7)
    mine = slice(2 * rank, 2 * rank + 2)

    def loss(state, x, y):
        return F.cross_entropy(fs.call(model, state, x).flatten(0, 1), y.flatten())

    _, grads = fs.value_and_grad(loss)(state, x[mine], y[mine])
    plain = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    plain.backward()
    out = []
    for norm_type in (1, 2, float("inf")):
        params = [p.detach().clone().requires_grad_() for p in model.parameters()]
        for p, q in zip(params, model.parameters(), strict=True):
            p.grad = q.grad.clone()
        expected = torch.nn.utils.clip_grad_norm_(params, float("inf"), norm_type)
        ours = fs.global_norm(grads, norm_type)
        clip = fs.optim.clip_by_global_norm(ours.item() / 3, norm_type)
        clipped, _ = clip.update(grads, clip.init(state), state)
        torch.nn.utils.clip_grad_norm_(params, ours.item() / 3, norm_type)
        after = torch.nn.utils.clip_grad_norm_(params, float("inf"), norm_type)
        out.append((ours.item(), expected.item(), fs.global_norm(clipped, norm_type).item(),
                    after.item()))  # fmt: skip
    return out


@pytest.mark.parametrize("mesh", ["fsdp 2", "ddp 2"])
def test_global_norm_and_clipping_are_clip_grad_norm_for_norm_types_1_2_inf(mesh):
    """FSDP2's test_clip_grad_norm_1d (norm types 2, 1, inf), against one process."""
    axes, world = MESHES[mesh]
    for norms in testing.run(functools.partial(_norm, axes, world), world_size=world):
        for ours, plain, clipped, plain_clipped in norms:
            assert ours == pytest.approx(plain, rel=1e-5)
            assert clipped == pytest.approx(plain_clipped, rel=1e-5)
            assert clipped == pytest.approx(ours / 3, rel=1e-5)


def test_a_norm_type_other_than_1_2_inf_is_refused_naming_it():
    grads = {"a": torch.randn(3)}
    for norm_type in (3, 0.5, "fro", True):
        with pytest.raises(ValueError, match=f"norm_type must be 1, 2 or inf.*{norm_type!r}"):
            fs.global_norm(grads, norm_type)
        with pytest.raises(ValueError, match=f"clip_by_global_norm: norm_type.*{norm_type!r}"):
            fs.optim.clip_by_global_norm(1.0, norm_type)


def test_global_norm_of_a_dict_of_gradients_is_this_process_total_norm():
    grads = {"a": torch.randn(3, 4), "b": None, "c": torch.randn(5)}
    expected = torch.linalg.vector_norm(torch.cat([grads["a"].reshape(-1), grads["c"]]))
    torch.testing.assert_close(fs.global_norm(grads), expected)


# -- trees that differ across ranks ------------------------------------------------------------

DIFFERING = {  # case -> (rank 0's tree, rank 1's tree, what every rank's error must say)
    "a key only rank 0 has": (
        {"loss": torch.tensor(1.0), "acc": torch.tensor(0.5)},
        {"loss": torch.tensor(2.0)},
        ["['acc'] on rank 0 but not on rank 1"],
    ),
    "a key named otherwise": (
        {"loss": torch.tensor(1.0), "acc": torch.tensor(0.5)},
        {"loss": torch.tensor(2.0), "accuracy": torch.tensor(0.5)},
        ["['acc'] on rank 0 but not on rank 1", "['accuracy'] on rank 1 but not on rank 0"],
    ),
    "a shape": (
        {"loss": torch.tensor(1.0), "hist": torch.zeros(3)},
        {"loss": torch.tensor(2.0), "hist": torch.zeros(4)},
        ["['hist'] of shape (3,) on rank 0, (4,) on rank 1"],
    ),
    "a shape, in a large tree": (
        {"hist": torch.zeros(200)},
        {"hist": torch.zeros(300)},
        ["['hist'] of shape (200,) on rank 0, (300,) on rank 1"],
    ),
    "a dtype": (
        {"loss": torch.tensor(1.0), "acc": [torch.tensor(0.5)]},
        {"loss": torch.tensor(2.0), "acc": [torch.tensor(0.5, dtype=torch.bfloat16)]},
        ["['acc'][0] of dtype float32 on rank 0, bfloat16 on rank 1"],
    ),
}


def _differing(cases: list[str], reduce: str, rank: int) -> dict:
    mesh = fs.Mesh(shard=2)
    errors = {}
    for case in cases:
        try:
            getattr(fs, reduce)(DIFFERING[case][rank], mesh)
            errors[case] = None
        except ValueError as e:
            errors[case] = str(e)
    after = fs.psum({"one": torch.tensor(1.0)}, mesh)["one"].item()  # the ranks still agree
    return {"errors": errors, "after": after}


@pytest.mark.parametrize(
    "cases, reduce",
    [
        (["a key only rank 0 has", "a key named otherwise"], "pmean"),
        (["a shape", "a shape, in a large tree", "a dtype"], "psum"),
    ],
    ids=["keys", "shapes and dtypes"],
)
def test_trees_that_differ_across_ranks_are_refused_on_every_rank_naming_the_path(cases, reduce):
    """Metric dicts whose keys differed across ranks hung until the timeout (one rank's
    all-reduce was longer), or, with as many keys, were averaged key with the wrong key."""
    start = time.monotonic()
    results = testing.run(functools.partial(_differing, cases, reduce), world_size=2, timeout=30)
    assert time.monotonic() - start < 15
    for r in results:
        assert r["after"] == 2.0
        for case in cases:
            message = r["errors"][case]
            assert message is not None, case
            assert message.startswith(f"funcshard.{reduce}: the same leaves"), message
            assert "ranks [0, 1]" in message, message
            for words in DIFFERING[case][2]:
                assert words in message, message
    assert results[0]["errors"] == results[1]["errors"]  # every rank says the same


def _collectives_issued(rank: int) -> dict:
    mesh = fs.Mesh(shard=2)
    small = {"loss": torch.tensor(1.0), "acc": torch.tensor(0.5), "tokens": 4096, "step": 7}
    large = {"loss": torch.tensor(1.0), "hist": torch.ones(500), "half": torch.ones(3).half()}
    with collectives.record() as small_log:
        fs.pmean(small, mesh)
    with collectives.record() as large_log:
        fs.pmean(large, mesh)
    return {"small": small_log, "large": large_log}


def test_a_dict_of_metrics_is_checked_and_reduced_in_one_collective():
    """The check across ranks travels in the reduction (see [Note: checking a reduced tree
    across ranks]): a metrics dict of tensors and numbers issues one all-reduce (before:
    one per dtype); a tree too large for it issues that one first, then one per dtype."""
    for r in testing.run(_collectives_issued, world_size=2):
        assert [(c.op, c.dtype) for c in r["small"]] == [("all_reduce", torch.float64)]
        first, *rest = r["large"]
        assert first.numel == r["small"][0].numel  # the fixed-size checked buffer
        assert sorted(str(c.dtype) for c in rest) == ["torch.float16", "torch.float32"]


def _nested_records(rank: int) -> tuple[int, int, int]:
    mesh, metric = fs.Mesh(shard=2), {"loss": torch.tensor(float(rank))}
    with fs.comm.record() as outer:
        with fs.comm.record() as inner:  # (its log equals the outer one's when it ends)
            fs.psum(metric, mesh)
        fs.psum(metric, mesh)
        with fs.comm.record() as second:
            fs.psum(metric, mesh)
    return len(outer), len(inner), len(second)


def test_comm_records_nest_each_collecting_what_was_issued_inside_it():
    assert testing.run(_nested_records, world_size=2) == [(3, 1, 1)] * 2
