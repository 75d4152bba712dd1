"""A layout with another frozen set: the flat buffers `plan(..., frozen="split")` would give
the units whose frozen set changed, the same flat buffers for every other unit.

See [Note: refreezing a live state] in funcshard/io/_refreeze.py for how a state moves onto it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from funcshard.core._layout import FlatLayout, Layout, trainable_then_frozen


def frozen_of(layout: Layout) -> frozenset[str]:
    """Every parameter of `layout` that gets no gradient: frozen buffers' members, frozen
    members of trainable buffers (frozen="warn"), frozen replicated parameters."""
    return frozenset(
        [f for flat in layout.flats for f in (flat.fqns if flat.frozen else flat.frozen_fqns)]
        + list(layout.replicated_frozen)
    )


def refrozen(layout: Layout, frozen: frozenset[str]) -> Layout:
    """`layout` with exactly `frozen` frozen. A unit whose frozen set is unchanged keeps its
    flat buffers as they are; another is laid out as a plan with frozen="split" lays it out:
    per dtype, its trainable members then its frozen ones, each a buffer of their own."""
    before = frozen_of(layout)
    rank = {fqn: i for i, fqn in enumerate(layout.state_dict_keys)}
    flats: list[FlatLayout] = []
    for unit in layout.units:
        mine = [flat for flat in layout.flats if flat.unit == unit]
        fqns = {f for flat in mine for f in flat.fqns}
        if fqns & before == fqns & frozen:
            flats.extend(mine)
        else:
            flats.extend(_split(mine, frozen, rank))
    replicated_frozen = tuple(f for f in layout.replicated if f in frozen)
    return dataclasses.replace(layout, flats=tuple(flats), replicated_frozen=replicated_frozen)


def _split(
    mine: list[FlatLayout], frozen: frozenset[str], rank: dict[str, int]
) -> list[FlatLayout]:
    """One unit's members (`mine`: its flat buffers) laid out afresh: per dtype in order of
    first appearance, the trainable members in plan order, then the frozen ones."""
    members = [
        (fqn, shape, flat.dtype)
        for flat in mine
        for fqn, shape in zip(flat.fqns, flat.shapes, strict=True)
    ]
    # plan order is registration order, which the model's state_dict keys keep
    members.sort(key=lambda m: rank.get(m[0], len(rank)))
    template = mine[0]
    dtypes: Iterable[torch.dtype] = dict.fromkeys(d for _, _, d in members)
    out = []
    for dtype in dtypes:
        of_dtype = [(f, s) for f, s, d in members if d == dtype]
        for group, still in trainable_then_frozen(of_dtype, frozen):
            out.append(
                FlatLayout(
                    unit=template.unit,
                    dtype=dtype,
                    fqns=tuple(f for f, _ in group),
                    shapes=tuple(s for _, s in group),
                    shard_size=template.shard_size,
                    mp=template.mp,
                    frozen=still,
                    placement=template.placement,  # an owned unit stays owned
                )
            )
    return out


def same_buffer(a: FlatLayout, b: FlatLayout) -> bool:
    """Whether two flat buffers hold the same parameters at the same places (so a shard of
    one is a shard of the other), whichever of them is frozen."""
    return (a.unit, a.dtype, a.fqns, a.shapes, a.shard_size, a.placement) == (
        b.unit,
        b.dtype,
        b.fqns,
        b.shapes,
        b.shard_size,
        b.placement,
    )
