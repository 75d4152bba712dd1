"""Full parameters from a sharded state and back: `unshard` (or `unshard_async`) gathers
them, `reshard` slices them into the state's layout again. Neither writes its inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import overload

from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.comm._comm import Comm
from funcshard.core._groups import GroupView
from funcshard.core._layout import FlatLayout, Layout, param_views
from funcshard.core._state import ShardedState, ensure_live
from funcshard.core._tree import format_names
from funcshard.init._materialize import local_slice
from funcshard.step import _gather as gather
from funcshard.step._gather_spec import GatherSpec
from funcshard.step._group_unsharding import (
    GroupUnshardHandle,
    reshard_group,
    unshard_group_async,
)


def unshard(
    state: ShardedState | GroupView, units: Sequence[str] | None = None, comm: Comm | None = None
) -> dict[str, Tensor]:
    """Gather full parameters (all of them, or those of `units`) in their original dtypes;
    with `comm`, through its gather: the parameters a call with that comm computes with.

    The dict lists them in the model's `named_parameters()` order, replicated ones included,
    as `extract(model)` does, so the two compare as pytrees without reordering. On a
    partition group's view (`GroupView`, what a user optimizer inside `partition` gets),
    the group's parameters, all of them (see [Note: unsharding a group's view]).

    Communicates: one all-gather over the shard axis per flat buffer (none when the shard axis
    has size 1, where the result shares memory with the state). Law: inverts `shard`.
    """
    return unshard_async(state, units, comm).wait()


@dataclass(frozen=True)
class UnshardHandle:
    """All-gathers in flight; `wait()` returns the full parameters by FQN, in `fqns` order."""

    pending: tuple[tuple[FlatLayout, collectives.Pending], ...]
    replicated: dict[str, Tensor]
    fqns: tuple[str, ...]  # the model's `named_parameters()` order (see `_model_order`)

    def wait(self) -> dict[str, Tensor]:
        full: dict[str, Tensor] = {}
        for flat, pending in self.pending:
            full.update(zip(flat.fqns, param_views(pending.wait(), flat), strict=True))
        full.update(self.replicated)
        return {f: full[f] for f in self.fqns}


def unshard_async(
    state: ShardedState | GroupView,
    units: Sequence[str] | None = None,
    comm: Comm | None = None,
) -> UnshardHandle | GroupUnshardHandle:
    """Start `unshard`: issue every all-gather now and return a handle to wait on (a
    `comm`'s gather runs now, to its end). A partition group's view (`GroupView`) gives
    the group's parameters (see [Note: unsharding a group's view])."""
    if isinstance(state, GroupView):
        return unshard_group_async(state, units, comm)
    ensure_live(state, "unshard")
    layout = state.layout
    if isinstance(units, str):
        units = (units,)
    indices = layout.flats_of(None if units is None else tuple(units))
    group = layout.mesh.shard_group
    device = layout.mesh.device
    pending = tuple(
        (
            layout.flats[i],
            collectives.all_gather(
                state.shards[i].to(device),
                group,
                what=layout.flats[i].unit,
                loads=layout.flats[i].loads,
            )
            if comm is None
            else gather.issue_gather(
                state.shards[i], GatherSpec(layout.flats[i], layout.mesh, None, comm=comm)
            ),
        )
        for i in indices
    )
    replicated = {f: t.clone() for f, t in state.replicated.items()} if units is None else {}
    gathered = [f for i in indices for f in layout.flats[i].fqns]
    return UnshardHandle(pending, replicated, _model_order(layout, [*gathered, *replicated]))


def _model_order(layout: Layout, fqns: Sequence[str]) -> tuple[str, ...]:
    """`fqns` in the model's `named_parameters()` order, which `extract` and a plain model use.

    Units are laid out in plan (post-)order, so the flat buffers alone would list a child's
    parameters before its parent's, and torch's pytrees tell dicts apart by key order.
    `state_dict()` visits modules and parameters in the order `named_parameters()` does; names
    it does not list (a module with state_dict hooks of its own) follow in the order given.
    """
    wanted = set(fqns)
    ordered = [k for k in layout.state_dict_keys if k in wanted]
    listed = set(ordered)
    return (*ordered, *(f for f in fqns if f not in listed))


@overload
def reshard(state: ShardedState, full: Mapping[str, Tensor]) -> ShardedState: ...
@overload
def reshard(state: GroupView, full: Mapping[str, Tensor]) -> GroupView: ...
def reshard(
    state: ShardedState | GroupView, full: Mapping[str, Tensor]
) -> ShardedState | GroupView:
    """A new state holding `full` (FQN -> full tensor, as `unshard` returns) in `state`'s layout.

    Communicates: nothing (each rank slices its own part). Law: `reshard(s, unshard(s))`
    equals `s`. On a partition group's view (`GroupView`), `full` holds the group's
    parameters and the result is a view of the group.
    """
    if isinstance(state, GroupView):
        return reshard_group(state, full)
    layout = state.layout
    _check_full(full, layout, state)
    shards = tuple(
        local_slice([full[f] for f in flat.fqns], flat, layout.mesh.shard_rank).to(s.device)
        for flat, s in zip(layout.flats, state.shards, strict=True)
    )
    replicated = {f: full[f].detach().clone() for f in layout.replicated}
    return state.replace(shards=shards, replicated=replicated)


def _check_full(full: Mapping[str, Tensor], layout: Layout, state: ShardedState) -> None:
    expected = set(layout.fqns) | set(layout.replicated)
    missing = [f for f in (*layout.fqns, *layout.replicated) if f not in full]
    unexpected = [f for f in full if f not in expected]
    if missing or unexpected:
        raise ValueError(
            f"funcshard.reshard: the full parameters do not match the state: missing "
            f"{format_names(missing) or 'none'}; unexpected {format_names(unexpected) or 'none'}. "
            f"Pass every parameter, keyed as funcshard.unshard returns them."
        )
    expected_of = {f: (tuple(t.shape), t.dtype) for f, t in state.replicated.items()}
    for flat in layout.flats:
        expected_of.update(
            {f: (s, flat.dtype) for f, s in zip(flat.fqns, flat.shapes, strict=True)}
        )
    for fqn, (shape, dtype) in expected_of.items():
        t = full[fqn]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"funcshard.reshard: {fqn!r} must be {shape} {dtype}, got "
                f"{tuple(t.shape)} {t.dtype}."
            )
