"""`unshard` and `reshard` of a partition group's view: the whole parameters of one group,
by FQN, and back.

[Note: unsharding a group's view]
A user optimizer gets a `GroupView` inside `partition` where it gets a ShardedState alone,
and the optimizers guide lets it gather its parameters whole (an EMA, a hand-written
Muon). So `unshard` and `reshard` take a view too, with the state's laws restricted to
the group: `unshard(view)` gives the group's parameters whole, in the model's order;
`reshard(view, whole)` gives a view of the same group holding `whole`.
A packed leaf holds only this rank's pieces of the group's parameters, and their count
differs between ranks, so it is first laid out at its place in a zero shard of its
buffer (`scatter`, as partition writes updates back): then every rank all-gathers
tensors of one size, one all-gather per leaf, the same leaves on every rank (the parts are
the same everywhere), and the group's parameters are read off the gathered buffer. A leaf
the group owns whole is gathered as it is. Replicated parameters are whole already.
Reshard needs no collective: each rank slices its own pieces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.comm._comm import Comm
from funcshard.core._groups import GroupView, Part, scatter
from funcshard.core._layout import Layout, param_views, shard_pieces
from funcshard.core._state import ensure_live
from funcshard.core._tree import format_names
from funcshard.init._materialize import local_slice


@dataclass(frozen=True)
class GroupUnshardHandle:
    """A group's all-gathers in flight; `wait()` returns its parameters by FQN."""

    pending: tuple[tuple[Part, collectives.Pending], ...]
    replicated: dict[str, Tensor]
    layout: Layout
    fqns: tuple[str, ...]  # the model's `named_parameters()` order

    def wait(self) -> dict[str, Tensor]:
        full: dict[str, Tensor] = dict(self.replicated)
        for part, pending in self.pending:
            flat = self.layout.flats[part.source]
            views = dict(zip(flat.fqns, param_views(pending.wait(), flat), strict=True))
            full.update((f, views[f]) for f in part.fqns)
        return {f: full[f] for f in self.fqns}


def unshard_group_async(
    view: GroupView, units: Sequence[str] | None, comm: Comm | None
) -> GroupUnshardHandle:
    """Start the all-gathers of a group's whole parameters (see [Note: unsharding a group's
    view]). Communicates: one all-gather over the shard axis per leaf of the group."""
    ensure_live(view, "unshard")
    if units is not None or comm is not None:
        raise ValueError(
            f"funcshard.unshard: a partition group's view gathers the group's parameters, "
            f"all of them, got units={units!r}, comm={comm!r}. Call unshard(group) and pick "
            f"the FQNs you need from the dict."
        )
    layout = view.layout
    n = len(layout.flats)
    into: list[Tensor | None] = [None] * (n + len(layout.replicated))
    scatter(view, view, into, None)  # packed leaves at their places in zero shards
    group, device = layout.mesh.shard_group, layout.mesh.device
    pending = []
    replicated: dict[str, Tensor] = {}
    for part in view.parts:
        leaf = into[part.source]
        assert leaf is not None  # (a part exists only for trained leaves, which have values)
        if part.source >= n:
            replicated[part.fqns[0]] = leaf.detach().clone()
            continue
        unit, loads = layout.flats[part.source].unit, layout.flats[part.source].loads
        gathering = collectives.all_gather(leaf.detach().to(device), group, unit, loads)
        pending.append((part, gathering))
    return GroupUnshardHandle(tuple(pending), replicated, layout, _group_order(view))


def reshard_group(view: GroupView, full: Mapping[str, Tensor]) -> GroupView:
    """A view of the same group holding `full` (its parameters whole, by FQN).
    Communicates: nothing."""
    wanted = _group_order(view)
    missing = [f for f in wanted if f not in full]
    unexpected = [f for f in full if f not in set(wanted)]
    if missing or unexpected:
        raise ValueError(
            f"funcshard.reshard: the whole parameters do not match the partition group: "
            f"missing {format_names(missing) or 'none'}; unexpected "
            f"{format_names(unexpected) or 'none'}. Pass the group's parameters, keyed as "
            f"funcshard.unshard(group) returns them."
        )
    layout = view.layout
    rank, n = layout.mesh.shard_rank, len(layout.flats)
    values: list[Tensor] = []
    for part, old in zip(view.parts, view.unpacked(), strict=True):
        device = old.device if old is not None else layout.mesh.device
        if part.source >= n:
            values.append(full[part.fqns[0]].detach().clone().to(device))
            continue
        flat = layout.flats[part.source]
        if not part.packed:
            values.append(local_slice([full[f] for f in flat.fqns], flat, rank).to(device))
            continue
        pieces = [
            full[flat.fqns[p.index]].detach().reshape(-1)[p.start : p.stop]
            for p in shard_pieces(flat, rank, part.fqns)
        ]
        empty = torch.zeros(0, dtype=flat.dtype)
        values.append((torch.cat(pieces) if pieces else empty).to(device, flat.dtype))
    return view.replace(values=tuple(values))


def _group_order(view: GroupView) -> tuple[str, ...]:
    """The group's parameters in the model's `named_parameters()` order."""
    mine = {f for part in view.parts for f in part.fqns}
    ordered = [k for k in view.layout.state_dict_keys if k in mine]
    listed = set(ordered)
    return (*ordered, *(f for part in view.parts for f in part.fqns if f not in listed))
