"""Sharded calls and their gradients while torch.compile traces them.

[Note: the step under torch.compile]
Eagerly, `funcshard.call` gathers each unit from module hooks and `value_and_grad` reduces
each unit's gradient from autograd hooks the moment it is complete (see [Note: per-unit
gathering]). Dynamo cannot trace that machinery (hooks installed per call, context
variables, a backward that issues collectives as a side effect), and it need not: in a
traced step the schedule is the compiler's to choose. So while dynamo traces, the same
transforms are written as data flow instead:

- `call` all-gathers every flat buffer of the state through `_GatherReduce`, a
  differentiable op whose forward is `unshard` of one buffer (cast to the gather dtype,
  all-gather over the shard axis) and whose backward is `reduce` of its gradient (cast to
  the reduce dtype, frozen members zeroed, reduce-scatter over the shard axis and, on an
  HSDP or DDP mesh, all-reduce across replicas, both averaging);
- the gathered buffers are cut into parameter views and the model runs on them through the
  params-dict path (`funcshard.module.call`);
- `value_and_grad` makes leaves of the trainable shards, hands `f` the state with those
  leaves beside its shards (`_Differentiated`), and asks `torch.autograd.grad` for their
  gradients, which arrive already reduced to this rank's shard of the mean.

So the units' compute is traced with the shards as graph inputs, the collectives are
graph nodes (torch's functional collectives), and the compiled step is one graph; the
optimizer update, when traced in the same function, joins it. `torch.autograd.grad` is
traced only with `torch._dynamo.config.trace_autograd_ops = True` (off by default in
torch); without it dynamo breaks the graph there once per step, and everything still
works. Eager runs never take this path: `torch.compiler.is_dynamo_compiling()` is a
constant False outside dynamo. A traced `call` on a plain state with grad enabled (a
compiled loss inside an eager value_and_grad) runs the eager call instead: only that lets
the eager recorder see its units.

The price: each unit is gathered once and its buffers live until their last use in
backward, so a compiled step holds the whole model gathered at its peak
(`reshard_after_forward` and `offload` do not apply), where the eager step holds a few
units. Recomputing the gathers in backward (SimpleFSDP's activation-checkpoint tags) is
not done: torch's rematerialization of tagged nodes in a traced forward-loss-backward
graph did not take here, since backward reads the parameters through untagged views.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from funcshard import collectives, precision
from funcshard.layout import FlatLayout, frozen_ranges, param_views
from funcshard.mesh import Mesh
from funcshard.module import call as call_on_dict
from funcshard.precision import gather_dtype, reduce_dtype
from funcshard.state import LocalGrads, ShardedGrads, ShardedState
from funcshard.tree import register_record


class _GatherReduce(torch.autograd.Function):
    """Forward: one flat buffer gathered from this rank's shard. Backward: its gradient
    reduced back to this rank's shard, the mean over the data-parallel ranks (over the shard
    axis only with `across_replicas=False`)."""

    @staticmethod
    def forward(
        shard: Tensor, flat: FlatLayout, mesh: Mesh, mp: Any, across_replicas: bool
    ) -> Tensor:
        return _gathered(shard, flat, mesh, mp)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        shard, ctx.flat, ctx.mesh, ctx.mp, ctx.across_replicas = inputs
        ctx.shard_dtype, ctx.shard_device = shard.dtype, shard.device

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        mesh = ctx.mesh
        grad = _zero_frozen(grad.to(reduce_dtype(ctx.mp, ctx.flat)), ctx.flat)
        grad = collectives.reduced_scattered(grad, mesh.shard_group, "avg")
        if ctx.across_replicas:
            grad = collectives.all_reduced(grad, mesh.replicate_group, "avg")
        return grad.to(ctx.shard_device, ctx.shard_dtype), None, None, None, None


def _gathered(shard: Tensor, flat: FlatLayout, mesh: Mesh, mp: Any) -> Tensor:
    """`unshard` of one flat buffer: on the mesh's device, in the gather dtype."""
    return collectives.gathered(shard.to(mesh.device, gather_dtype(mp, flat)), mesh.shard_group)


def _zero_frozen(grad: Tensor, flat: FlatLayout) -> Tensor:
    """The gradient with the frozen members of a trainable buffer zeroed (frozen="warn")."""
    ranges = frozen_ranges(flat) if flat.frozen_fqns else ()
    if ranges:
        grad = grad.clone()
        for frozen in ranges:
            grad[frozen] = 0
    return grad


@dataclass(frozen=True, eq=False)
class _Differentiated(ShardedState):
    """The state `value_and_grad` hands to the function it differentiates while dynamo
    traces: the state itself (its `shards` unchanged), plus the `leaves` gradients are
    taken with respect to and how `call` gathers from them. `"mean"` and `"shard"` (HSDP
    without the all-reduce across replicas): leaves are the shards, gathered through
    `_GatherReduce`; `"none"` (reduce=False): leaves are the gathered buffers themselves.
    A frozen buffer's leaf is None (gathered from its shard without gradient)."""

    leaves: tuple[Tensor | None, ...] = ()
    reduction: str = "mean"


register_record(
    _Differentiated,
    data_fields=("shards", "replicated", "buffers", "leaves"),
    meta_fields=("layout", "mp", "reshard_after_forward", "offload", "reduction"),
)


def _full_buffer(state: ShardedState, i: int) -> Tensor:
    """Flat buffer `i` of the state, gathered (differentiably, for value_and_grad)."""
    flat, mesh = state.layout.flats[i], state.layout.mesh
    leaf = state.leaves[i] if isinstance(state, _Differentiated) else None
    if leaf is None:
        return _gathered(state.shards[i], flat, mesh, state.mp)
    if state.reduction == "none":
        return leaf
    return _GatherReduce.apply(leaf, flat, mesh, state.mp, state.reduction == "mean")


def differentiating(state: ShardedState) -> bool:
    """Whether `state` is the one a traced value_and_grad differentiates (else a plain
    traced call gathers it without gradient)."""
    return isinstance(state, _Differentiated)


def full_params(state: ShardedState) -> dict[str, Tensor]:
    """Every parameter of the state, gathered, by FQN (with the replicated ones)."""
    params: dict[str, Tensor] = dict(state.replicated)
    for i, flat in enumerate(state.layout.flats):
        params.update(zip(flat.fqns, param_views(_full_buffer(state, i), flat), strict=True))
    return params


def call(
    model: nn.Module,
    state: ShardedState,
    args: tuple,
    kwargs: dict,
    buffers: Mapping[str, Tensor] | None,
    mutable: bool,
    method: str,
) -> Any:
    """`funcshard.call` on a sharded state while dynamo traces (see the note above)."""
    args, kwargs = precision.cast_inputs(state.mp, args, kwargs)
    out, new_buffers = call_on_dict(
        model,
        full_params(state),
        *args,
        buffers=state.buffers if buffers is None else buffers,
        mutable=True,
        method=method,
        **kwargs,
    )
    out = precision.cast_outputs(state.mp, out)
    return (out, new_buffers) if mutable else out


def value_and_grad(
    f: Callable[..., Any],
    has_aux: bool,
    reduce: bool,
    all_reduce: bool,
    state: ShardedState,
    args: tuple,
    kwargs: dict,
    split: Callable[[Any, bool, str], tuple[Tensor, Any]],
) -> tuple[tuple[Tensor, Any], ShardedGrads | LocalGrads]:
    """`funcshard.value_and_grad` of `f` at a sharded state while dynamo traces: returns
    ((loss, aux), grads)."""
    layout = state.layout
    if reduce:
        inputs = state.shards
    else:  # differentiate with respect to the gathered buffers themselves
        inputs = tuple(
            _gathered(s, flat, layout.mesh, state.mp)
            for s, flat in zip(state.shards, layout.flats, strict=True)
        )
    leaves = tuple(
        None if flat.frozen else x.detach().requires_grad_()
        for x, flat in zip(inputs, layout.flats, strict=True)
    )
    traced = _Differentiated(  # (field by field: dynamo cannot trace dataclasses.fields)
        shards=state.shards,
        replicated=state.replicated,
        buffers=state.buffers,
        layout=layout,
        mp=state.mp,
        reshard_after_forward=state.reshard_after_forward,
        offload=state.offload,
        leaves=leaves,
        reduction="none" if not reduce else "mean" if all_reduce else "shard",
    )
    loss, aux = split(f(traced, *args, **kwargs), has_aux, "value_and_grad")
    trainable = [leaf for leaf in leaves if leaf is not None]
    found = iter(
        torch.autograd.grad(loss, trainable, allow_unused=True)
        if trainable and loss.requires_grad
        else [None] * len(trainable)
    )
    grads = [None if leaf is None else next(found) for leaf in leaves]
    grads = [
        torch.zeros_like(leaf) if leaf is not None and g is None else g
        for leaf, g in zip(leaves, grads, strict=True)
    ]
    if reduce:
        return (loss, aux), ShardedGrads(shards=tuple(grads), layout=layout)
    local: dict[str, Tensor | None] = {}
    for g, flat in zip(grads, layout.flats, strict=True):
        if g is None:
            local.update(dict.fromkeys(flat.fqns))
            continue
        g = _zero_frozen(g.to(reduce_dtype(state.mp, flat)), flat)
        local.update(zip(flat.fqns, param_views(g, flat), strict=True))
    return (loss, aux), LocalGrads(grads=local, layout=layout)
