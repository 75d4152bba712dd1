"""One parameter group's elements of a sharded state, packed: what `partition`'s optimizers see.

[Note: a parameter group's view]
torch.optim keeps each param group's state for its own parameters. On flat shards a group
rarely fills a leaf (a block's buffer holds both its matrices and its biases), so handing
each group's optimizer the whole leaves, with zeros outside the group, would keep every
group's moments over every element: k groups, k times the memory. `GroupView` instead
holds, per leaf that has any of the group's trained parameters, either the leaf itself
(when the group owns all of it) or this rank's pieces of the group's parameters
concatenated in buffer order (a *packed* leaf: no padding, no other group's elements). The
parts are the same on every rank (a rank holding none of a packed leaf's elements gets an
empty tensor), so collectives inside the group's optimizer line up. `segments` knows the
owners of a packed leaf's elements, so masks, per-parameter sums and `whole_params` work on
it, and checkpoints split a packed moment into per-parameter pieces like any other.
A group of a params dict is the sub-dict of its parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from funcshard.core._donation import donatable
from funcshard.core._layout import Layout, shard_pieces
from funcshard.core._state import ensure_live
from funcshard.core._tree import register_record


@dataclass(frozen=True)
class Part:
    """One leaf of a group's view: `source`, the leaf of the full view it comes from;
    `fqns`, the group's parameters in it (buffer order); `packed`, whether it holds only
    their pieces (else it is the source leaf itself)."""

    source: int
    fqns: tuple[str, ...]
    packed: bool


class GroupView:
    """A group's leaves (`values`, lined up with `parts`) of a ShardedState or
    ShardedGrads on `layout`: see [Note: a parameter group's view].

    Made by `group_of`, it also keeps `source`, the full view's leaves, and packs `values`
    only when they are first read: `whole_params` reads its pieces straight from the
    source leaves, so a group it alone reads is never copied into packed leaves.

    A user optimizer inside `partition` may use it as it would a state: `funcshard.unshard`
    gives the group's parameters whole by FQN, `funcshard.reshard(view, whole)` a view
    holding them, `replace(values=...)` a view with other leaves."""

    def __init__(
        self,
        values: tuple[Tensor | None, ...] | None,
        layout: Layout,
        parts: tuple[Part, ...],
        source: tuple[Tensor | None, ...] | None = None,
    ) -> None:
        if values is None and source is None:
            raise ValueError("GroupView needs its values or the leaves to pack them from")
        self._values = None if values is None else tuple(values)
        self.unused: frozenset[str] = frozenset()  # a grads' view: its parameters no rank used
        self.layout = layout
        self.parts = parts
        self.source = source

    @property
    def values(self) -> tuple[Tensor | None, ...]:
        if self._values is None:
            source, rank = self.source, self.layout.mesh.shard_rank
            assert source is not None  # (made with one or the other)
            self._values = tuple(
                _packed(source[p.source], self.layout, rank, p) if p.packed else source[p.source]
                for p in self.parts
            )
        return self._values

    def leaves(self) -> list[Tensor | None]:
        return list(self.values)

    def replace(self, **changes: Any) -> GroupView:
        """A view of the same group with other `values` (the record itself never changes):
        what `ShardedState.replace(shards=...)` is to a state. Only `values` may change."""
        ensure_live(self, "GroupView.replace")
        if set(changes) != {"values"}:
            raise TypeError(
                f"GroupView.replace: a partition group's view changes only its values, got "
                f"{sorted(changes)}. Pass values=, one tensor (or None) per leaf of "
                f"group.values, in that order."
            )
        values = tuple(changes["values"])
        if len(values) != len(self.parts):
            raise ValueError(
                f"GroupView.replace: the group has {len(self.parts)} leaves, got "
                f"{len(values)} values. Pass one per leaf of group.values, in that order."
            )
        view = GroupView(values, self.layout, self.parts)
        view.unused = self.unused
        return view

    def unpacked(self) -> list[Tensor | None]:
        """Each leaf's source leaf, or the leaf itself when made from values: for what
        packing does not change (dtype, device, requires_grad), without packing."""
        if self._values is not None or self.source is None:
            return list(self.values)
        return [self.source[p.source] for p in self.parts]


register_record(GroupView, data_fields=("values",), meta_fields=("layout", "parts"))
donatable(GroupView, ("_values", "source"))  # a group's optimizer, donated, may reuse them


def group_of(container: Any, members: frozenset[str]) -> Any:
    """The view of the group `members` of a ShardedState, ShardedGrads or dict."""
    if isinstance(container, Mapping):
        ensure_live(container, "partition")
        return {f: v for f, v in container.items() if f in members}
    if isinstance(container, GroupView):
        raise TypeError(
            "funcshard.optim.partition: a partition inside a partition's group is not "
            "supported; give the outer partition one label per inner group instead."
        )
    ensure_live(container, "partition")
    layout = container.layout
    view = GroupView(None, layout, group_parts(layout, members), tuple(container.leaves()))
    unused = getattr(container, "unused", None)  # a ShardedGrads' (see funcshard/step/_usage.py)
    if unused:
        view.unused = unused & members
    return view


def scatter(group: Any, updates: Any, into: list[Tensor | None], keys: list | None) -> None:
    """Write a group's `updates` (a GroupView, or a dict when `keys` lists the full dict's
    keys) into `into`, the full view's update leaves (None where nothing was written yet)."""
    if keys is not None:
        where = {f: i for i, f in enumerate(keys)}
        for f, u in updates.items():
            into[where[f]] = u
        return
    layout = group.layout
    rank = layout.mesh.shard_rank
    for part, u in zip(group.parts, updates.leaves(), strict=True):
        if u is None:
            continue
        if not part.packed:
            into[part.source] = u
            continue
        target = into[part.source]
        if target is None:
            target = into[part.source] = u.new_zeros(layout.flats[part.source].shard_numel)
        at = 0
        for piece in _slices(layout, rank, part):
            n = piece.stop - piece.start
            target[piece] = u[at : at + n]
            at += n


def trainable_members(layout: Layout) -> frozenset[str]:
    """Every parameter that gets a gradient (not in a frozen unit, not a frozen member)."""
    out = {
        f
        for flat in layout.flats
        if not flat.frozen
        for f in flat.fqns
        if f not in flat.frozen_fqns
    }
    return frozenset(out | (set(layout.replicated) - set(layout.replicated_frozen)))


@functools.lru_cache(maxsize=256)
def group_parts(layout: Layout, members: frozenset[str]) -> tuple[Part, ...]:
    """The parts of a group's view: every trainable leaf holding any of `members`."""
    trained = trainable_members(layout)
    parts = []
    for i, flat in enumerate(layout.flats):
        mine = tuple(f for f in flat.fqns if f in members and f in trained)
        if mine:
            parts.append(Part(i, mine, packed=len(mine) != len(flat.fqns)))
    n = len(layout.flats)
    for j, f in enumerate(layout.replicated):
        if f in members and f in trained:
            parts.append(Part(n + j, (f,), packed=False))
    return tuple(parts)


@functools.lru_cache(maxsize=1024)
def _slices(layout: Layout, rank: int, part: Part) -> tuple[slice, ...]:
    """Where this rank's pieces of a packed part's parameters lie in its source shard."""
    pieces = shard_pieces(layout.flats[part.source], rank, part.fqns)
    return tuple(slice(p.at, p.at + p.stop - p.start) for p in pieces)


def packed_numel(layout: Layout, part: Part) -> int:
    """How many elements this rank's packed leaf of `part` holds."""
    return sum(s.stop - s.start for s in _slices(layout, layout.mesh.shard_rank, part))


def _packed(leaf: Tensor | None, layout: Layout, rank: int, part: Part) -> Tensor | None:
    if leaf is None:
        return None
    pieces = [leaf[s] for s in _slices(layout, rank, part)]
    return torch.cat(pieces) if pieces else leaf[:0]
