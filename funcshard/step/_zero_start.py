"""Trainable parameters stuck at zero: all zero from the start and an exactly zero gradient.

[Note: parameters stuck at zero]
LoRA's adapters are a pair: peft starts B at zero and A at random, so B's gradient (through
A) is not zero and both train. If A starts at zero too (a skip-init state, `init="skip"`,
whose adapters no checkpoint filled; an init function that zeros both), each one's gradient
goes through the other, both gradients are exactly zero, and no optimizer ever moves them:
nothing trains, silently. One zero parameter alone is no sign of it (LoRA's B, a bias, a
norm's bias start at zero and train), and neither is one zero gradient. Both together, on
the first step, are.

So: `shard` and `replicate` note which trainable parameters start all zero on this rank's
pieces (`started`, on any init path: a skip, an init function, a model built on the CPU).
The first reduced step of that layout checks, on each rank, which of them are still all
zero in the state it differentiates (a checkpoint loaded since clears them) and whose
reduced gradient pieces are all zero, and packs them as int64 words in the tracked
parameters' order (`usage.words_of`); a rank holding no piece of a parameter says yes. The
words ride the non-finite verdict's collective, after the unused parameters' words: no
collective of their own. Every rank ANDs the columns, so a parameter is named only if every
rank saw zeros, and every rank decides alike; the parameters no rank used (the agreed
`grads.unused`) are left out: they got no gradient at all. Whether the words ride is the
same on every rank: the layout's first step that issues a verdict (`check_finite` "skip",
or "raise" with unused parameters tracked), in eager mode. A step without a verdict checks
nothing; the layout's next one does.

Cost: one pass over the shards at `shard` time and one over the shards and gradients on
the first step, a few int64 words in that step's verdict, and one read of the verdict on
the host then. Later steps pay a dict lookup.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.core._layout import Layout, shard_pieces
from funcshard.core._state import ShardedGrads, ShardedState
from funcshard.core._tree import format_names
from funcshard.step import _usage as usage


class StuckAtZeroWarning(UserWarning):
    """Trainable parameters started all zero and their first gradient is exactly zero on
    every rank, so no step moves them (LoRA with both A and B zero)."""


# id(layout) -> (layout, this rank's parameters that started all zero): layouts whose first
# step has not checked them yet (holding the layout keeps its id from being reused)
_STARTED: dict[int, tuple[Layout, frozenset[str]]] = {}


def started(state: ShardedState) -> None:
    """Note the trainable parameters whose pieces on this rank are all zero in a new state."""
    if len(_STARTED) >= 64:
        _STARTED.pop(next(iter(_STARTED)))  # the oldest: a state that never stepped
    layout = state.layout
    _STARTED[id(layout)] = (layout, _zeros(layout, state.leaves()))


def words(params: object, grads: object, checking: str) -> list[int]:
    """This rank's words for the check of a layout's first step that issues a verdict (see
    [Note: parameters stuck at zero]), or [] (checked before, no verdict, traced)."""
    if torch.compiler.is_dynamo_compiling():  # (first: nothing below is for dynamo to trace)
        return []
    if not isinstance(params, ShardedState) or not isinstance(grads, ShardedGrads):
        return []
    layout = params.layout
    hit = _STARTED.get(id(layout))
    if hit is None or hit[0] is not layout:
        return []
    verdict = checking == "skip" or (checking == "raise" and grads.usage is not None)
    if not verdict or collectives.tracing(params.shards):
        return []
    del _STARTED[id(layout)]
    candidates = hit[1]
    if candidates:
        candidates &= _zeros(layout, params.leaves())
    if candidates:
        candidates &= _zeros(layout, grads.leaves())
    return usage.words_of(layout, candidates)


def warn(grads: ShardedGrads, where: str) -> None:
    """Warn, naming them, about the parameters every rank's words (where the verdict's
    `extra` says they are in each rank's row) said are stuck at zero."""
    verdict = grads.verdict
    if verdict is None:  # (a verdict's check raised instead)
        return
    at, n = verdict.extra
    everywhere = usage.agreed(grads.layout, verdict.values(), verdict.width(), at, n)
    stuck = [name for name in usage.tracked(grads.layout) if name in everywhere - grads.unused]
    if stuck:
        warnings.warn(
            f"{where}: the trainable parameters {format_names(stuck)} started all zero and "
            f"their gradients on this first step are exactly zero on every rank, so no step "
            f"will move them (LoRA's trap: A and B both zero, each one's gradient goes "
            f"through the other). Give one of each pair its random start before training: "
            f"an init that initializes it (shard(..., init=fn): peft draws A and zeros B), "
            f"a checkpoint that holds it (funcshard.checkpoint.load_hf with strict=True "
            f"says which parameters a file lacks), or funcshard.reshard(state, values).",
            StuckAtZeroWarning,
            stacklevel=4,
        )


def _zeros(layout: Layout, leaves: list[Tensor] | list[Tensor | None]) -> frozenset[str]:
    """The trainable parameters whose pieces in this rank's `leaves` (a state's or its
    gradients' `leaves()`) are all zero; a parameter with no piece here counts as zero."""
    rank, n = layout.mesh.shard_rank, len(layout.flats)
    names: list[str] = []
    pieces: list[Tensor] = []
    holders: list[str] = []
    for flat, leaf in zip(layout.flats, leaves[:n], strict=True):
        if flat.frozen:
            continue
        names.extend(
            f
            for f, numel in zip(flat.fqns, flat.numels, strict=True)
            if f not in flat.frozen_fqns and numel > 0
        )
        if leaf is None:
            continue
        for p in shard_pieces(flat, rank):
            fqn = flat.fqns[p.index]
            if fqn in flat.frozen_fqns:
                continue
            pieces.append(leaf[p.at : p.at + p.stop - p.start])
            holders.append(fqn)
    for j, fqn in enumerate(layout.replicated):
        leaf = leaves[n + j]
        if fqn in layout.replicated_trainable and (leaf is None or leaf.numel() > 0):
            names.append(fqn)
            if leaf is not None:
                pieces.append(leaf)
                holders.append(fqn)
    if not pieces:
        return frozenset(names)
    nonzero = torch.stack([p.ne(0).any() for p in pieces]).tolist()  # one read on the host
    moving = {f for f, nz in zip(holders, nonzero, strict=True) if nz}
    return frozenset(f for f in names if f not in moving)
