"""Moving values between two layouts of one unit: a rank's leaf of a new flat buffer filled,
parameter by parameter, from leaves of the old flat buffers gathered whole.

Used by `refreeze` for the shards and for every optimizer leaf that lines up with a flat
buffer (see [Note: refreezing a live state] in funcshard/io/_refreeze.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.comm._mesh import Mesh
from funcshard.core._layout import FlatLayout, shard_pieces

Source = Callable[[str], tuple[Tensor, int] | None]
"""Where a parameter's old values are: (an old buffer gathered whole, the parameter's offset
in it), or None to keep what the new leaf holds (fresh state)."""


class Gathered:
    """Old leaves gathered whole over the shard axis, each once, until `release`.

    Communicates: one all-gather per distinct old leaf asked for."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self._full: dict[object, Tensor] = {}

    def full(
        self, key: object, leaf: Tensor, flat: FlatLayout, packed: tuple[str, ...] | None
    ) -> Tensor:
        """Old leaf `leaf` of `flat` (packed: holding only `packed`'s pieces) as the whole
        (padded_numel,) buffer, on the mesh's device."""
        if key not in self._full:
            shard = _unpacked(leaf, flat, self.mesh.shard_rank, packed).to(self.mesh.device)
            what = f"funcshard.refreeze {flat.name}"
            group = self.mesh.shard_group
            self._full[key] = collectives.all_gather(shard, group, what, flat.loads).wait()
        return self._full[key]

    def release(self) -> None:
        """Drop the gathered buffers (a unit's at a time are held, as a forward holds them)."""
        self._full.clear()


def _unpacked(leaf: Tensor, flat: FlatLayout, rank: int, packed: tuple[str, ...] | None) -> Tensor:
    """A packed leaf (a parameter group's pieces only) as a (shard_numel,) shard, zeros
    where other parameters' pieces sit; an unpacked leaf as it is."""
    if packed is None:
        return leaf.detach()
    shard = leaf.new_zeros(flat.shard_numel)
    for p in shard_pieces(flat, rank, packed):
        shard[p.at : p.at + p.stop - p.start] = leaf.detach()[p.local : p.local + p.stop - p.start]
    return shard


def repacked(
    start: Tensor, flat: FlatLayout, rank: int, packed: tuple[str, ...] | None, source: Source
) -> Tensor:
    """A copy of `start`, this rank's leaf of new flat buffer `flat` (packed: only
    `packed`'s pieces), with each parameter's piece taken from where `source` says."""
    out = start.detach().clone()
    with torch.no_grad():
        for p in shard_pieces(flat, rank, packed):
            found = source(flat.fqns[p.index])
            if found is not None:
                full, offset = found
                piece = full[offset + p.start : offset + p.stop]
                out[p.local : p.local + p.stop - p.start] = piece.to(out.device, out.dtype)
    return out
