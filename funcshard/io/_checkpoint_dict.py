"""The state dict a checkpoint hands torch.distributed.checkpoint: one entry per parameter.

Every parameter is a 1-D sharded tensor of its flattened values, each rank contributing the
contiguous piece its flat shard holds (see [Note: checkpoints] in funcshard/io/_checkpoint.py);
optimizer leaves lined up with the flats are split the same way; the rest are plain
tensors. A parameter of 0 elements is a plain empty tensor: a sharded tensor with no piece
on any rank is one torch cannot save.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.comm import _process_groups as process_groups
from funcshard.core._layout import FlatLayout, Layout, shard_pieces
from funcshard.core._state import ShardedState
from funcshard.io import _dcp as dcp
from funcshard.io._optim_leaves import Full, Packed


def to_dcp(
    state: ShardedState, described: list[tuple[Any, str, Any]], zeros: bool = False
) -> tuple[dict[str, Any], dict[str, str]]:
    """The DCP entries by key, and for each sharded key the flat it belongs to (its name in
    the per-replica comparison: `<prefix>#<flat index>`)."""
    layout = state.layout

    def value(t: Tensor) -> Tensor:
        return torch.zeros_like(t) if zeros else t

    out: dict[str, Any] = {}
    flat_of: dict[str, str] = {}

    def split(prefix: str, shard: Tensor, index: int | Packed) -> None:
        pieces = _split(prefix, value(shard), index, layout)
        out.update(pieces)
        flat_of.update(dict.fromkeys(pieces, f"{prefix}#{index}"))

    for index, shard in enumerate(state.shards):
        split("params", shard, index)
    out.update({f"params/{k}": value(v) for k, v in state.replicated.items()})
    out.update({f"buffers/{k}": value(v) for k, v in state.buffers.items()})
    for leaf, key, index in described:
        if isinstance(index, Full):
            out.update(full_pieces(key, value(leaf), layout.flats[index.flat]))
        elif index is not None:
            split(key, leaf, index)
        elif isinstance(leaf, Tensor):
            out[key] = value(leaf)
    return out, flat_of


def flat_shards(state: ShardedState, described: list[tuple[Any, str, Any]]) -> dict[str, Tensor]:
    """This rank's shard of every flat, params and lined-up optimizer leaves, by flat name."""
    out = {f"params#{i}": shard for i, shard in enumerate(state.shards)}
    out.update(
        {
            f"{key}#{index}": leaf
            for leaf, key, index in described
            if index is not None and not isinstance(index, Full)
        }
    )
    return out


def full_pieces(key: str, leaf: Tensor, flat: FlatLayout) -> dict[str, Tensor]:
    """Each parameter's whole values in a `Full` leaf (padding left out), by stored key."""
    return {
        f"{key}/{fqn}": leaf[offset : offset + numel]
        for fqn, offset, numel in zip(flat.fqns, flat.offsets, flat.numels, strict=True)
    }


def from_dcp(
    state: ShardedState, described: list[tuple[Any, str, Any]], loaded: dict[str, Any]
) -> tuple[ShardedState, list[Any]]:
    """The state and the optimizer leaves rebuilt from loaded entries (non-tensor leaves
    from `loaded` when present, else as described)."""
    layout = state.layout
    new_state = state.replace(
        shards=tuple(_join("params", loaded, i, layout) for i in range(len(layout.flats))),
        replicated={k: loaded[f"params/{k}"] for k in state.replicated},
        buffers={k: loaded[f"buffers/{k}"] for k in state.buffers},
    )
    leaves = [
        _whole(key, loaded, leaf, layout.flats[index.flat])
        if isinstance(index, Full)
        else _join(key, loaded, index, layout)
        if index is not None
        else loaded.get(key, leaf)
        for leaf, key, index in described
    ]
    return new_state, leaves


def _whole(key: str, loaded: dict[str, Any], like: Tensor, flat: FlatLayout) -> Tensor:
    """A `Full` leaf rebuilt from its parameters' loaded values (padding zero)."""
    leaf = torch.zeros_like(like)
    for fqn, offset, numel in zip(flat.fqns, flat.offsets, flat.numels, strict=True):
        leaf[offset : offset + numel] = loaded[f"{key}/{fqn}"].reshape(-1)
    return leaf


def first_ranks_buffers(state: ShardedState) -> ShardedState:
    """`state` holding the mesh's first rank's buffers: each rank's own (BatchNorm's running
    statistics) may differ, and DCP writes a tensor that several ranks hold from whichever
    rank it picks, so every rank saves the first rank's, as `full_state_dict` returns them.
    Communicates: one broadcast per buffer."""
    mesh = state.layout.mesh
    if mesh.size == 1 or not state.buffers:
        return state
    first = {
        n: collectives.broadcast(b, mesh.group, src_rank=mesh.ranks[0])
        for n, b in state.buffers.items()
    }
    return dataclasses.replace(state, buffers=first)


def _pieces(shard: Tensor, lined: int | Packed, layout: Layout) -> dict[str, tuple[int, Tensor]]:
    """The piece of each parameter that this rank's leaf holds: fqn -> (start, values). The
    leaf is a flat shard (`lined` its index) or a partition group's packed leaf."""
    flat, fqns = _source(lined, layout)
    return {
        flat.fqns[p.index]: (p.start, shard[p.local : p.local + p.stop - p.start])
        for p in shard_pieces(flat, layout.mesh.shard_rank, fqns)
    }


def _source(lined: int | Packed, layout: Layout) -> tuple[FlatLayout, tuple[str, ...] | None]:
    """The flat buffer a lined-up leaf comes from, and the parameters it holds (None: all)."""
    if isinstance(lined, Packed):
        return layout.flats[lined.flat], lined.fqns
    return layout.flats[lined], None


def _members(lined: int | Packed, layout: Layout) -> list[tuple[str, int]]:
    """(fqn, numel) of every parameter a lined-up leaf stores a key for."""
    flat, fqns = _source(lined, layout)
    chosen = set(flat.fqns if fqns is None else fqns)
    return [(f, n) for f, n in zip(flat.fqns, flat.numels, strict=True) if f in chosen]


def _split(prefix: str, shard: Tensor, lined: int | Packed, layout: Layout) -> dict[str, Any]:
    """One 1-D sharded tensor per parameter of a lined-up leaf, holding this rank's piece."""
    mesh = layout.mesh
    pieces = _pieces(shard, lined, layout)
    placed = _placed(lined, layout)
    # Sharded over the shard axis only: each replica holds (and loads) all of it, and DCP's
    # save planner writes a chunk that several replicas hold once.
    return {
        f"{prefix}/{fqn}": dcp.sharded_tensor(
            [pieces[fqn]] if fqn in pieces else [], numel, mesh.shard_group, placed[fqn], shard
        )
        if numel
        else shard.new_zeros(0)  # no rank holds a piece of it: see the module's docstring
        for fqn, numel in _members(lined, layout)
    }


def _placed(lined: int | Packed, layout: Layout) -> dict[str, list[tuple[int, int, int]]]:
    """Per parameter of a lined-up leaf, every shard rank's piece of it as (global rank,
    start, numel): what each rank's sharded tensor records of the others, with no exchange."""
    flat, fqns = _source(lined, layout)
    placed: dict[str, list[tuple[int, int, int]]] = {}
    for shard_rank, rank in enumerate(process_groups.group_ranks(layout.mesh.shard_group)):
        for p in shard_pieces(flat, shard_rank, fqns):
            placed.setdefault(flat.fqns[p.index], []).append((rank, p.start, p.stop - p.start))
    return placed


def _join(prefix: str, loaded: dict[str, Any], lined: int | Packed, layout: Layout) -> Tensor:
    """This rank's lined-up leaf rebuilt from loaded per-parameter pieces (padding zero)."""
    flat, fqns = _source(lined, layout)
    pieces = shard_pieces(flat, layout.mesh.shard_rank, fqns)
    size = flat.shard_numel if fqns is None else sum(p.stop - p.start for p in pieces)
    leaf = torch.zeros(size, dtype=flat.dtype, device=layout.mesh.device)
    for p in pieces:
        for start, values in dcp.local_pieces(loaded[f"{prefix}/{flat.fqns[p.index]}"]):
            at = p.local - p.start + start  # the loaded piece's place in this rank's leaf
            leaf[at : at + values.numel()] = values.reshape(-1)
    return leaf
