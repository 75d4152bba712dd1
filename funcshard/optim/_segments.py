"""Which parameter owns which elements of each leaf an optimizer sees.

[Note: per-parameter views of a shard]
A flat shard holds pieces of several parameters, and a parameter may be spread over several
ranks' shards, so anything computed per parameter (LAMB's trust ratios, per-parameter
clipping, a mask such as "no weight decay on biases") needs to know who owns each element.
`segments(params)` says it per leaf of the optimizer's view (see [Note: the optimizer's
leaves]): the parameters a leaf holds (`fqns`), where this rank's piece of each lies
(`pieces`), and for a flat shard a tensor naming each element's owner, built from the layout
once per flat buffer and rank and cached. Three operations are built on it:

- `sum(values)`: per leaf, one number per parameter, each summed over the whole parameter:
  over this rank's piece, then one all-reduce of every leaf's sums together over the shard
  axis (replicas hold the same shards, so they are not summed again). Whole tensors (a
  dict's, a replicated parameter) are summed locally.
- `expand(per_param)`: the inverse shape: each element gets its owner's number (padding 0).
- `mask(where)`: per leaf, True/False for a whole tensor or a bool tensor for a flat shard,
  from a predicate `(fqn, param) -> bool` (the param as a meta tensor of its full shape and
  dtype: the shard does not hold it) or a dict FQN -> bool.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from funcshard.comm import _collectives as collectives
from funcshard.core._groups import GroupView
from funcshard.core._layout import FlatLayout, shard_pieces
from funcshard.core._state import ShardedGrads, ShardedState
from funcshard.core._tree import format_names

Where = Callable[[str, Tensor], bool] | Mapping[str, bool]
"""Where a mask holds (`masked`, `weight_decay_mask=`): a predicate `(fqn, param) -> bool` or
a dict FQN -> bool."""


@dataclass(frozen=True)
class Piece:
    """This rank's part of one parameter inside a leaf: `leaf[local]` holds the flattened
    parameter's elements `[start, start + (local.stop - local.start))`."""

    fqn: str
    shape: tuple[int, ...]
    local: slice
    start: int


@dataclass(frozen=True)
class _Leaf:
    fqns: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    flat: FlatLayout | None  # None: a whole tensor, one parameter
    shard_rank: int
    packed: bool = False  # only this rank's pieces of `fqns`, of `flat` (see core/_groups.py)


class Segments:
    """The owners of each leaf's elements for one params container (see the note above)."""

    def __init__(self, leaves: tuple[_Leaf, ...], group: Any, device: torch.device) -> None:
        self._leaves = leaves
        self._group = group  # the shard axis, or None for a dict
        self._device = device
        self._masks: dict[int, tuple[Where, list[bool | Tensor]]] = {}  # built once per mask
        self._runs: dict[int, tuple[Where, list[bool | tuple[slice, ...]]]] = {}  # and per `runs`

    @property
    def fqns(self) -> tuple[tuple[str, ...], ...]:
        """Per leaf, the parameters it holds (a flat buffer's all, held here or not)."""
        return tuple(leaf.fqns for leaf in self._leaves)

    @functools.cached_property
    def params(self) -> tuple[tuple[tuple[str, Tensor], ...], ...]:
        """Per leaf, (fqn, a meta tensor of the parameter's full shape and dtype): what a
        mask's or a label's predicate is given."""
        return tuple(
            tuple(
                (f, _placeholder(s, leaf.dtype))
                for f, s in zip(leaf.fqns, leaf.shapes, strict=True)
            )
            for leaf in self._leaves
        )

    def pieces(self, i: int) -> list[Piece]:
        """This rank's piece of each parameter of leaf `i` (none for ones it holds none of)."""
        leaf = self._leaves[i]
        if leaf.flat is None:
            numel = math.prod(leaf.shapes[0])
            return [Piece(leaf.fqns[0], leaf.shapes[0], slice(0, numel), 0)]
        return list(_pieces(leaf))

    def sum(self, values: Sequence[Tensor | None]) -> list[Tensor | None]:
        """Per leaf, each parameter's sum of `values` (lined up with the leaves) over the
        whole parameter, in float32 (float64 stays): shape `(len(fqns[i]),)`, the same on
        every rank. Communicates: one all-reduce over the shard axis, if any leaf is sharded."""
        out: list[Tensor | None] = []
        sharded = []
        for i, (leaf, v) in enumerate(zip(self._leaves, values, strict=True)):
            if v is None:
                out.append(None)
                continue
            v = v.to(torch.promote_types(v.dtype, torch.float32))
            if leaf.flat is None:
                out.append(v.sum().reshape(1))
                continue
            owner = _owner_index(leaf, v.device)
            local = v.new_zeros(len(leaf.fqns) + 1).index_add_(0, owner, v.reshape(-1))
            out.append(local[:-1])
            sharded.append(i)
        if sharded and self._group is not None and self._group.size() > 1:
            sums = [cast(Tensor, out[i]) for i in sharded]  # appended above, never None
            packed = torch.cat(sums)
            total = collectives.all_reduce(
                packed, self._group, "sum", what="<per-parameter sums>"
            ).wait()
            for i, part in zip(sharded, total.split([len(s) for s in sums]), strict=True):
                out[i] = part
        return out

    def expand(self, per_param: Sequence[Tensor | None]) -> list[Tensor | None]:
        """Per leaf, each element's owner's value (`per_param[i]` has one per parameter):
        a 0-d tensor for a whole tensor, the shard's shape (padding 0) for a flat shard."""
        out: list[Tensor | None] = []
        for leaf, p in zip(self._leaves, per_param, strict=True):
            if p is None:
                out.append(None)
            elif leaf.flat is None:
                out.append(p.reshape(()))
            else:
                owner = _owner_index(leaf, p.device)
                out.append(torch.cat([p, p.new_zeros(1)])[owner])
        return out

    def per_element(self, i: int, per_param: Sequence[bool] | Tensor, fill: Any = False) -> Tensor:
        """Leaf `i`'s elements (a flat shard's) each given its owner's value of `per_param`
        (one per `fqns[i]`), padding `fill`. Made from this rank's pieces (they lie one
        after another, then the padding), so no per-element owner index is built or kept:
        what it returns is all it allocates (a step's unused-parameter mask is made anew
        each time, and dropped with the step)."""
        leaf = self._leaves[i]
        values = torch.as_tensor(per_param, device=self._device)
        at = {f: j for j, f in enumerate(leaf.fqns)}
        pieces = _pieces(leaf)
        counts = [p.local.stop - p.local.start for p in pieces]
        numel = sum(counts) if leaf.packed or leaf.flat is None else leaf.flat.shard_numel
        padding = torch.as_tensor(fill, dtype=values.dtype, device=self._device).reshape(1)
        chosen = torch.cat([values[[at[p.fqn] for p in pieces]], padding])
        repeats = torch.tensor([*counts, numel - sum(counts)], device=self._device)
        return torch.repeat_interleave(chosen, repeats, output_size=numel)

    def runs(self, where: Where) -> list[bool | tuple[slice, ...]]:
        """Per leaf, where `where` holds as this rank's slices of it: True (all of it),
        False (none), or the runs of adjacent pieces whose parameters it holds for. Built
        once per predicate and kept, as `mask`, but holding no per-element tensor: what
        weight decay masks take (a per-parameter choice applied slice by slice)."""
        cached = self._runs.get(id(where))
        if cached is not None and cached[0] is where:
            return cached[1]
        holds = _predicate(where, self.fqns)
        out: list[bool | tuple[slice, ...]] = []
        for i, params in enumerate(self.params):
            chosen = {f for f, p in params if holds(f, p)}
            if len(chosen) == len(params) or not chosen:
                out.append(bool(chosen))
                continue
            if self._leaves[i].flat is None:  # (one parameter: decided above)
                out.append(bool(chosen))
                continue
            out.append(_runs_of(_pieces(self._leaves[i]), chosen))
        self._runs[id(where)] = (where, out)
        return out

    def mask(self, where: Where) -> list[bool | Tensor]:
        """Per leaf, where `where` holds: a bool for a whole tensor, a bool tensor (padding
        False) for a flat shard."""
        cached = self._masks.get(id(where))
        if cached is not None and cached[0] is where:
            return cached[1]
        holds = _predicate(where, self.fqns)
        out: list[bool | Tensor] = []
        for leaf, params in zip(self._leaves, self.params, strict=True):
            per_param = [bool(holds(f, p)) for f, p in params]
            if leaf.flat is None:
                out.append(per_param[0])
            else:
                chosen = torch.tensor([*per_param, False], device=self._device)
                out.append(chosen[_owner_index(leaf, self._device)])
        self._masks[id(where)] = (where, out)
        return out


def segments(params: Any) -> Segments:
    """The per-parameter view of `params` (a ShardedState, a group of one in `partition`,
    or a dict of tensors)."""
    if isinstance(params, GroupView):
        layout = params.layout
        meta = _replicated_meta(params) if layout.replicated else ()
        return _group_segments(layout, layout.mesh.shard_rank, params.parts, meta)
    if isinstance(params, ShardedState | ShardedGrads):
        layout = params.layout
        return _sharded_segments(layout, layout.mesh.shard_rank, _replicated_meta(params))
    if isinstance(params, Mapping):
        leaves = tuple(_Leaf((k,), (tuple(v.shape),), v.dtype, None, 0) for k, v in params.items())
        device = next((v.device for v in params.values()), torch.device("cpu"))
        return Segments(leaves, None, device)
    raise TypeError(
        f"funcshard.optim.segments: params must be a ShardedState, ShardedGrads or a dict of "
        f"tensors, got {type(params).__name__}."
    )


def _placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A meta tensor standing for a parameter: it holds nothing, so it is made outside any
    dispatch mode, where `funcshard.estimate`'s dry run (which counts the meta tensors a
    step makes, see funcshard/planning/_metabytes.py) does not take it for memory."""
    with _disable_current_modes():
        return torch.empty(shape, dtype=dtype, device="meta")


def _replicated_meta(params: ShardedState | ShardedGrads | GroupView) -> tuple:
    """(fqn, shape, dtype) of each replicated parameter (grads may lack frozen ones')."""
    tensors: Mapping[str, Tensor | None]
    if isinstance(params, GroupView):
        n = len(params.layout.flats)
        tensors = {
            params.layout.replicated[p.source - n]: v
            for p, v in zip(params.parts, params.values, strict=True)
            if p.source >= n
        }
    else:
        tensors = params.replicated
    return tuple(
        (f, tuple(t.shape), t.dtype)
        if (t := tensors.get(f)) is not None
        else (f, (), torch.float32)
        for f in params.layout.replicated
    )


@functools.lru_cache(maxsize=256)
def _sharded_segments(layout: Any, shard_rank: int, replicated: tuple) -> Segments:
    leaves = [_Leaf(f.fqns, f.shapes, f.dtype, f, shard_rank) for f in layout.flats]
    leaves += [_Leaf((f,), (shape,), dtype, None, shard_rank) for f, shape, dtype in replicated]
    return Segments(tuple(leaves), layout.mesh.shard_group, layout.mesh.device)


@functools.lru_cache(maxsize=256)
def _group_segments(layout: Any, shard_rank: int, parts: tuple, replicated: tuple) -> Segments:
    """Segments of a group's view: packed leaves name only the group's parameters."""
    n, whole = len(layout.flats), {f: (s, d) for f, s, d in replicated}
    leaves = []
    for part in parts:
        if part.source >= n:
            shape, dtype = whole.get(part.fqns[0], ((), torch.float32))
            leaves.append(_Leaf(part.fqns, (shape,), dtype, None, shard_rank))
            continue
        flat = layout.flats[part.source]
        if not part.packed:
            leaves.append(_Leaf(flat.fqns, flat.shapes, flat.dtype, flat, shard_rank))
            continue
        shapes = tuple(flat.shapes[flat.fqns.index(f)] for f in part.fqns)
        leaves.append(_Leaf(part.fqns, shapes, flat.dtype, flat, shard_rank, packed=True))
    return Segments(tuple(leaves), layout.mesh.shard_group, layout.mesh.device)


@functools.lru_cache(maxsize=1024)
def _pieces(leaf: _Leaf) -> tuple[Piece, ...]:
    """This rank's piece of each of a flat leaf's parameters (of a packed leaf's: only its
    own, placed one after another)."""
    flat = leaf.flat
    assert flat is not None  # a flat leaf's
    return tuple(
        Piece(
            flat.fqns[p.index],
            flat.shapes[p.index],
            slice(p.local, p.local + p.stop - p.start),
            p.start,
        )
        for p in shard_pieces(flat, leaf.shard_rank, leaf.fqns if leaf.packed else None)
    )


def _runs_of(pieces: Sequence[Piece], chosen: set[str]) -> tuple[slice, ...]:
    """The slices of a leaf covered by the pieces of `chosen` parameters, adjacent ones
    merged (pieces lie one after another in the leaf)."""
    runs: list[slice] = []
    for p in pieces:
        if p.fqn not in chosen or p.local.stop == p.local.start:
            continue
        if runs and runs[-1].stop == p.local.start:
            runs[-1] = slice(runs[-1].start, p.local.stop)
        else:
            runs.append(p.local)
    return tuple(runs)


def _owner_index(leaf: _Leaf, device: torch.device) -> Tensor:
    """Per element of a flat leaf: the index in `leaf.fqns` of the parameter that owns it
    (`len(leaf.fqns)` for padding)."""
    if not leaf.packed:
        return _owners(leaf.flat, leaf.shard_rank, device)
    return _packed_owners(leaf, device)


@functools.lru_cache(maxsize=1024)
def _packed_owners(leaf: _Leaf, device: torch.device) -> Tensor:
    at = {f: i for i, f in enumerate(leaf.fqns)}
    pieces = _pieces(leaf)
    counts = torch.tensor([p.local.stop - p.local.start for p in pieces], dtype=torch.long)
    index = torch.tensor([at[p.fqn] for p in pieces], dtype=torch.long)
    return torch.repeat_interleave(index, counts).to(device)


@functools.lru_cache(maxsize=1024)
def _owners(flat: FlatLayout, shard_rank: int, device: torch.device) -> Tensor:
    """Per element of rank `shard_rank`'s shard of `flat`: the index of the parameter that
    owns it, `len(flat.fqns)` for padding."""
    counts = torch.tensor(flat.split_sizes)
    index = torch.tensor([i for _, i in flat.segments], dtype=torch.long)
    owner = torch.repeat_interleave(index, counts)
    start = shard_rank * flat.shard_numel
    return owner[start : start + flat.shard_numel].to(device)


def _predicate(where: Where, fqns: tuple[tuple[str, ...], ...]) -> Callable[[str, Tensor], bool]:
    if isinstance(where, Mapping):
        known = {f for leaf in fqns for f in leaf}
        unknown = [f for f in where if f not in known]
        if unknown:
            raise ValueError(
                f"funcshard.optim: the mask names {format_names(unknown)}, which are not "
                f"parameters of these params. Key it by the FQNs of funcshard.unshard."
            )
        return lambda fqn, _: bool(where.get(fqn, False))
    if callable(where):
        return where
    raise TypeError(
        f"funcshard.optim: a mask is a predicate (fqn, param) -> bool or a dict FQN -> bool, "
        f"got {type(where).__name__}."
    )
