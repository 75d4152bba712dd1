"""The part of each reduced gradient leaf a rank checks for NaN and inf, and which ranks hold
the same copy of it (see [Note: non-finite steps skipped by default] in
funcshard/step/_finite.py).

[Note: each copy checked once]
An all-reduced gradient is the same tensor on every rank that reduced it: a DDP bucket on
every rank, an HSDP shard on every rank of its replicate axis (the ranks with the same shard
index), a replicated parameter's gradient on every rank of the verdict's group. Summing
each copy whole on every rank looked at every element k times. On the overhead matrix's
DDP cell (8 ranks) that pass was 2.7% of a step. So each of the k ranks that hold one copy
checks only its 1/k of it: the flat view cut in k even pieces, the piece at its index among
those ranks (its replicate index for a shard; its index in the group for a replicated
parameter). Every element is still checked, by exactly one rank. The all-gather already
carries every rank's flags, so a flag on a piece reaches every rank; the verdict then marks
a leaf bad on every rank that holds the same copy (`Verdict.copies`), so the message names
the same ranks it named when every rank checked its whole copy: the ranks whose gradient
held the NaN, all of them, the same words on every rank.

When the copies are the same: the check runs after the reduction (and after the cast to
the parameter's dtype), and every rank ran the same ops on the same all-reduced values, so
an fp16 sum that overflowed is inf on every rank alike. A shard is cut only when it was
all-reduced across replicas (`all_reduce=True`, replicate axis over one rank). Under
`all_reduce=False` the shards are each rank's own and are checked whole; the replicated
parameters, then all-reduced over the shard axis, which is then the verdict's group, are
still cut. A replicated parameter whose gradient the plan does not reduce
(`reduce_ignored=False`) is each rank's own and checked whole. On a DDP mesh a `Comm`'s
reduce takes the place of the all-reduce: where the step is given one, its buckets are
checked whole (its result is taken on trust nowhere). Owned placements and deferred
reduces change where elements lie and when they land, not that the all-reduced shard is
the same on every replica, so they are cut like the others.

A piece is `narrow` of the flat view: one view per leaf, no copy. A leaf below `WHOLE`
elements is not cut: making the view costs about 1.5 us, what summing 5000 elements does, so
cutting a smaller leaf saved nothing (the HSDP 2x4 cell's 12K-element shards measured no
cheaper cut in two). Such a leaf is checked whole by one of the k ranks that hold its copy,
in turn by the leaf's index (leaf j by the holder at index j mod k), and skipped by the
others: a step's sums (one dispatch each, about 2.4 us for a small leaf) are then shared
among the holders as the elements are. What this saves: see benchmarks/RESULTS.md ("The
default non-finite check, each copy checked once").
Traced steps, and `check` ("raise" where unused parameters are not tracked), check every
leaf whole, as before: the cut is a host-side choice of the eager verdict (`issue` in
funcshard/step/_finite.py).

The names, the group's ranks and the cuts depend only on the layout and on where the
gradients were reduced, so they are worked out once per (layout, all_reduce, alike) and
kept (`parts`): a step reads them instead of rebuilding the names and asking the group.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

from torch import Tensor

from funcshard.comm import _process_groups as process_groups
from funcshard.comm._comm import Comm
from funcshard.comm._mesh import Mesh
from funcshard.core._layout import Layout

WHOLE = 16384  # elements below which a leaf is checked whole: see [Note: each copy checked once]


@dataclass(frozen=True)
class Parts:
    """What this rank checks of each gradient leaf of a layout, and who holds which copy.

    `names`: each leaf as a verdict names it; `ranks`: the verdict's group in group order;
    `cuts`: per leaf, (pieces, the piece this rank checks), (1, 0) for the whole leaf;
    `copies`: per leaf, for each rank of `ranks`, the copy of it that rank holds (None:
    each rank holds its own); `trail_groups`: the names of the mesh's groups whose trails
    the verdict carries (see [Note: the collectives' trail] in funcshard/comm/_trail.py)."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]
    cuts: tuple[tuple[int, int], ...]
    copies: tuple[tuple[int, ...] | None, ...]
    trail_groups: tuple[str, ...]

    def of(self, leaves: list[Tensor | None]) -> list[Tensor | None]:
        """The pieces of `leaves` this rank checks (None: none of it): see [Note: each copy
        checked once]."""
        if not self.shared:  # every leaf is this rank's own (FSDP): checked whole
            return leaves
        return [
            _checked(t, leaf, n, i)
            for leaf, (t, (n, i)) in enumerate(zip(leaves, self.cuts, strict=True))
        ]

    @functools.cached_property
    def shared(self) -> bool:
        """Whether some leaf is held alike by several ranks (cut among them)."""
        return any(n > 1 for n, _ in self.cuts)


def _checked(t: Tensor | None, leaf: int, holders: int, mine: int) -> Tensor | None:
    """What this rank (`mine` of `holders` alike copies) checks of leaf number `leaf`: all of
    its own, its piece of a large copy, a small copy whole in its turn, else nothing."""
    if t is None or holders == 1:
        return t
    if t.numel() >= WHOLE:
        return _piece(t, holders, mine)
    return t if leaf % holders == mine else None


def _piece(t: Tensor, pieces: int, i: int) -> Tensor:
    """Piece `i` of `pieces` even pieces of `t`'s flat view (a view, not a copy)."""
    flat = t if t.dim() == 1 else t.reshape(-1)  # (a flat buffer already: no view to make)
    n = flat.numel()
    start = n * i // pieces
    return flat.narrow(0, start, n * (i + 1) // pieces - start)


def alike(comm: Comm | None, mesh: Mesh) -> bool:
    """Whether funcshard's own all-reduce reduced the buffers across replicas: not where a
    `Comm`'s reduce took its place (a DDP mesh's)."""
    return comm is None or comm.reduce is None or mesh.shard > 1


def parts(layout: Layout, across_replicas: bool, alike: bool) -> Parts:
    """The `Parts` of gradients of `layout`, reduced across replicas or not, by funcshard's
    all-reduce (`alike`) or not; worked out once and kept while the layout lives."""
    key = (id(layout), across_replicas, alike)
    kept = _KEPT.get(key)
    if kept is not None and kept[0]() is layout:
        return kept[1]
    found = _parts(layout, across_replicas, alike)
    if len(_KEPT) > 64:  # layouts made over and over (tests): forget the old ones
        _KEPT.clear()
    _KEPT[key] = (weakref.ref(layout), found)
    return found


_KEPT: dict[tuple[int, bool, bool], tuple[weakref.ref[Layout], Parts]] = {}


def _parts(layout: Layout, across_replicas: bool, alike: bool) -> Parts:
    mesh = layout.mesh
    group = mesh.group if across_replicas else mesh.shard_group
    ranks = tuple(process_groups.group_ranks(group))
    units = [f"unit {f.unit or '<root>'!r}" for f in layout.flats]
    names = tuple(units + [repr(f) for f in layout.replicated])
    whole: tuple[tuple[int, int], tuple[int, ...] | None] = ((1, 0), None)
    shard = whole
    if across_replicas and alike and mesh.replicate > 1:  # each shard on every replica
        index = {r: s for row in mesh.device_mesh.mesh.tolist() for s, r in enumerate(row)}
        shard = ((mesh.replicate, mesh.replicate_rank), tuple(index[r] for r in ranks))
    replicated = whole
    if layout.reduce_replicated and len(ranks) > 1:  # all-reduced over the verdict's group
        mine = process_groups.group_rank(group)
        replicated = ((len(ranks), mine), (0,) * len(ranks))
    chosen = [shard] * len(layout.flats) + [replicated] * len(layout.replicated)
    roles = (mesh.group, mesh.shard_group, mesh.replicate_group)  # (the trail's fixed order)
    return Parts(
        names=names,
        ranks=ranks,
        cuts=tuple(cut for cut, _ in chosen),
        copies=tuple(copies for _, copies in chosen),
        trail_groups=tuple(dict.fromkeys(g.group_name for g in roles)),
    )
