"""Reductions for metrics across data-parallel ranks: psum, pmean, the global gradient norm."""

import functools

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
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


def _norm(axes: dict, world: int, rank: int) -> tuple[float, float]:
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
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    return fs.global_norm(grads).item(), expected.item()


@pytest.mark.parametrize("mesh", ["fsdp 2", "ddp 2"])
def test_global_norm_is_the_one_process_total_norm_on_every_rank(mesh):
    axes, world = MESHES[mesh]
    for ours, plain in testing.run(functools.partial(_norm, axes, world), world_size=world):
        assert ours == pytest.approx(plain, rel=1e-5)


def test_global_norm_of_a_dict_of_gradients_is_this_process_total_norm():
    grads = {"a": torch.randn(3, 4), "b": None, "c": torch.randn(5)}
    expected = torch.linalg.vector_norm(torch.cat([grads["a"].reshape(-1), grads["c"]]))
    torch.testing.assert_close(fs.global_norm(grads), expected)
