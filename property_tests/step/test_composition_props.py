"""Invariant 8, fuzzed: for a random module tree, plan and mesh, `torch.autograd.grad` and
`torch.func.grad` over the shards equal `fs.grad`, and a Hessian-vector product by double
backward over the shards, unsharded, equals one plain process's on the global batch."""

import functools
import warnings

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard import testing
from funcshard.testing import strategies

BATCH = 4  # rows of the global batch, split evenly over the data-parallel ranks


def _loss(model, state, x, target):
    return (fs.call(model, state, x) - target).square().mean()


def _global_batch(case, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = case.spec.example_input(BATCH, seed=seed)
    return x, torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1))


def _model_and_plan(case):
    model = case.spec.build().eval()  # eval: BatchNorm uses its running stats, per sample
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frozen and trainable mixed in a unit only warn
        return model, fs.plan(model, **case.kwargs(model))


def _trained(model, plan) -> list[str]:
    """The FQNs the state trains: not frozen (not even inside a trainable unit), not ignored."""
    frozen = {f for unit in plan.units for f in unit.frozen_fqns}
    return [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and n not in plan.ignored and n not in frozen
    ]


def _direction(model, trained: list[str], seed: int) -> dict[str, torch.Tensor]:
    """A random direction over the trained parameters (zero elsewhere), the same everywhere."""
    g = torch.Generator().manual_seed(seed + 2)
    return {
        n: torch.randn(p.shape, generator=g) if n in trained else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }


def _sharded(case, mesh_shape, seed: int, rank: int) -> tuple:
    model, plan = _model_and_plan(case)
    state = fs.shard(model, plan, mesh_shape.build())
    x, target = _global_batch(case, seed)
    rows = BATCH // mesh_shape.world_size
    x, target = x[rank * rows : (rank + 1) * rows], target[rank * rows : (rank + 1) * rows]

    def loss(s):
        return _loss(model, s, x, target)

    expected = fs.grad(loss)(state).shards
    leaves = tuple(
        s.detach().requires_grad_(not f.frozen)
        for s, f in zip(state.shards, state.layout.flats, strict=True)
    )
    trainable = [leaf for leaf in leaves if leaf.requires_grad]
    if not trainable:  # everything frozen or ignored: nothing to differentiate
        return [], [], [], {}
    by_autograd = torch.autograd.grad(loss(state.replace(shards=leaves)), trainable)
    by_func = torch.func.grad(lambda sh: loss(state.replace(shards=sh)))(state.shards)
    direction = _direction(model, _trained(model, plan), seed)
    v = fs.reshard(state, {k: direction[k] for k in fs.unshard(state)}).shards
    grads = torch.autograd.grad(loss(state.replace(shards=leaves)), trainable, create_graph=True)
    v_trainable = [vi for vi, leaf in zip(v, leaves, strict=True) if leaf.requires_grad]
    dot = sum((g * vi).sum() for g, vi in zip(grads, v_trainable, strict=True))
    hvp = iter(torch.autograd.grad(dot, trainable))
    full_hvp = fs.unshard(
        state.replace(
            shards=tuple(next(hvp) if leaf.requires_grad else leaf.detach() for leaf in leaves)
        )
    )
    return (
        [e for e in expected if e is not None],
        list(by_autograd),
        [g for g, f in zip(by_func, state.layout.flats, strict=True) if not f.frozen],
        full_hvp,
    )


def _plain_hvp(case, seed: int) -> dict[str, torch.Tensor]:
    model, plan = _model_and_plan(case)
    trained = _trained(model, plan)
    if not trained:
        return {}
    params = dict(model.named_parameters())
    x, target = _global_batch(case, seed)
    loss = (model(x) - target).square().mean()
    grads = torch.autograd.grad(loss, [params[n] for n in trained], create_graph=True)
    direction = _direction(model, trained, seed)
    dot = sum((g * direction[n]).sum() for g, n in zip(grads, trained, strict=True))
    return dict(zip(trained, torch.autograd.grad(dot, [params[n] for n in trained]), strict=True))


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within 1e-5 of the tensor's largest magnitude (fp32 roundoff in a sum of products)."""
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= 1e-5 * scale + 1e-6, f"{what}: off by {error:.2e} (largest |value| {scale:.2e})"


@settings(max_examples=15, deadline=None)
@given(
    case=strategies.plans(),
    mesh=strategies.meshes(world_sizes=(2, 4)),
    seed=st.integers(1, 2**20),
)
def test_autograd_and_torch_func_over_shards_equal_fs_grad_and_hvps_equal_one_process(
    case, mesh, seed
):
    results = testing.run(functools.partial(_sharded, case, mesh, seed), mesh.world_size)
    plain = _plain_hvp(case, seed)
    for rank, (expected, by_autograd, by_func, full_hvp) in enumerate(results):
        for i, (e, a, f) in enumerate(zip(expected, by_autograd, by_func, strict=True)):
            _close(a, e, f"rank {rank} buffer {i}: autograd.grad vs fs.grad")
            _close(f, e, f"rank {rank} buffer {i}: torch.func.grad vs fs.grad")
        for fqn, value in plain.items() if expected else ():
            _close(full_hvp[fqn], value, f"rank {rank} {fqn}: HVP vs one process")
