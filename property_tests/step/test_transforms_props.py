"""Laws of shard/unshard/reshard/reduce on real gloo ranks (hypothesis draws in the parent)."""

import functools

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard import testing
from funcshard.testing import strategies
from funcshard.testing.strategies import ParamBag


def _grads_of(params: dict, seed: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in params.items()}


def _padding_is_zero(shards, layout) -> bool:
    rank = layout.mesh.shard_rank
    for shard, flat in zip(shards, layout.flats, strict=True):
        if shard is None:
            continue
        start = rank * flat.shard_numel
        real = max(0, min(flat.numel - start, flat.shard_numel))
        if shard[real:].ne(0).any():
            return False
    return True


def _laws(params: dict, mesh_shape, min_numel: int, seed: int, rank: int) -> dict:
    model = ParamBag(params)
    plan = fs.plan(model, policy=fs.policy.size(min_numel))
    mesh = mesh_shape.build()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = fs.shard(model, plan, mesh)
    full = fs.unshard(state)
    full_before = {k: v.clone() for k, v in full.items()}
    again = fs.reshard(state, full)
    grads = _grads_of(params, seed, rank)
    grads_before = {k: v.clone() for k, v in grads.items()}
    reduced = fs.reduce(state, grads)

    ranks = range(mesh.size)
    mean = {
        k: torch.stack([_grads_of(params, seed, r)[k].double() for r in ranks]).mean(0)
        for k in params
    }
    expected = fs.reshard(state, {k: v.to(params[k].dtype) for k, v in mean.items()})
    return {
        "roundtrip": all(torch.equal(full[k], params[k]) for k in params),
        "dtypes": all(full[k].dtype == params[k].dtype for k in params),
        "reshard": all(torch.equal(a, b) for a, b in zip(state.shards, again.shards, strict=True)),
        "reduce_fp32_close": all(
            torch.allclose(r, e, rtol=1e-5, atol=1e-6)
            for r, e, flat in zip(reduced.shards, expected.shards, state.layout.flats, strict=True)
            if flat.dtype == torch.float32
        ),
        "reduce_bf16_close": all(
            torch.allclose(r.float(), e.float(), rtol=0.05, atol=0.05)
            for r, e, flat in zip(reduced.shards, expected.shards, state.layout.flats, strict=True)
            if flat.dtype == torch.bfloat16
        ),
        "padding": _padding_is_zero(state.shards, state.layout)
        and _padding_is_zero(again.shards, again.layout)
        and _padding_is_zero(reduced.shards, reduced.layout),
        "pure": all(torch.equal(p, before[k]) for k, p in model.named_parameters())
        and all(torch.equal(full[k], full_before[k]) for k in full)
        and all(torch.equal(grads[k], grads_before[k]) for k in grads),
    }


@settings(max_examples=30)
@given(
    params=strategies.pytrees(),
    mesh_shape=strategies.meshes(),
    min_numel=st.sampled_from([1, 10, 10_000]),
    seed=st.integers(0, 2**16),
)
@example(  # HSDP 2x2 with a 0-d bf16 parameter and one smaller than the shard size
    params={
        "a.weight": torch.linspace(-1, 1, 15).view(5, 3),
        "b.bias": torch.tensor(0.5).bfloat16(),
        "c.scale": torch.tensor([2.0]),
    },
    mesh_shape=strategies.MeshShape(replicate=2, shard=2),
    min_numel=10,
    seed=7,
)
def test_shard_unshard_reshard_reduce_laws_on_every_rank(params, mesh_shape, min_numel, seed):
    results = testing.run(
        functools.partial(_laws, params, mesh_shape, min_numel, seed),
        world_size=mesh_shape.world_size,
    )
    for rank, r in enumerate(results):
        assert r["roundtrip"] and r["dtypes"], f"rank {rank}: unshard(shard(p)) != p"
        assert r["reshard"], f"rank {rank}: reshard(unshard(s)) != s"
        assert r["reduce_fp32_close"], f"rank {rank}: reduce is not the mean gradient"
        assert r["reduce_bf16_close"], f"rank {rank}: bf16 reduce is off"
        assert r["padding"], f"rank {rank}: padding is not zero"
        assert r["pure"], f"rank {rank}: a transform wrote its input"
