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
backward of that reduce (`_ReduceFlat`, for second order: gradient penalties, MAML steps,
Hessian-vector products) is a plain all-gather over the shard axis, broadcast across replicas,
not the exact adjoint, which would divide by the world size a second time. Under this rule a
rank's scalar made from its local shards (the local dot of an HVP, a weight-decay term)
counts as its part of a global sum, and one made from activations as its part of a mean.

The op returns the buffer's parameters one by one (views of the gathered buffer made inside
the op, so autograd tracks no view of it) and its backward concatenates their gradients
once: slicing a flat output would make autograd build and sum one full-size gradient per
parameter.

Overlap, eagerly. A plain first-order backward (no `create_graph`, no vmap over it, no
anomaly mode, not traced) issues the reduce asynchronously and returns the in-flight result
to a wait node (`Deferred`): an identity on the shard, made when the call starts (one
autograd node for all of a call's shards, `wait_nodes`), whose backward waits for it in a
fixed order. Autograd runs ready nodes newest first, and the wait node is older
than every node of the call's compute, so it runs once backward is through the whole call:
each reduce overlaps everything backward does after it, and the waits come in one fixed
order. Collectives are issued in program order by construction: autograd's order on one
thread is the same on every rank. At most one reduce-scatter is in flight (`_Throttle`):
issuing one first waits for the last, which frees its full-size input, so backward never
holds every unit's full gradient; on an HSDP mesh the finished reduce-scatter's all-reduce
across replicas starts then, and its wait node waits for it. A wait node fed by two gathers
(a unit gathered twice in one call) would meet two in-flight results in autograd's sum, so
both reduce synchronously. Second-order, batched and traced backwards reduce synchronously
through differentiable ops.

A user's gather and reduce (`funcshard.Comm`, see [Note: communication as user functions] in
funcshard/comm.py) take the place of the all-gather and the reduce-scatter in this same op:
the spec carries them, `issue_gather` calls the gather (synchronously: no prefetch) and the
reduce runs synchronously in backward (no overlap); without them every path is unchanged.

`reduction` says what the backward does: "mean" (the default), "shard" (HSDP without the
all-reduce across replicas) or "none": the unreduced full gradient goes to `sink`, a
full-size gradient target (`value_and_grad(reduce=False)`), and the shard gets none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from funcshard import chaos, collectives
from funcshard.comm import Comm, MeshAxis
from funcshard.layout import FlatLayout, Layout, frozen_ranges, param_views
from funcshard.mesh import Mesh
from funcshard.precision import MixedPrecision, gather_dtype, reduce_dtype
from funcshard.state import ShardedState
from funcshard.tree import register_record


@dataclass(frozen=True)
class GatherSpec:
    """What the gather of one flat buffer needs: where, in what dtypes, and which reduce
    transposes it. `gather_dtype`, `reduce_dtype` and `device` are derived once."""

    flat: FlatLayout
    mesh: Mesh
    mp: MixedPrecision | None
    reduction: str = "mean"  # "mean" | "shard" | "none"
    comm: Comm | None = None  # the user's gather and reduce, if any

    @property
    def user_gather(self) -> bool:
        return self.comm is not None and self.comm.gather is not None and self.mesh.shard > 1

    @property
    def user_reduce(self) -> bool:
        """Whether the user's reduce replaces funcshard's: over the shard axis, or on a DDP
        mesh (a one-rank shard axis) over the replicate axis, in place of the all-reduce
        (reduction "mean" only: without the all-reduce there is nothing to replace)."""
        if self.comm is None or self.comm.reduce is None:
            return False
        return self.mesh.shard > 1 or (self.replicated and self.reduction == "mean")

    @property
    def replicated(self) -> bool:
        """Whether this is a DDP buffer: whole on every rank of a replicate axis."""
        return self.mesh.shard == 1 and self.mesh.replicate > 1

    @property
    def across_replicas(self) -> bool:
        if self.replicated and self.user_reduce:  # the user's reduce is the all-reduce
            return False
        return self.reduction == "mean" and not collectives.alone(self.mesh.replicate_group)

    def __post_init__(self) -> None:
        # computed once per spec (specs are made once per layout: `_specs`), not per step
        object.__setattr__(self, "gather_dtype", gather_dtype(self.mp, self.flat))
        object.__setattr__(self, "reduce_dtype", reduce_dtype(self.mp, self.flat))
        object.__setattr__(self, "device", self.mesh.device)  # the mesh's device then
        # what a user's gather and reduce receive: see [Note: what a Comm is told about its
        # buffer]; over the replicate axis on a DDP mesh, whose shard axis has one rank
        axis = "replicate" if self.replicated else "shard"
        object.__setattr__(self, "axis", MeshAxis.of_buffer(self.mesh, axis, self.flat))


@dataclass(frozen=True, eq=False)
class Differentiated(ShardedState):
    """The state `funcshard.value_and_grad` hands the function it differentiates: the state
    itself, plus how its gathers are transposed (`reduction`: "mean", "shard" or "none"),
    the full-size gradient targets of reduction "none" (`sinks`, None for frozen buffers),
    the prefetch orders of its calls, the buffers a GatheredState keeps gathered
    (`gathered`, empty otherwise: see [Note: keeping units gathered]), and the user
    communication its calls default to (`comm`, a `funcshard.Comm` of value_and_grad's
    arguments: the caller's state never holds it)."""

    reduction: str = "mean"
    sinks: tuple[Tensor | None, ...] | None = None
    prefetch: Any = True
    gathered: tuple[Tensor, ...] = ()
    comm: Comm | None = None


register_record(
    Differentiated,
    data_fields=("shards", "replicated", "buffers", "sinks", "gathered"),
    meta_fields=(
        "layout",
        "mp",
        "reshard_after_forward",
        "offload",
        "reduction",
        "prefetch",
        "comm",
    ),
)


def specs_and_sinks(
    state: ShardedState, comm: Comm | None = None
) -> tuple[tuple[GatherSpec, ...], tuple[Tensor | None, ...]]:
    """How each flat buffer of `state` is gathered, and its gradient sink (None but under
    `value_and_grad(reduce=False)`): what the eager and the traced call both need. `comm`
    is the call's own; without it, value_and_grad's (if any)."""
    differentiated = isinstance(state, Differentiated)
    reduction = state.reduction if differentiated else "mean"
    if comm is None and differentiated:
        comm = state.comm
    if comm is not None and not isinstance(comm, Comm):
        raise TypeError(f"funcshard.call: comm must be a funcshard.Comm, got {comm!r}.")
    layout = state.layout
    mesh = layout.mesh
    if comm is not None and comm.gather is not None and mesh.shard == 1 and mesh.replicate > 1:
        raise ValueError(
            f"funcshard.Comm: this state is replicated (DDP: its shard axis has one rank), so "
            f"it gathers nothing and the Comm's gather would never run, got "
            f"gather={comm.gather!r}. Pass funcshard.Comm(reduce=...) alone (on a DDP state "
            f"it replaces the all-reduce across replicas), or shard the state (fs.shard, or "
            f"an HSDP mesh) to use a gather."
        )
    specs = _specs(layout, state.mp, reduction, comm)
    sinks = state.sinks if differentiated and state.sinks is not None else None
    return specs, sinks if sinks is not None else (None,) * len(specs)


def _specs(
    layout: Layout, mp: MixedPrecision | None, reduction: str, comm: Comm | None
) -> tuple[GatherSpec, ...]:
    """The gather specs of a layout's buffers, made once per (layout, mp, reduction, comm)
    object and reused by every later call with the same ones: their cached dtypes and
    device are then computed once, not per step."""
    if torch.compiler.is_dynamo_compiling():
        return tuple(GatherSpec(flat, layout.mesh, mp, reduction, comm) for flat in layout.flats)
    key = (id(layout), id(mp), reduction, id(comm))
    hit = _SPECS.get(key)
    if hit is not None and hit[0] is layout and hit[1] is mp and hit[2] is comm:
        return hit[3]
    specs = tuple(GatherSpec(flat, layout.mesh, mp, reduction, comm) for flat in layout.flats)
    if len(_SPECS) >= _SPECS_KEPT:
        _SPECS.pop(next(iter(_SPECS)))  # the oldest: states of finished runs
    _SPECS[key] = (layout, mp, comm, specs)  # holding them keeps the ids from being reused
    return specs


_SPECS: dict[tuple, tuple[Layout, MixedPrecision | None, Comm | None, tuple]] = {}
_SPECS_KEPT = 64


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
    data = collectives.copy_in(shard.detach(), spec.device, spec.gather_dtype)
    return collectives.all_gather(data, group, what=spec.flat.unit)


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
    return _apply(_Gather, shard, sink, spec, source, deferred, on_backward)


def _apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """`function.apply(*args)` with every argument given positionally.

    `Function.apply` of a setup_context-style function binds the arguments through
    `inspect.signature` first, ~30 us a call and the largest part of funcshard's own CPU
    time per unit; outside torch.func transforms and dynamo it then only unwraps tensors
    left over from finished transforms and calls the C++ apply, which this does directly."""
    if torch._C._are_functorch_transforms_active() or torch.compiler.is_dynamo_compiling():
        return function.apply(*args)
    unwrap = torch._C._functorch.unwrap_if_dead
    args = [unwrap(a) if isinstance(a, Tensor) else a for a in args]  # (a list comprehension:
    # a generator resumes once per item, and this runs per unit and step)
    return super(torch.autograd.Function, function).apply(*args)


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
        alone = deferring and not torch.compiler.is_dynamo_compiling() and _alone(grads)
        full = _concat(grads, spec)
        if spec.reduction == "none":
            return None, _prepared(full, spec), None, None, None, None
        if deferring:
            grad = _prepared(full, spec)
            # several gradients were concatenated into a new buffer
            writable = alone or len(grads) > 1 or not _shares_memory(grad, grads)
            return _THROTTLE.issue(grad, spec, writable), None, None, None, None, None
        grad = reduce(full, spec).to(ctx.shard_device, ctx.shard_dtype)  # offload: to the host
        return grad, None, None, None, None, None


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


def user_gather(shard: Tensor, spec: GatherSpec) -> Tensor:
    """The user's gather of one buffer (see [Note: communication as user functions]), its
    result checked and cast to the gather dtype."""
    assert spec.comm is not None and spec.comm.gather is not None
    full = spec.comm.gather(shard.to(spec.mesh.device), spec.axis)
    _check_user_result(full, spec.flat.padded_numel, spec, "gather")
    return full.reshape(-1).to(spec.gather_dtype)


def _check_user_result(out: object, numel: int, spec: GatherSpec, which: str) -> None:
    if not isinstance(out, Tensor) or out.numel() != numel:
        got = f"{tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"funcshard.Comm: the {which} of unit {spec.flat.unit!r} must return a tensor of "
            f"{numel} elements (the flat buffer's {'whole' if which == 'gather' else 'shard'}"
            f"), got {got}."
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
    if flat.padded_numel > flat.numel:
        pieces.append(torch.zeros(flat.padded_numel - flat.numel, dtype=dtype, device=device))
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
@torch.compiler.disable
def _alone(grads: tuple[Tensor | None, ...]) -> bool:
    """Whether the only gradient in `grads` is referenced from nowhere but here (see
    [Note: reducing in place]). False for several gradients: their flat is a new buffer.
    Never traced (callers skip it while dynamo traces): dynamo, running the eager part of
    a compiled step, recompiled its reference-count reads once per tensor rank."""
    if len(grads) != 1 or grads[0] is None:
        return False
    g = grads[0]
    base = g._base
    if base is None:
        return (g._use_count(), _storage_users(g)) == _FRESH[:2]
    return (g._use_count(), _storage_users(g), base._use_count()) == _FRESH[2:]


def _storage_users(t: Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _fresh_counts() -> tuple[int, ...]:
    """The counts `_alone` reads, for a new tensor (its use count and its storage's) and
    for a view of a new tensor (the view's, its storage's and its base's use count)."""
    t = torch.empty(2, 2)
    view = torch.empty(2, 2).t()
    base = view._base
    return (
        t._use_count(),
        _storage_users(t),
        view._use_count(),
        _storage_users(view),
        base._use_count(),
    )


_FRESH = _fresh_counts()


def _shares_memory(flat: Tensor, grads: tuple[Tensor | None, ...]) -> bool:
    """Whether `flat` lies in the memory of one of the gradients it was made from."""
    ptr = flat.untyped_storage().data_ptr()
    return any(g is not None and g.untyped_storage().data_ptr() == ptr for g in grads)


def _prepared(full: Tensor, spec: GatherSpec) -> Tensor:
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
    return _apply(_ReduceFlat, _prepared(full, spec), spec)


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


def user_reduce(grad: Tensor, spec: GatherSpec, carry: Any = None) -> Any:
    """The user's reduce of one buffer's full gradient over the shard axis, or a DDP
    buffer's over the replicate axis (see [Note: communication as user functions]): this
    rank's chunk of the mean (a DDP buffer's whole mean), in `grad`'s dtype; with a carry,
    `(chunk, new carry)`."""
    assert spec.comm is not None and spec.comm.reduce is not None
    axis = spec.axis
    if carry is None:
        out, new_carry = spec.comm.reduce(grad, axis), None
    else:
        out = spec.comm.reduce(grad, axis, carry)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(
                f"funcshard.Comm: a reduce given a carry must return (shard, carry), got "
                f"{type(out).__name__} for unit {spec.flat.unit!r}."
            )
        out, new_carry = out
    _check_user_result(out, spec.flat.shard_numel, spec, "reduce")
    out = out.reshape(-1).to(grad.dtype)
    return out if carry is None else (out, new_carry)


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
    else:
        grad = MeshAxis(mesh, "shard").reduce_scatter(full, op)
    across = not (users and spec.replicated)  # a DDP buffer's user reduce was the all-reduce
    if all_reduce and across and not collectives.alone(mesh.replicate_group):
        grad = MeshAxis(mesh, "replicate").all_reduce(grad, op)
    return grad, carry


class _GatherFlat(torch.autograd.Function):
    """All-gather over the shard axis of a reduced gradient's cotangent; backward: the mean
    reduce again (see the cotangent rule in [Note: one differentiable gather])."""

    @staticmethod
    def forward(shard: Tensor, spec: GatherSpec) -> Tensor:
        return collectives.gathered(shard, spec.mesh.shard_group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.spec = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        return _ReduceFlat.apply(grad, ctx.spec), None


class Deferred:
    """A shard behind a wait node whose backward waits for the asynchronous reduce of its
    gradient (see [Note: one differentiable gather]); made by `wait_nodes` when the call
    starts, before any compute, so that the wait runs at the end of backward.

    Only one gather may reduce asynchronously into it: a second gather reading the same
    node would meet the first one's in-flight result in autograd's sum at its input, so both
    reduce synchronously then (`alone`). The node's output is in the reduce dtype, the dtype
    of the in-flight result (autograd would cast a gradient of another dtype at once, reading
    it before it lands); a gather fed by it takes its values from an issued `source`.
    """

    __slots__ = ("gathers", "shard")

    def __init__(self, shard: Tensor) -> None:
        self.shard = shard
        self.gathers = 0

    def alone(self) -> bool:
        return self.gathers == 1


def wait_nodes(
    shards: tuple[Tensor, ...], specs: tuple[GatherSpec, ...], chosen: tuple[bool, ...]
) -> tuple[Deferred | None, ...]:
    """A `Deferred` for each chosen shard (None for the others), all behind one autograd
    node: one node per call rather than per buffer, whose backward waits for every reduce
    in one fixed order (the same on every rank) once backward is through the call."""
    which = [i for i, c in enumerate(chosen) if c]
    if not which:
        return (None,) * len(shards)
    outs = _apply(_DeferWait, tuple(specs[i] for i in which), *(shards[i] for i in which))
    deferred: list[Deferred | None] = [None] * len(shards)
    for i, out in zip(which, outs, strict=True):
        deferred[i] = Deferred(out)
    return tuple(deferred)


class _DeferWait(torch.autograd.Function):
    @staticmethod
    def forward(specs: tuple[GatherSpec, ...], *shards: Tensor) -> tuple[Tensor, ...]:
        return tuple(
            shard.view_as(shard)
            if shard.dtype == spec.reduce_dtype
            else shard.new_zeros((), dtype=spec.reduce_dtype).expand(shard.shape)  # unread
            for shard, spec in zip(shards, specs, strict=True)
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.shard_dtypes = tuple(shard.dtype for shard in inputs[1:])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        chaos.point()
        synchronous = torch.is_grad_enabled()  # a synchronous backward reduced already
        out = [
            None if g is None else (g if synchronous else _THROTTLE.wait(g)).to(dtype)
            for g, dtype in zip(grads, ctx.shard_dtypes, strict=True)
        ]
        return None, *out


class _Throttle:
    """Keeps at most one asynchronous reduce-scatter (or DDP all-reduce) in flight: issuing
    one first finishes the last, which frees its full-size input. On an HSDP mesh the
    finished reduce-scatter's all-reduce across replicas starts then, in place, and its wait
    node waits for it."""

    def __init__(self) -> None:
        # the reduce in flight: (its collective, its result, its spec); the collective keeps
        # its input alive until it completes
        self.last: tuple[collectives.Pending, Tensor, GatherSpec] | None = None
        self.across: dict[int, tuple[Tensor, collectives.Pending]] = {}  # id of a result ->
        # (the result, its all-reduce across replicas in flight)

    def issue(self, grad: Tensor, spec: GatherSpec, writable: bool = True) -> Tensor:
        """Start reducing `grad`; return the tensor the result will be in, to be read only
        after `wait`. A DDP all-reduce writes into `grad` only if `writable` (see [Note:
        reducing in place])."""
        self._finish_last()
        mesh, unit = spec.mesh, spec.flat.unit
        if not collectives.alone(mesh.shard_group):
            pending = collectives.reduce_scatter(
                grad, mesh.shard_group, "avg", what=unit, owned=True
            )
        elif spec.across_replicas:  # DDP: reduce in place in the buffer backward just made
            pending = collectives.all_reduce(
                grad, mesh.replicate_group, "avg", inplace=writable, what=unit
            )
        else:
            return grad
        self.last = (pending, pending.result(), spec)
        return self.last[1]

    def _finish_last(self) -> None:
        if self.last is None:
            return
        pending, result, spec = self.last
        self.last = None
        pending.wait()
        if not collectives.alone(spec.mesh.shard_group) and spec.across_replicas:
            group, unit = spec.mesh.replicate_group, spec.flat.unit
            across = collectives.all_reduce(result, group, "avg", inplace=True, what=unit)
            self.across[id(result)] = (result, across)

    def wait(self, result: Tensor) -> Tensor:
        """The finished reduce of a tensor `issue` returned; any other tensor as it is."""
        if self.last is not None and self.last[1] is result:
            self._finish_last()
        entry = self.across.pop(id(result), None)
        if entry is not None:
            entry[1].wait()
        return result

    def abandon(self) -> None:
        """Forget what a backward that raised left in flight (every rank raised, or the
        collective itself failed)."""
        self.last = None
        self.across.clear()


_THROTTLE = _Throttle()


def abandon_reduces() -> None:
    """Forget the reduces a failed backward left in flight (see `_Throttle.abandon`)."""
    _THROTTLE.abandon()
