"""Layout: where every parameter lives in the flat, evenly sharded buffers of a state.

[Note: flat buffers]
Each unit of a plan gets one flat 1-D buffer per dtype it holds (so a bf16 weight and an fp32
bias may share a unit, which FSDP2 refuses). A buffer concatenates its parameters, flattened,
in plan order, then zero padding up to a multiple of the shard size, so every rank holds
exactly `shard_numel` elements and collectives need no per-rank sizes. Rank r of the shard
axis holds elements [r * shard_numel, (r + 1) * shard_numel). A tensor smaller than the
shard size still gives every rank one element (mostly padding). An owned buffer arranges
its parameters rank by rank instead, with padding at the end of every rank's shard (see
[Note: owned placement] in funcshard/core/_placement.py); its `segments` list what lies
where, and code that builds a full buffer goes through `in_buffer_order`.

Everything here is static and hashable: it is the aux data of a ShardedState's pytree.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from funcshard.comm._mesh import Mesh
from funcshard.core import _placement as placement_of
from funcshard.core._plan import Plan, Unit
from funcshard.core._precision import MixedPrecision

T = TypeVar("T")


@dataclass(frozen=True)
class FlatLayout:
    """One flat buffer: the parameters of one dtype in one unit. Its sizes (`numels`,
    `offsets`, `numel`, `shard_numel`, `padded_numel`, `split_sizes`, `strides`) are derived
    once, when it is made."""

    unit: str  # the unit's module FQN; "" is the root
    dtype: torch.dtype
    fqns: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    shard_size: int
    mp: MixedPrecision | None = None  # its unit's own policy (None: the state's); see
    # [Note: per-unit options] in funcshard/core/_unit_options.py
    frozen: bool = False
    frozen_fqns: tuple[str, ...] = ()  # frozen members of a trainable buffer (frozen="warn")
    placement: str = "even"  # its unit's; see [Note: owned placement]

    if TYPE_CHECKING:  # set by __post_init__; declared for type checkers only, not fields
        numels: tuple[int, ...] = field(init=False)
        offsets: tuple[int, ...] = field(init=False)
        numel: int = field(init=False)
        shard_numel: int = field(init=False)
        padded_numel: int = field(init=False)
        split_sizes: tuple[int, ...] = field(init=False)
        strides: tuple[tuple[int, ...], ...] = field(init=False)
        owners: tuple[int, ...] = field(init=False)
        loads: tuple[int, ...] = field(init=False)
        segments: tuple[tuple[int, int], ...] = field(init=False)
        piece_of: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        # Derived sizes, computed once (a layout is immutable): a step reads them per unit,
        # and recomputing them was a measurable part of funcshard's overhead. Plain instance
        # attributes, not fields (no part of equality or hashing), which dynamo reads as such.
        numels = tuple(math.prod(s) for s in self.shapes)
        numel = sum(numels)
        if self.placement == "owned" and self.shard_size > 1:
            placement_of.check_bound(self.name, self.fqns, numels, self.shard_size)
            first = placement_of.first_owner(self.unit, self.shard_size)
            owners = placement_of.owners(numels, self.shard_size, first)
            offsets, shard_numel = placement_of.owned_offsets(numels, owners, self.shard_size)
            loads = placement_of.loads(numels, owners, self.shard_size)
        else:
            owners = loads = ()
            offsets = tuple(itertools.accumulate(numels, initial=0))[:-1]
            shard_numel = -(-numel // self.shard_size)
        segments = _segments(numels, offsets, shard_numel * self.shard_size)
        at = {i: k for k, (_, i) in enumerate(segments)}  # (padding's entries: never read)
        derived = {
            "numels": numels,  # each parameter's
            "offsets": offsets,  # starts in the buffer
            "numel": numel,  # elements of real data, without padding
            "shard_numel": shard_numel,  # elements each rank holds: ceil(numel / shard_size)
            # (owned: the largest rank's load)
            "padded_numel": shard_numel * self.shard_size,
            "owners": owners,  # owned: each parameter's owner rank; even: ()
            "loads": loads,  # owned: each rank's elements of whole parameters; even: ()
            # (size, parameter index or len(fqns) for padding) in buffer order
            "segments": segments,
            "split_sizes": tuple(size for size, _ in segments),
            # each parameter's index in `segments`
            "piece_of": tuple(at[i] for i in range(len(numels))),
            "strides": tuple(_contiguous_strides(shape) for shape in self.shapes),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def keep_fp32(self) -> bool:
        """Whether its unit runs with mixed precision off (`keep_fp32`, `MixedPrecision()`)."""
        return self.mp == MixedPrecision()

    @property
    def name(self) -> str:
        """How errors and tables name this buffer: `unit[dtype]`."""
        return f"{self.unit or '<root>'}[{str(self.dtype).removeprefix('torch.')}]"


@dataclass(frozen=True)
class Layout:
    """The flat buffers of a sharded state, in plan order, and the mesh they live on."""

    flats: tuple[FlatLayout, ...]
    replicated: tuple[str, ...]  # parameters kept whole on every rank (the plan's ignored)
    mesh: Mesh
    state_dict_keys: tuple[str, ...] = ()  # the model's state_dict() keys, in its order
    aliases: tuple[tuple[str, str], ...] = ()  # (second name, first FQN) of tied parameters
    replicated_frozen: tuple[str, ...] = ()  # replicated parameters that get no gradient
    reduce_replicated: bool = True  # the others' gradients are all-reduced (the plan's)
    # (unit, its methods besides forward that gather it): see [Note: units called through
    # other methods] in funcshard/core/_unit_methods.py
    unit_methods: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # (unit, its member modules) of each unit of several modules: see [Note: units of
    # several modules] in funcshard/core/_unit_groups.py
    unit_groups: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def replicated_trainable(self) -> tuple[str, ...]:
        """The replicated parameters that get gradients, in `replicated` order."""
        return tuple(f for f in self.replicated if f not in self.replicated_frozen)

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(f for flat in self.flats for f in flat.fqns)

    @property
    def units(self) -> tuple[str, ...]:
        """Unit names in plan order, each once."""
        return tuple(dict.fromkeys(flat.unit for flat in self.flats))

    def flats_of(self, units: tuple[str, ...] | None) -> tuple[int, ...]:
        """Indices of the flat buffers that belong to `units` (all when None)."""
        if units is None:
            return tuple(range(len(self.flats)))
        unknown = [u for u in units if u not in self.units]
        if unknown:
            raise ValueError(
                f"funcshard: units {unknown} are not in this state; its units are "
                f"{list(self.units)} ('' is the root)."
            )
        return tuple(i for i, flat in enumerate(self.flats) if flat.unit in units)


def frozen_ranges(flat: FlatLayout, start: int = 0, end: int | None = None) -> list[slice]:
    """Where the frozen members of a trainable buffer lie within [start, end) of it, as
    slices relative to `start` (a rank's shard: start = shard rank * shard_numel)."""
    end = flat.padded_numel if end is None else end
    ranges = []
    for fqn, offset, numel in zip(flat.fqns, flat.offsets, flat.numels, strict=True):
        lo, hi = overlap(offset, numel, start, end)
        if fqn in flat.frozen_fqns and lo < hi:
            ranges.append(slice(offset + lo - start, offset + hi - start))
    return ranges


def overlap(offset: int, numel: int, start: int, end: int) -> tuple[int, int]:
    """Elements `[lo, hi)` of a parameter at `offset` of its buffer (of `numel` elements)
    that the buffer's `[start, end)` holds, numbered in the parameter; (0, 0) for none."""
    lo, hi = max(start, offset), min(end, offset + numel)
    return (lo - offset, hi - offset) if lo < hi else (0, 0)


class ShardPiece(NamedTuple):
    """A rank's piece of one parameter of a flat buffer (see `shard_pieces`)."""

    # the parameter's, in the buffer's `fqns` (the name shadows tuple.index, as mypy notes)
    index: int  # type: ignore[assignment]
    start: int  # elements [start, stop) of the flattened parameter
    stop: int
    at: int  # where they start in the rank's shard
    local: int  # where they start in the leaf of the chosen pieces (`at` when all are)


@functools.lru_cache(maxsize=4096)
def shard_pieces(
    flat: FlatLayout, shard_rank: int, fqns: tuple[str, ...] | None = None
) -> tuple[ShardPiece, ...]:
    """Rank `shard_rank`'s piece of each parameter of `flat` it holds any of, in buffer
    order; only `fqns`' when given, their `local` positions then one after another (a
    partition group's packed leaf, see funcshard/core/_groups.py). Static: made once per
    buffer, rank and choice."""
    base, chosen = shard_rank * flat.shard_numel, None if fqns is None else set(fqns)
    out, placed = [], 0
    for i, (fqn, offset, numel) in enumerate(
        zip(flat.fqns, flat.offsets, flat.numels, strict=True)
    ):
        lo, hi = overlap(offset, numel, base, base + flat.shard_numel)
        if lo == hi or (chosen is not None and fqn not in chosen):
            continue
        at = offset + lo - base
        out.append(ShardPiece(i, lo, hi, at, at if chosen is None else placed))
        placed += hi - lo
    return tuple(out)


def param_views(buffer: torch.Tensor, flat: FlatLayout) -> tuple[torch.Tensor, ...]:
    """The parameters a full (padded_numel,) buffer of `flat` holds, as views, in flat order.

    Eagerly each view is one `as_strided` from the layout's cached geometry (half the CPU
    time of split-then-view, which a step pays per parameter); traced, under torch.func
    transforms or on a strided buffer, split-then-view, which every transform handles."""
    if (
        buffer.stride(0) == 1
        and not torch.compiler.is_dynamo_compiling()
        and not torch._C._are_functorch_transforms_active()
    ):
        base = buffer.storage_offset()
        return tuple(
            [
                buffer.as_strided(shape, stride, base + offset)
                for shape, stride, offset in zip(
                    flat.shapes, flat.strides, flat.offsets, strict=True
                )
            ]
        )
    pieces = buffer.split(flat.split_sizes)
    return tuple(pieces[k].view(shape) for k, shape in zip(flat.piece_of, flat.shapes, strict=True))


def in_buffer_order(flat: FlatLayout, values: Sequence[T], zeros: Callable[[int], T]) -> list[T]:
    """`values` (one per parameter, in `flat.fqns` order) in buffer order, with `zeros(n)`
    for each run of n padding elements: the pieces whose concatenation is a full buffer."""
    n = len(flat.numels)
    return [values[i] if i < n else zeros(size) for size, i in flat.segments]


def _segments(
    numels: tuple[int, ...], offsets: tuple[int, ...], padded_numel: int
) -> tuple[tuple[int, int], ...]:
    """What lies where in a buffer: (size, parameter index, or len(numels) for padding),
    in buffer order, empty parameters included, padding runs only where nonempty."""
    out, at = [], 0
    # (an empty parameter sorts before a nonempty one at its offset)
    for offset, _, i in sorted((o, numels[i] > 0, i) for i, o in enumerate(offsets)):
        if offset > at:
            out.append((offset - at, len(numels)))
        out.append((numels[i], i))
        at = offset + numels[i]
    if padded_numel > at:
        out.append((padded_numel - at, len(numels)))
    return tuple(out)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _frozen_apart(members: list, unit: Unit) -> list[tuple[list, bool]]:
    """A unit's members of one dtype as flat buffers: one, or (frozen="split") the trainable
    ones and then the frozen ones, each only if there are any."""
    if not unit.frozen_apart:
        return [(members, unit.frozen)]
    return trainable_then_frozen(members, frozenset(unit.frozen_fqns))


def trainable_then_frozen(members: list, frozen: frozenset[str]) -> list[tuple[list, bool]]:
    """Members `(fqn, ...)` of one dtype as frozen="split" lays them out: the trainable ones,
    then the frozen ones, each a group (with whether it is frozen) only if there are any."""
    trainable = [m for m in members if m[0] not in frozen]
    still = [m for m in members if m[0] in frozen]
    return [(group, apart) for group, apart in ((trainable, False), (still, True)) if group]


def layout_of(plan: Plan, mesh: Mesh | None, shard_size: int | None = None) -> Layout:
    """Lay out a plan's units as flat buffers sharded over the mesh's shard axis (or, with
    no mesh, over `shard_size` ranks: a layout for arithmetic, as the estimator's)."""
    shard_size = mesh.shard_size if mesh is not None else shard_size
    assert shard_size is not None  # a layout without a mesh is given its shard size
    flats = []
    for unit in plan.units:
        for dtype in unit.dtypes:
            members = [
                (fqn, shape)
                for fqn, shape, d in zip(unit.fqns, unit.shapes, unit.param_dtypes, strict=True)
                if d == dtype
            ]
            for group, frozen in _frozen_apart(members, unit):
                flats.append(
                    FlatLayout(
                        unit=unit.name,
                        dtype=dtype,
                        fqns=tuple(f for f, _ in group),
                        shapes=tuple(s for _, s in group),
                        shard_size=shard_size,
                        mp=unit.mp,
                        frozen=frozen,
                        frozen_fqns=()
                        if unit.frozen_apart
                        else tuple(f for f, _ in group if f in unit.frozen_fqns),
                        placement=unit.placement if shard_size > 1 else "even",
                    )
                )
    return Layout(
        flats=tuple(flats),
        replicated=plan.ignored,
        # None only in the estimator's layout, for arithmetic: nothing reads its mesh
        mesh=mesh,  # type: ignore[arg-type]
        replicated_frozen=plan.ignored_frozen,
        reduce_replicated=plan.reduce_ignored,
        unit_methods=tuple((u.name, u.methods) for u in plan.units if u.methods),
        unit_groups=tuple((u.name, u.modules) for u in plan.units if len(u.modules) > 1),
    )
