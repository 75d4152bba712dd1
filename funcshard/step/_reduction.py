"""Gradient reduction: `reduce` turns every rank's full gradients into this rank's shard of
their mean, and the replicated parameters' gradients into their all-reduced whole, as DDP
does. It writes none of its inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.comm._comm import Comm
from funcshard.core._layout import FlatLayout, Layout, in_buffer_order
from funcshard.core._precision import reduce_dtype
from funcshard.core._state import LocalGrads, ShardedGrads, ShardedState
from funcshard.core._tree import format_names
from funcshard.step import _check_parts as check_parts
from funcshard.step import _finite as finite
from funcshard.step import _usage as usage
from funcshard.step._carry import check_carry
from funcshard.step._gather_spec import GatherSpec
from funcshard.step._keep_local import reduced_part
from funcshard.step._reduce_flat import reduce_whole


def reduce(
    state: ShardedState,
    full_grads: Mapping[str, Tensor | None] | LocalGrads,
    divide_factor: float | None = None,
    all_reduce: bool = True,
    comm: Comm | None = None,
    carry: object = None,
    check_finite: bool | str = "skip",
) -> ShardedGrads | tuple[ShardedGrads, tuple]:
    """Reduce every rank's full gradients into this rank's shard of their mean.

    Gradients are reduced in the mixed-precision reduce dtype and returned in each parameter's
    dtype. A missing or None gradient counts as zero; frozen units are not reduced.
    Replicated (ignored) parameters come back whole, all-reduced over every rank (or this
    rank's own, with `plan(..., reduce_ignored=False)`). `divide_factor` replaces the mean's
    divisor (sum, then divide). On an HSDP mesh `all_reduce=False` skips the all-reduce
    across replicas, for accumulating first. `comm`'s reduce, if any, replaces the
    reduce-scatter over the shard axis; `carry` is its state, and then the result is
    `(grads, new_carry)` (see [Note: communication as user functions]). `check_finite` as
    in `value_and_grad` (the reduced gradients' verdict, without a loss). The parameters
    that `LocalGrads` say this rank did not use are agreed over the ranks: those no rank
    used are the result's `unused` (see [Note: unused parameters]). Of a LocalGrads
    from `value_and_grad(..., keep_local=units)`, only those units are reduced, the buffers
    and replicated parameters reduced already kept as they are (see [Note: units kept
    local]).

    Communicates: one reduce-scatter over the shard axis per trainable flat buffer, then one
    all-reduce over the replicate axis; one all-reduce per dtype of the replicated
    parameters. Law: equals the ranks' mean full gradient, sliced.
    """
    checking = finite.policy(check_finite, "reduce")
    reduced = _reduce(state, full_grads, divide_factor, all_reduce, comm, carry)
    grads, new_carry = reduced if isinstance(reduced, tuple) else (reduced, None)
    unused = full_grads.unused if isinstance(full_grads, LocalGrads) else None
    if unused is not None:  # agreed with the verdict: see [Note: unused parameters]
        grads = dataclasses.replace(grads, usage=usage.Usage(state.layout, unused))
    # buffers a Comm's reduce made (this call's, or, of a LocalGrads, value_and_grad's)
    # are checked whole on a DDP mesh (see [Note: each copy checked once])
    kept = isinstance(full_grads, LocalGrads) and bool(full_grads.shards)
    alike = check_parts.alike(comm, state.layout.mesh) and (not kept or state.layout.mesh.shard > 1)
    grads = finite.judged(None, grads, checking, all_reduce, "reduce", alike=alike)
    return grads if new_carry is None else (grads, new_carry)


def _reduce(
    state: ShardedState,
    full_grads: Mapping[str, Tensor | None] | LocalGrads,
    divide_factor: float | None,
    all_reduce: bool,
    comm: Comm | None,
    carry: object,
) -> ShardedGrads | tuple[ShardedGrads, tuple]:
    layout = state.layout
    done = _Done()
    if isinstance(full_grads, LocalGrads):  # see [Note: units kept local]
        done = _Done(reduced_part(full_grads, state, divide_factor, all_reduce), full_grads)
        full_grads = full_grads.grads
    _check_grads(full_grads, layout)
    mesh = layout.mesh
    op = "avg" if divide_factor is None else "sum"
    if comm is not None and not isinstance(comm, Comm):
        raise TypeError(f"funcshard.reduce: comm must be a funcshard.Comm, got {comm!r}.")
    if carry is not None or (comm is not None and comm.reduce is not None):
        return _reduce_with(state, full_grads, divide_factor, all_reduce, comm, carry, done)
    scattered: list[collectives.Pending | None] = []
    for i, flat in enumerate(layout.flats):
        if flat.frozen or done.has(i):
            scattered.append(None)
            continue
        dtype = reduce_dtype(state.mp, flat)
        grads = [None if f in flat.frozen_fqns else full_grads.get(f) for f in flat.fqns]
        padded = _padded_flat(grads, flat, dtype, mesh.device)
        group, loads = mesh.shard_group, flat.loads
        scattered.append(collectives.reduce_scatter(padded, group, op, flat.unit, loads=loads))
    replicated_reduce = [
        None
        if p is None or not all_reduce
        else collectives.all_reduce(p.wait(), mesh.replicate_group, op, what=flat.unit)
        for flat, p in zip(layout.flats, scattered, strict=True)
    ]
    shards: list[Tensor | None] = []
    for i, (flat, p, r) in enumerate(zip(layout.flats, scattered, replicated_reduce, strict=True)):
        if p is None:
            shards.append(done.shard(i))
            continue
        grad = (r or p).wait()
        if divide_factor is not None:
            grad = grad / divide_factor
        shards.append(grad.to(flat.dtype))
    replicated = done.replicated(state, full_grads, op, all_reduce, divide_factor)
    return ShardedGrads(shards=tuple(shards), layout=layout, replicated=replicated)


def _reduce_with(
    state: ShardedState,
    full_grads: Mapping[str, Tensor | None],
    divide_factor: float | None,
    all_reduce: bool,
    comm: Comm | None,
    carry: object,
    done: _Done,
) -> ShardedGrads | tuple[ShardedGrads, tuple]:
    """`reduce` through a user's reduce, one buffer after the other (it runs synchronously);
    a buffer reduced already keeps its carry."""
    if not isinstance(comm, Comm) or (carry is not None and comm.reduce is None):
        raise ValueError(
            f"funcshard.reduce: carry is the state of a Comm's reduce; pass "
            f"comm=funcshard.Comm(reduce=...) with it, got comm={comm!r}."
        )
    layout, mesh = state.layout, state.layout.mesh
    carries = check_carry(carry, state, "reduce") if carry is not None else None
    op = "avg" if divide_factor is None else "sum"
    shards: list[Tensor | None] = []
    new_carry: list[Tensor | None] = []
    for i, flat in enumerate(layout.flats):
        c = carries[i] if carries is not None else None
        if flat.frozen or done.has(i):
            shards.append(done.shard(i))
            new_carry.append(c)
            continue
        dtype = reduce_dtype(state.mp, flat)
        grads = [None if f in flat.frozen_fqns else full_grads.get(f) for f in flat.fqns]
        padded = _padded_flat(grads, flat, dtype, mesh.device)
        spec = GatherSpec(flat, mesh, state.mp, comm=comm)
        grad, c = reduce_whole(padded, spec, c, all_reduce, op)
        if divide_factor is not None:
            grad = grad / divide_factor
        shards.append(grad.to(flat.dtype))
        new_carry.append(c)
    replicated = done.replicated(state, full_grads, op, all_reduce, divide_factor)
    sharded = ShardedGrads(shards=tuple(shards), layout=layout, replicated=replicated)
    return sharded if carries is None else (sharded, tuple(new_carry))


class _Done:
    """What a partly reduced LocalGrads holds reduced already (nothing, for full gradients):
    its buffers' shards and its replicated parameters' gradients (see [Note: units kept
    local])."""

    def __init__(
        self, shards: tuple[Tensor | None, ...] | None = None, grads: LocalGrads | None = None
    ) -> None:
        self.shards = shards
        self.kept = grads.replicated if shards is not None and grads is not None else None

    def has(self, i: int) -> bool:
        return self.shards is not None and self.shards[i] is not None

    def shard(self, i: int) -> Tensor | None:
        return self.shards[i] if self.shards is not None else None

    def replicated(
        self,
        state: ShardedState,
        grads: Mapping[str, Tensor | None],
        op: str,
        all_reduce: bool,
        divide_factor: float | None,
    ) -> dict[str, Tensor | None]:
        if self.kept is not None:
            return dict(self.kept)
        return reduce_replicated(state, grads, op, all_reduce, divide_factor)


def reduce_replicated(
    state: ShardedState,
    grads: Mapping[str, Tensor | None],
    op: str = "avg",
    all_reduce: bool = True,
    divide_factor: float | None = None,
) -> dict[str, Tensor | None]:
    """The replicated parameters' gradients, reduced as DDP does: by `op` over every rank of
    the mesh (over the shard axis only without `all_reduce`), one all-reduce per dtype, or
    left as this rank's own when the plan said `reduce_ignored=False`. A missing gradient of
    a trainable one is zero; frozen ones get None."""
    layout = state.layout
    out: dict[str, Tensor | None] = dict.fromkeys(layout.replicated)
    given = {f: grads.get(f) for f in layout.replicated_trainable}
    local = {f: torch.zeros_like(state.replicated[f]) if g is None else g for f, g in given.items()}
    if not local or not layout.reduce_replicated:
        return {**out, **local}
    mesh = layout.mesh
    group = mesh.group if all_reduce else mesh.shard_group
    by_dtype: dict[torch.dtype, list[str]] = {}
    for f, g in local.items():
        by_dtype.setdefault(g.dtype, []).append(f)
    for fqns in by_dtype.values():
        packed = torch.cat([local[f].detach().reshape(-1).to(mesh.device) for f in fqns])
        total = collectives.all_reduce(packed, group, op, what="<replicated parameters>").wait()
        if divide_factor is not None:
            total = total / divide_factor
        pieces = total.split([local[f].numel() for f in fqns])
        out.update({f: p.view_as(local[f]) for f, p in zip(fqns, pieces, strict=True)})
    return out


def _padded_flat(
    grads: list[Tensor | None], flat: FlatLayout, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Concatenate gradients (zeros where None) and zero padding: (padded_numel,)."""
    pieces = [
        torch.zeros(n, dtype=dtype, device=device) if g is None else g.reshape(-1).to(device, dtype)
        for g, n in zip(grads, flat.numels, strict=True)
    ]
    return torch.cat(
        in_buffer_order(flat, pieces, lambda n: torch.zeros(n, dtype=dtype, device=device))
    )


def _check_grads(grads: Mapping[str, Tensor | None], layout: Layout) -> None:
    shapes = {f: s for flat in layout.flats for f, s in zip(flat.fqns, flat.shapes, strict=True)}
    unexpected = [f for f in grads if f not in shapes and f not in layout.replicated]
    if unexpected:
        raise ValueError(
            f"funcshard.reduce: gradients for {format_names(unexpected)}, which are not "
            f"parameters of this state. Key gradients by the FQNs of funcshard.unshard."
        )
    for fqn, g in grads.items():
        if g is not None and fqn in shapes and tuple(g.shape) != shapes[fqn]:
            raise ValueError(
                f"funcshard.reduce: the gradient of {fqn!r} must have shape {shapes[fqn]}, "
                f"got {tuple(g.shape)}."
            )
