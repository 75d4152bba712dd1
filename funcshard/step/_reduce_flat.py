"""The reduce of one flat buffer's full gradient, the gather's transpose: a mean reduce-scatter
over the shard axis and a mean all-reduce across replicas, differentiably or outside autograd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.comm._comm import MeshAxis
from funcshard.core._layout import frozen_ranges
from funcshard.step._autograd_apply import apply_function, forward_mode
from funcshard.step._gather_spec import GatherSpec
from funcshard.step._user_comm import user_reduce


def prepared(full: Tensor, spec: GatherSpec) -> Tensor:
    """A full gradient in the reduce dtype with the frozen members of a trainable buffer
    zeroed (plan(frozen="warn")): what is reduced, or kept unreduced."""
    grad = full.to(spec.reduce_dtype)
    ranges = frozen_ranges(spec.flat) if spec.flat.frozen_fqns else ()
    if ranges:
        grad = grad.clone() if grad is full else grad
        for frozen in ranges:
            grad[frozen] = 0
    return grad


def reduce(full: Tensor, spec: GatherSpec) -> Tensor:
    """`funcshard.reduce` of one buffer's full gradient, differentiably (in the reduce dtype).

    Communicates: one reduce-scatter over the shard axis, plus one all-reduce across replicas
    for reduction "mean"; its backward one all-gather."""
    function = _ReduceFlatForward if forward_mode(full) else _ReduceFlat
    return apply_function(function, prepared(full, spec), spec)


class _ReduceFlat(torch.autograd.Function):
    """Mean reduce-scatter (and mean all-reduce across replicas); backward: all-gather."""

    @staticmethod
    def vmap(info: Any, in_dims: tuple, grad: Tensor, spec: GatherSpec) -> Any:
        raise ValueError(
            f"funcshard: unit {spec.flat.unit!r}: torch.func.vmap over a gradient of a "
            f"sharded state (per-example gradients) is not supported: the gather's backward "
            f"averages each gradient over the data-parallel ranks, which would mix example i "
            f"of every rank. Take per-example gradients of this rank's examples on the full "
            f"parameters instead: params = funcshard.unshard(state), then "
            f"torch.func.vmap(torch.func.grad(loss)) over funcshard.call(model, params, x)."
        )

    @staticmethod
    def forward(grad: Tensor, spec: GatherSpec) -> Tensor:
        mesh = spec.mesh
        if spec.user_reduce:
            grad = user_reduce(grad, spec)
        else:
            grad = collectives.reduced_scattered(grad, mesh.shard_group, "avg")
        if spec.across_replicas:
            grad = collectives.all_reduced(grad, mesh.replicate_group, "avg")
        return grad

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.spec = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        return _GatherFlat.apply(grad, ctx.spec), None


class _ReduceFlatForward(_ReduceFlat):
    """The reduce with its `jvp`, for a gradient that carries a tangent (dynamo refuses to
    trace a Function that defines one)."""

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, _: None) -> Tensor:
        """The reduce is linear: its tangent is the reduce of the tangent (forward over
        reverse, see [Note: forward mode through the gather] in funcshard/step/_gather.py)."""
        return _ReduceFlat.forward(tangent, ctx.spec)


def reduce_whole(
    full: Tensor, spec: GatherSpec, carry: Any = None, all_reduce: bool = True, op: str = "avg"
) -> tuple[Tensor, Any]:
    """One buffer's full gradient (prepared: reduce dtype, frozen members zeroed) to this
    rank's shard of its reduction by `op` over the mesh, outside autograd: the user's reduce
    over the shard axis when there is one (with its carry), then across replicas unless not
    `all_reduce`. On a DDP mesh the user's reduce is the reduction across replicas: it runs
    only when `all_reduce`. Returns `(shard, carry)`; the carry as given when no user reduce
    ran.

    Communicates: the user's reduce or one reduce-scatter over the shard axis; one
    all-reduce over the replicate axis (HSDP, DDP) unless the user's reduce was it."""
    mesh = spec.mesh
    users = spec.user_reduce and (all_reduce or not spec.replicated)
    if users:
        if carry is None:
            grad = user_reduce(full, spec)
        else:
            grad, carry = user_reduce(full, spec, carry)
        if op == "sum":
            grad = grad * spec.axis.size
    elif torch.compiler.is_dynamo_compiling():
        grad = MeshAxis(mesh, "shard").reduce_scatter(full, op)
    else:  # MeshAxis's reduce-scatter, with an owned unit's loads (see [Note: the uneven
        # exchange] in funcshard/comm/_exchange.py)
        what, loads = "<user reduce>", spec.flat.loads
        grad = collectives.reduce_scatter(full, mesh.shard_group, op, what, loads=loads).wait()
    across = not (users and spec.replicated)  # a DDP buffer's user reduce was the all-reduce
    if all_reduce and across and not collectives.alone(mesh.replicate_group):
        grad = MeshAxis(mesh, "replicate").all_reduce(grad, op)
    return grad, carry


class _GatherFlat(torch.autograd.Function):
    """All-gather over the shard axis of a reduced gradient's cotangent; backward: the mean
    reduce again (see the cotangent rule in [Note: one differentiable gather] in
    funcshard/step/_gather.py)."""

    @staticmethod
    def forward(shard: Tensor, spec: GatherSpec) -> Tensor:
        return collectives.gathered(shard, spec.mesh.shard_group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.spec = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        return _ReduceFlat.apply(grad, ctx.spec), None
