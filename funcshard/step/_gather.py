"""The differentiable gather: a sharded buffer's parameters as one autograd op whose backward
is the reduce.

[Note: one differentiable gather]
`gather(shard, ...)` returns the parameters one flat buffer holds, gathered from every rank's
shard; its backward is `funcshard.reduce` of their gradient: cast to the reduce dtype, frozen
members zeroed, a mean reduce-scatter over the shard axis and (on HSDP and DDP meshes) a mean
all-reduce across replicas, as JAX's all_gather transposes to psum_scatter. So `fs.call` on a
state is an ordinary differentiable function of `state.shards`, and `torch.autograd.grad`,
`torch.func` and `torch.compile` all see the whole computation; eager and traced steps share
this one op (`setup_context` style, which torch.func accepts).

Cotangent rule. Cotangents of shard-level tensors (`state.shards`, reduced gradients) are
true partial derivatives of one global scalar; cotangents of per-rank tensors (gathered
parameters, activations, a rank's loss) stand for the mean over data-parallel ranks, as
`fs.grad`'s loss does. Hence the gather's backward is a *mean* reduce-scatter, and the
backward of that reduce (`_ReduceFlat` in funcshard/step/_reduce_flat.py, for second order:
gradient penalties, MAML steps, Hessian-vector products) is a plain all-gather over the
shard axis, broadcast across replicas, not the exact adjoint, which would divide by the
world size a second time. Under this rule a rank's scalar made from its local shards (the
local dot of an HVP, a weight-decay term) counts as its part of a global sum, and one made
from activations as its part of a mean.

The op returns the buffer's parameters one by one (views of the gathered buffer made inside
the op, so autograd tracks no view of it) and its backward concatenates their gradients
once: slicing a flat output would make autograd build and sum one full-size gradient per
parameter.

Overlap, eagerly. A plain first-order backward (no `create_graph`, no vmap over it, no
anomaly mode, not traced) issues the reduce asynchronously and returns the in-flight result
to a wait node (`Deferred`): an identity on the shard, made when the call starts (one
autograd node for all of a call's shards, `wait_nodes`), whose backward waits for it in a
fixed order. Autograd runs ready nodes newest first, and the wait node is older than every
node of the call's compute, so it runs once backward is through the whole call: each reduce
overlaps everything backward does after it, and the waits come in one fixed order.
Collectives are issued in program order by construction: autograd's order on one thread is
the same on every rank. At most one reduce-scatter is in flight (`_Throttle` in
funcshard/step/_deferred_reduce.py): a backward that will issue one first waits for the
last, before it concatenates its own full-size input, so the last one's input is freed
before the next is made and backward holds one unit's full gradient at a time, not two.
Waiting after the concatenation held both, with the last one's receive buffers: the 10M
GPT of `benchmarks.muon` with owned blocks peaked there on 4 ranks. The wait comes one
copy of the gradient earlier, after the last reduce overlapped the unit's backward. On an
HSDP mesh the finished reduce-scatter's all-reduce across replicas starts then, and its
wait node waits for it. A wait node fed by two gathers (a unit gathered twice in one call)
would meet two in-flight results in autograd's sum, so both reduce synchronously.
Second-order, batched and traced backwards reduce synchronously through differentiable ops.

A user's gather and reduce (`funcshard.Comm`, see [Note: communication as user functions] in
funcshard/comm/_comm.py) take the place of the all-gather and the reduce-scatter in this same op:
the spec carries them, `issue_gather` calls the gather (synchronously: no prefetch) and the
reduce runs synchronously in backward (no overlap); without them every path is unchanged.

[Note: forward mode through the gather]
The tangent of an all-gather is the all-gather of the tangent: the op is linear. So `jvp`
gathers the shard's tangent as forward gathers the shard (the same dtype cast, one
all-gather over the shard axis) and views it per parameter; across replicas the tangents
are already equal, as the shards are. `torch.func.jvp` and `torch.autograd.forward_ad` both
reach it, through `_GatherForward`, the op with its `jvp`, used only for a shard that
carries a tangent or under torch.func transforms (`jvp` of `grad`: the outer tangent is not
visible on the inner level): dynamo refuses to trace a Function that defines a `jvp`. A shard that
carries a tangent does not require grad, so `Run` (in
funcshard/step/_unit_schedule.py) routes it through this op whenever it has a tangent;
before, it took the gather meant for no-grad calls, outside autograd, and the tangent came
out zero, silently. The reduce is linear too, and its jvp reduces the tangent
(`_ReduceFlat` in funcshard/step/_reduce_flat.py), so forward over reverse (`torch.func.jvp`
of `torch.func.grad`, a Hessian-vector product) works and equals double backward.

`reduction` says what the backward does: "mean" (the default), "shard" (HSDP without the
all-reduce across replicas) or "none": the unreduced full gradient goes to `sink`, a
full-size gradient target (`value_and_grad(reduce=False)`), and the shard gets none.
[Note: untraced without importing dynamo]
`_alone` reads reference counts, which dynamo must never trace nor compile as a frame of
its own (see its docstring). `torch.compiler.disable` does that, but as a decorator it
imports torch._dynamo when this module is imported: about 1 s of `import funcshard`, paid by
every script, torchrun rank and pool worker, most of which never compile. So the disable is
applied on first use instead, and only where dynamo is loaded: the caller calls
`_untraced(_alone)` (the disabled function, made once and cached) when "torch._dynamo" is
in `sys.modules`, and `_alone` itself otherwise. Nothing can be compiling before dynamo is
imported (torch.compile imports it first), so no dynamo frame hook can meet `_alone` then.
The choice is made inline in the caller, not in a wrapper of ours: a wrapper would be one
more Python frame for dynamo to compile. The caller skips both while dynamo traces it.

"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from funcshard.comm import _chaos as chaos
from funcshard.comm import _collectives as collectives
from funcshard.comm import _streams as streams
from funcshard.core._layout import in_buffer_order, param_views
from funcshard.step import _usage as usage
from funcshard.step._autograd_apply import apply_function, forward_mode
from funcshard.step._deferred_reduce import THROTTLE, Deferred
from funcshard.step._gather_spec import GatherSpec
from funcshard.step._reduce_flat import prepared, reduce
from funcshard.step._user_comm import user_gather


def issue_gather(shard: Tensor, spec: GatherSpec) -> collectives.Pending:
    """Start the all-gather of one buffer (cast to the gather dtype, on the mesh's device),
    outside autograd: a prefetch whose result `gather` takes as its `source`. A user's
    gather runs now, to its end."""
    if spec.user_gather:
        return collectives.Pending(user_gather(shard.detach(), spec), done=True)
    group = spec.mesh.shard_group
    if collectives.alone(group):  # the copy is the result: made on the compute stream
        data = shard.detach().to(spec.device, spec.gather_dtype, non_blocking=shard.is_pinned())
        return collectives.Pending(data, done=True)
    data = streams.copy_in(shard.detach(), spec.device, spec.gather_dtype)
    return collectives.all_gather(data, group, what=spec.flat.unit, loads=spec.flat.loads)


def gather(
    shard: Tensor,
    spec: GatherSpec,
    source: collectives.Pending | None = None,
    sink: Tensor | None = None,
    deferred: Deferred | None = None,
    on_backward: Callable[[], None] | None = None,
) -> tuple[Tensor, ...]:
    """The parameters of one flat buffer, gathered differentiably (see [Note: one
    differentiable gather]). `source` is an all-gather already issued (`issue_gather`).
    Given `deferred` (the shard behind its wait node, see `Deferred`), the gather reads that
    instead of `shard`, and its backward may reduce asynchronously. `on_backward` is called
    when the gather's backward starts (resharding drops the regathered buffer then).

    Communicates: one all-gather over the shard axis (unless `source` is given); backward:
    one reduce-scatter, plus one all-reduce across replicas.
    """
    if deferred is not None:
        deferred.gathers += 1
        shard = deferred.shard
    function = _GatherForward if forward_mode(shard) else _Gather
    return apply_function(function, shard, sink, spec, source, deferred, on_backward)


def gathered_buffer(params: tuple[Tensor, ...]) -> Tensor | None:
    """The gathered flat buffer a gather's parameters view (over a size-1 shard axis without
    a cast, the shard itself; None under torch.func, whose wrappers have no base)."""
    return params[0]._base if params else None


class _Gather(torch.autograd.Function):
    generate_vmap_rule = True  # vmap over a call's inputs meets the op with unbatched shards

    @staticmethod
    def forward(
        shard: Tensor,
        sink: Tensor | None,
        spec: GatherSpec,
        source: collectives.Pending | None,
        deferred: Deferred | None,
        on_backward: Callable[[], None] | None,
    ) -> tuple[Tensor, ...]:
        assert source is not None or deferred is None  # see Deferred
        full = source.wait() if source is not None else _all_gather(shard, spec)
        return param_views(full, spec.flat)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        shard, _, ctx.spec, _, ctx.deferred, ctx.on_backward = inputs
        ctx.shard_dtype, ctx.shard_device = shard.dtype, shard.device
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        spec: GatherSpec = ctx.spec
        chaos.point()
        usage.note(spec.flat, grads)  # see [Note: unused parameters]
        if ctx.on_backward is not None:
            ctx.on_backward()
        if _legacy_batched(grads):
            raise ValueError(
                f"funcshard: unit {spec.flat.unit!r}: batched gradients through a sharded "
                f"call (torch.autograd.grad(..., is_grads_batched=True), or "
                f"torch.autograd.functional.jacobian(vectorize=True)) are not supported: each "
                f"row would need its own reduce across ranks. Compute the rows one at a time."
            )
        deferring = (
            spec.reduction != "none"
            and ctx.deferred is not None
            and not spec.user_reduce
            and _may_defer(ctx.deferred)
        )
        # see [Note: reducing in place]; asked before _concat makes a view of the gradient
        # see [Note: untraced without importing dynamo]
        alone = (
            deferring
            and not torch.compiler.is_dynamo_compiling()
            and (_untraced(_alone) if "torch._dynamo" in sys.modules else _alone)(grads)
        )
        if deferring:  # before this unit's flat is made: see "Overlap, eagerly" above
            THROTTLE.settle()
        full = _concat(grads, spec)
        if spec.reduction == "none":
            return None, prepared(full, spec), None, None, None, None
        if deferring:
            grad = prepared(full, spec)
            # several gradients were concatenated into a new buffer
            writable = alone or len(grads) > 1 or not _shares_memory(grad, grads)
            return THROTTLE.issue(grad, spec, writable), None, None, None, None, None
        grad = reduce(full, spec).to(ctx.shard_device, ctx.shard_dtype)  # offload: to the host
        return grad, None, None, None, None, None


class _GatherForward(_Gather):
    """The gather with its `jvp`, for shards that carry a tangent: dynamo refuses to trace
    a Function that defines one, so compiled steps meet `_Gather` itself."""

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor | None, *_: Any) -> tuple[Tensor, ...]:
        """The parameters' tangents: the shard's tangent all-gathered (see [Note: forward
        mode through the gather])."""
        spec: GatherSpec = ctx.spec
        if tangent is None:  # only the sink had one: the shard's direction is zero
            tangent = torch.zeros(
                spec.flat.shard_numel, dtype=ctx.shard_dtype, device=ctx.shard_device
            )
        return param_views(_all_gather(tangent, spec), spec.flat)


def _legacy_batched(grads: tuple[Tensor | None, ...]) -> bool:
    """Whether backward runs under `is_grads_batched` (torch's legacy vmap; never traced)."""
    if torch.compiler.is_dynamo_compiling():
        return False
    batched = torch._C._functorch.is_legacy_batchedtensor
    return any([g is not None and batched(g) for g in grads])


def _may_defer(deferred: Deferred) -> bool:
    """Whether this backward may leave the reduce in flight for the wait node: a plain
    first-order backward (no create_graph, no vmap of it as in `is_grads_batched`, no
    anomaly mode, which reads every gradient at once), its wait node fed by this gather only."""
    return (
        deferred.alone()
        and not torch.is_grad_enabled()
        and not torch.is_anomaly_enabled()
        and not torch._C._are_functorch_transforms_active()
    )


def _all_gather(shard: Tensor, spec: GatherSpec) -> Tensor:
    if spec.user_gather:
        return user_gather(shard, spec)
    if torch.compiler.is_dynamo_compiling():
        data = shard.to(spec.mesh.device, spec.gather_dtype)
        return collectives.gathered(data, spec.mesh.shard_group)
    return issue_gather(shard, spec).wait()


def _concat(grads: tuple[Tensor | None, ...], spec: GatherSpec) -> Tensor:
    """One full (padded) flat gradient from the parameters' gradients; None counts as zero.

    In a first-order backward whose gradients are not in the reduce dtype (mixed precision,
    `comm_dtype`), the pieces are cast as they are concatenated: one flat copy in the
    reduce dtype, not a flat copy in the gradients' dtype and then a cast of it, which held
    both at once beside the pieces. (Differentiable backwards keep cat then cast.)"""
    flat = spec.flat
    like = next((g for g in grads if g is not None), None)
    dtype = like.dtype if like is not None else spec.gather_dtype
    device = like.device if like is not None else spec.device
    pieces = [
        torch.zeros(numel, dtype=dtype, device=device) if g is None else g
        for g, numel in zip(grads, flat.numels, strict=True)
    ]
    pieces = in_buffer_order(flat, pieces, lambda n: torch.zeros(n, dtype=dtype, device=device))
    if torch.compiler.is_dynamo_compiling():
        return torch.cat([p.reshape(-1) for p in pieces])
    if dtype != spec.reduce_dtype and not torch.is_grad_enabled():
        out = torch.empty(flat.padded_numel, dtype=spec.reduce_dtype, device=device)
        return torch.cat([p.reshape(-1) for p in pieces], out=out)
    return torch._utils._flatten_dense_tensors(pieces)  # one C++ call: reshape each, cat


# [Note: reducing in place]
# A DDP bucket's all-reduce runs in place, in the flat gradient backward just made, saving
# a second buffer of its size. But `_concat` makes nothing when a bucket holds one
# parameter (no padding over a size-1 shard axis, no cast): the flat is a view of the
# gradient autograd handed in, and autograd may have handed that same tensor to other
# nodes too (`a + bias` with `bias` the shape of `a`: AddBackward gives both inputs one
# tensor). An in-place all-reduce then averaged, across ranks and while still in flight,
# a gradient the rest of backward went on reading: the layers below got wrong gradients.
# Such a gradient is reduced in place only when nothing else holds its memory (`_alone`):
# no other reference to it (the test torch's AccumulateGrad makes before it steals an
# incoming gradient for `.grad`: a use count of one), and no other tensor on its storage
# but, for a view, its base, itself held by nothing else. A matmul's gradient, or a sum
# autograd made, passes (a linear layer's weight gradient is a transposed view of a
# matmul's output); a gradient passed through unchanged to two inputs does not, and is
# reduced into a copy. The counts are compared with those of a new tensor and of a view
# of one (`_FRESH`), as this torch counts them, so a torch that counts other references
# makes copies rather than write where it must not.
# `torch.compiler.disable(fn)`, made once per function (see [Note: untraced without
# importing dynamo]); the cache is a C callable, so a cached call opens no Python frame
_untraced = functools.cache(torch.compiler.disable)


def _alone(grads: tuple[Tensor | None, ...]) -> bool:
    """Whether the only gradient in `grads` is referenced from nowhere but here (see
    [Note: reducing in place]). False for several gradients: their flat is a new buffer.
    Never traced (callers skip it while dynamo traces, and call it through `_untraced`
    once dynamo is loaded): dynamo, running the eager part of a compiled step, recompiled
    its reference-count reads once per tensor rank."""
    if len(grads) != 1 or grads[0] is None:
        return False
    g = grads[0]
    base = g._base
    # (Tensor._use_count: a private torch API, absent from its stubs)
    if base is None:
        return (g._use_count(), _storage_users(g)) == _FRESH[:2]  # type: ignore[attr-defined]
    counts = (g._use_count(), _storage_users(g), base._use_count())  # type: ignore[attr-defined]
    return counts == _FRESH[2:]


def _storage_users(t: Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _fresh_counts() -> tuple[int, ...]:
    """The counts `_alone` reads, for a new tensor (its use count and its storage's) and
    for a view of a new tensor (the view's, its storage's and its base's use count)."""
    t = torch.empty(2, 2)
    view = torch.empty(2, 2).t()
    base = view._base
    assert base is not None  # a transpose is a view
    # (Tensor._use_count: a private torch API, absent from its stubs)
    return (
        t._use_count(),  # type: ignore[attr-defined]
        _storage_users(t),
        view._use_count(),  # type: ignore[attr-defined]
        _storage_users(view),
        base._use_count(),  # type: ignore[attr-defined]
    )


_FRESH = _fresh_counts()


def _shares_memory(flat: Tensor, grads: tuple[Tensor | None, ...]) -> bool:
    """Whether `flat` lies in the memory of one of the gradients it was made from."""
    ptr = flat.untyped_storage().data_ptr()
    return any(g is not None and g.untyped_storage().data_ptr() == ptr for g in grads)
