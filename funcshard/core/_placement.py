"""Placement: how one flat buffer's parameters are arranged over the shard axis.

[Note: owned placement]
A unit's placement is a per-unit option (see [Note: per-unit options]): `"even"` (the flat
split of [Note: flat buffers]) or `"owned"` (each parameter whole on one rank of the shard
axis). An owned buffer is still one flat buffer of `shard_numel * shard_size` elements,
with rank r holding `[r * shard_numel, (r + 1) * shard_numel)`; only the arrangement
differs. Each parameter gets an owner rank: largest first (ties by plan order), each to the
rank that holds the fewest elements so far (ties: the first in rank order counted from the
unit's `first_owner`, its index in a stack of layers, so equal blocks spread their largest
matrices, and the bytes each rank sends and its optimizer work, over the ranks). A rank's
parameters lie one after another, in plan order, from the start of its shard; `shard_numel`
is the largest rank's load, and the rest of every shard is zero padding. So the padding is
spread over the ranks instead of trailing, and a `FlatLayout`'s offsets are no longer the
running sum of its numels: its `segments` say what lies where, in buffer order.

Why one evenly split buffer, and not buffers of each rank's own size: every collective of
a step (all-gather, reduce-scatter, prefetch, resharding, recompute, mixed precision, HSDP,
DDP, compile, offload) already works on one evenly split buffer with per-parameter offsets.
An owned unit reuses all of them unchanged; only offsets and padding differ. The padding is
held in memory, at most the largest rank's load less the mean; on gloo it is never sent:
the layout's `loads` (each rank's elements before its padding) go down to the exchange,
which sends only those (see [Note: the uneven exchange] in funcshard/comm/_exchange.py).
NCCL, the fake group and traced steps send it. `fs.optim.whole_params` finds each parameter
whole in its owner's shard and runs its transform there with no collective.

The bound: a parameter may hold at most twice an even rank's share of its buffer,
`2 * ceil(numel / shard_size)` elements. With largest-first assignment the largest load is
at most the mean plus the largest parameter, so within the bound an owned shard is at most
three times an even one (and usually within a few percent). A larger parameter is refused
by name, before any collective: its owner would hold it alone while the other ranks hold
padding. On a shard axis of one rank, owned is even: the layout records "even".

What the padding costs, as `fs.estimate` counts it for the 10M GPT of `benchmarks.muon`
(blocks owned, the root even, fp32; bytes each rank sends per step in gathers, regathers and
reduce-scatters). Padded (device="cuda": NCCL): at 2 ranks 55.4 MiB owned against 49.3 MiB
even (+12%); at 4 ranks 92.4 MiB against 74.0 MiB (+25%), because a block's largest
matrices (590K elements) exceed a quarter of the block (443K). Uneven (device="cpu":
gloo): the ranks' mean is the even placement's, 49.3 MiB at 2 ranks and 74.0 MiB at 4, so
the issue's goal of sending no more than the even placement with plain AdamW holds on the
mean. With every unit's owners starting at rank 0, each rank sent a different amount (at 4
ranks 83.5, 83.5, 73.9 and 55.1 MiB: ranks 0 and 1 owned every block's two largest
matrices); owners now start at each block's index (`first_owner`), so alike blocks add up
to the same load on every rank (tests/core/test_placement.py). Even units with
`whole_params` add its all-to-alls instead (about 3 * M * (N - 1) / N^2 elements per rank
for M elements of matrices: 20 MiB at 2 ranks, 15 MiB at 4).

A step still sends unequal amounts per rank: backward regathers every unit but the one
forward ran last (see [Note: resharding after forward] in funcshard/step/_regather.py), and
3 of 4 rotated blocks do not add up alike. Counted on 4 gloo ranks (benchmarks/RESULTS.md):
72.3, 74.0, 77.3 and 72.3 MiB, mean 74.0, the even placement's to the digit, no padding
sent; rank 2 holds 1.62M of blocks 0-2's elements against a mean of 1.33M. No choice of
owners evens that out here: with each block's loads 590K, 590K, 442K and 152K, three
blocks sent twice and one sent once add up alike on no assignment of 4 ranks (and the
layout does not know which unit backward keeps). An all-gather whose ranks send equal
bytes would relay the heavy owners' parts through the light ones (two hops), which the
exchange does not do.

The choice of owners is a pure function of the shapes and the shard size, so every rank
computes the same one, and a checkpoint, stored by FQN (funcshard/io/_checkpoint_dict.py), moves
between placements and world sizes like any other layout change.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from funcshard.core import _unit_options as unit_options

PLACEMENTS = ("even", "owned")

Placement = str | Mapping[Any, str] | Callable[[Any], str]


def owners(numels: tuple[int, ...], shard_size: int, first: int = 0) -> tuple[int, ...]:
    """The owner rank of each parameter: largest first, each to the least-loaded rank (ties:
    the first in rank order counted from `first`)."""
    loads = [0] * shard_size
    out = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(shard_size), key=lambda r: (loads[r], (r - first) % shard_size))
        out[i] = rank
        loads[rank] += numels[i]
    return tuple(out)


def first_owner(unit: str, shard_size: int) -> int:
    """Where a unit's owners start: its index for units named like a stack's layers
    (`blocks.3`), else a stable hash of its name. Equal units (a model's blocks) then put
    their largest matrices on different ranks, where starting every unit at rank 0 gave
    ranks 0 and 1 each block's largest matrices (4 ranks, 10M GPT: 83.5, 83.5, 73.9 and 55.1
    MiB sent per step, against a mean of 74.0) and the most optimizer work."""
    last = unit.rsplit(".", 1)[-1]
    key = int(last) if last.isdigit() else int(hashlib.sha256(unit.encode()).hexdigest(), 16)
    return key % shard_size


def loads(numels: tuple[int, ...], owner: tuple[int, ...], shard_size: int) -> tuple[int, ...]:
    """Each rank's elements of whole parameters: what its shard holds before the padding,
    and all an uneven exchange sends of it (see [Note: the uneven exchange] in
    funcshard/comm/_exchange.py)."""
    out = [0] * shard_size
    for numel, rank in zip(numels, owner, strict=True):
        out[rank] += numel
    return tuple(out)


def owned_offsets(
    numels: tuple[int, ...], owner: tuple[int, ...], shard_size: int
) -> tuple[tuple[int, ...], int]:
    """Each parameter's offset in the owned buffer and the shard numel (the largest load)."""
    shard_numel = max(loads(numels, owner, shard_size), default=0)
    cursor = [r * shard_numel for r in range(shard_size)]
    offsets = []
    for numel, rank in zip(numels, owner, strict=True):
        offsets.append(cursor[rank])
        cursor[rank] += numel
    return tuple(offsets), shard_numel


def check_bound(name: str, fqns: tuple[str, ...], numels: tuple[int, ...], shard_size: int) -> None:
    """ValueError naming the first parameter of buffer `name` over the owned bound (see
    [Note: owned placement])."""
    share = -(-sum(numels) // shard_size)
    for fqn, numel in zip(fqns, numels, strict=True):
        if numel > 2 * share:
            raise ValueError(
                f"funcshard.shard: {fqn} ({numel:,} elements) in {name} is over the bound "
                f"of placement='owned': at most twice an even rank's share, 2 * "
                f"{share:,} elements over a shard axis of {shard_size} ranks; its owner would "
                f"hold it while the other ranks hold padding. Give this unit "
                f"placement='even' (plan(..., placement={{unit: 'even'}})), or put more "
                f"parameters in its unit."
            )


def fits(unit: Any, shard_size: int) -> bool:
    """Whether `unit` (a plan's Unit) may be owned over `shard_size` ranks: every parameter
    within the bound of its buffer (one per dtype, and with `frozen="split"` the frozen
    parameters' apart; see [Note: owned placement])."""
    buffers: dict[tuple[Any, bool], list[int]] = {}
    apart = set(unit.frozen_fqns) if unit.frozen_apart else set()
    for fqn, shape, dtype in zip(unit.fqns, unit.shapes, unit.param_dtypes, strict=True):
        buffers.setdefault((dtype, fqn in apart), []).append(math.prod(shape))
    return all(max(n) <= 2 * -(-sum(n) // shard_size) for n in buffers.values())


def resolved(model: nn.Module, units: Any, placement: Placement | None) -> dict[str, str]:
    """The placement of each unit that is not "even", from what `fs.plan` was given: a name
    (every unit), a mapping (unit name, module, FQN or class -> name) or a callable
    (`Unit -> name`). Unknown names are refused, naming the unit and the choices."""
    if placement is None or placement == "even":
        return {}
    if isinstance(placement, str):
        _check_name("placement", placement)
        return {u.name: placement for u in units}
    if isinstance(placement, Mapping):
        given = unit_options.by_unit(model, units, placement, "placement")
    elif callable(placement):
        given = {u.name: placement(u) for u in units}
    else:
        raise TypeError(
            f"funcshard.plan: placement must be 'even', 'owned', a mapping from units to "
            f"those, or a callable Unit -> one of those, got {type(placement).__name__}."
        )
    for name, value in given.items():
        _check_name(f"placement[{name!r}]", value)
    return {name: value for name, value in given.items() if value != "even"}


def _check_name(where: str, value: object) -> None:
    if not isinstance(value, str) or value not in PLACEMENTS:
        raise ValueError(
            f"funcshard.plan: {where} must be one of {list(PLACEMENTS)}, got {value!r}. "
            f"'even' splits the unit's flat buffer evenly; 'owned' puts each parameter whole "
            f"on one rank."
        )
