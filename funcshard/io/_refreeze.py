"""Changing which parameters train on a live state: `refreeze` returns the state and its
optimizer state with other parameters frozen or trainable (FSDP2's `requires_grad_` between
steps).

[Note: refreezing a live state]
Under FSDP2 a user flips `requires_grad_` between steps: torch.optim skips a parameter whose
grad is None and makes state for one when it first steps. Here the frozen set is part of the
layout (a frozen flat buffer gets no gradient and no optimizer state), so `refreeze` returns
a state on another layout, and the optimizer state to go with it.
- The layout (funcshard/core/_refrozen.py): a unit whose frozen set did not change keeps its
  flat buffers, so its shards and optimizer leaves are the very tensors they were: no copy,
  no collective. A changed unit is laid out as `plan(..., frozen="split")` lays out a unit:
  per dtype, its trainable members, then its frozen ones, in buffers of their own. So the
  state holds afterwards what a state planned with the new frozen set holds: no gradient
  buffer and no moments for a frozen parameter. A buffer that only turns frozen or
  trainable whole (a unit frozen or unfrozen entirely) keeps its shard too.
- Values of a changed unit: its new buffers' shard boundaries differ from the old ones', so
  each old buffer of the unit is gathered whole over the shard axis (one all-gather each, a
  unit at a time, what a forward holds) and each rank copies its new shard out of them
  (funcshard/io/_repack.py). Optimizer leaves of that unit move the same way.
- The optimizer state, generically, by key as a checkpoint load moves it (see [Note:
  optimizer leaves in checkpoints]): `opt.init` of the new state gives the structure and the
  fresh values. Each of its leaves that lines up with a flat buffer takes, parameter by
  parameter, the old leaf of the same key where that parameter trained before, and init's
  values (zero moments) where it did not; every other leaf (a step count, a dict keyed by
  FQN) is the old leaf of the same key, or init's where there is none. Newly frozen
  parameters lose their state. The step count stays (a schedule continues), and Adam's
  per-parameter counts (`AdamState.skipped_steps`) restart a newly trainable parameter's
  own count at 0, as torch.optim does when it makes the state of a parameter's first step.
- init is called, not zeros assumed: a fresh state need not be zeros (Adagrad's initial
  accumulator), and a partition's groups follow the new layout. It costs one fresh
  optimizer state beside the old one while `refreeze` runs.
- Refused by name, before any collective: whole-parameter state (`Owned`: `whole_params`,
  `muon`), whose owner ranks are balanced over the trained parameters and so move; a
  per-leaf entry that is neither None nor lined up with its buffer (which parameters it
  belongs to is unknown).
- Checkpoints store parameters and moments by FQN, so one saved after refreezing loads
  into a state refrozen the same way, or planned with the new frozen set (frozen="split");
  nothing stores the plan (its fingerprint is compared only by `shard`, across ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from funcshard.core._layout import Layout
from funcshard.core._refrozen import frozen_of, refrozen, same_buffer
from funcshard.core._state import ShardedState, ensure_live
from funcshard.core._tree import format_names
from funcshard.io import _refreeze_optim as refreeze_optim
from funcshard.io._repack import Gathered, repacked
from funcshard.optim._base import Optimizer
from funcshard.optim._kernels import restart_counts

Select = Iterable[str] | Callable[[str, Tensor], bool]
"""Which parameters `refreeze` changes: FQNs of parameters, FQNs of modules (every parameter
under them), or a predicate `(fqn, param) -> bool` (`param` a meta tensor of the full shape)."""


def refreeze(
    state: ShardedState,
    opt_state: Any = None,
    *,
    frozen: Select = (),
    trainable: Select = (),
    opt: Optimizer | None = None,
) -> tuple[ShardedState, Any]:
    """Freeze `frozen` and unfreeze `trainable` between steps; return the new state and
    optimizer state (None without one), as `requires_grad_` does under FSDP2.

    Other parameters keep their setting. Units whose frozen set is unchanged keep their
    shards and optimizer state (the same tensors); a changed unit is laid out as
    `plan(..., frozen="split")` would lay it out, so afterwards the state takes the memory
    of one planned with the new frozen set. Newly frozen parameters lose their optimizer
    state; newly trainable ones get what `opt.init` gives them (zero moments) and, as
    torch.optim makes a parameter's state when it first steps, Adam counts their steps
    from zero (`AdamState.skipped_steps`), while the state's step count, which schedules
    read, goes on (see [Note: refreezing a live state]). `opt`, the optimizer whose state
    `opt_state` is, is needed with an optimizer state. The inputs are not changed, but the
    results share the unchanged units' tensors with them: a donating step on the new state
    writes those, so read the old state before it or not at all.

    Communicates: nothing when no unit changes; else one all-gather over the shard axis
    per flat buffer of a changed unit, and per optimizer leaf lined up with one.
    """
    where = "funcshard.refreeze"
    if not isinstance(state, ShardedState):
        raise TypeError(f"{where}: state must be a ShardedState, got {type(state).__name__}.")
    ensure_live(state, where)
    if opt_state is not None and not isinstance(opt, Optimizer):
        raise TypeError(
            f"{where}: an optimizer state needs its optimizer, got opt={opt!r}. Pass "
            f"opt=the Optimizer whose init made opt_state (its init gives newly trainable "
            f"parameters their fresh state)."
        )
    params = _params(state)
    freeze = _chosen(frozen, params, state.layout, "frozen")
    thaw = _chosen(trainable, params, state.layout, "trainable")
    _check(freeze, thaw, params)
    before = frozen_of(state.layout)
    after = (before - thaw) | freeze
    if after == before:
        return state, opt_state
    if opt_state is not None:
        refreeze_optim.check(opt_state, state.layout)
    layout = refrozen(state.layout, after)
    new_state = state.replace(shards=_moved_shards(state, layout), layout=layout)
    if opt_state is None or opt is None:
        return new_state, None
    moved = refreeze_optim.moved(opt_state, opt, state, new_state)
    return new_state, restart_counts(moved, before - after)  # their own counts start now


def _params(state: ShardedState) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every parameter of the state: its full shape and dtype."""
    out = {
        f: (shape, flat.dtype)
        for flat in state.layout.flats
        for f, shape in zip(flat.fqns, flat.shapes, strict=True)
    }
    for f in state.layout.replicated:
        out[f] = (tuple(state.replicated[f].shape), state.replicated[f].dtype)
    return out


def _chosen(select: Select, params: dict, layout: Layout, argument: str) -> frozenset[str]:
    """The parameters `select` names (see `Select`); unknown names raise, naming them."""
    if callable(select):
        return frozenset(
            f
            for f, (shape, dtype) in params.items()
            if select(f, torch.empty(shape, dtype=dtype, device="meta"))
        )
    names = (select,) if isinstance(select, str) else tuple(select)
    aliases = dict(layout.aliases)
    chosen, unknown = set(), []
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"funcshard.refreeze: {argument} must be FQNs (strings) or a predicate "
                f"(fqn, param) -> bool, got {type(name).__name__} {name!r:.60}."
            )
        if aliases.get(name, name) in params:
            chosen.add(aliases.get(name, name))
            continue
        under = [f for f in params if f.startswith(name + ".")]
        if not under:
            unknown.append(name)
        chosen.update(under)
    if unknown:
        raise ValueError(
            f"funcshard.refreeze: {argument} names {format_names(unknown)}, not a parameter "
            f"or module of this state (its parameters: {format_names(params)}). Pass "
            f"parameter FQNs (as funcshard.extract keys them), module FQNs, or a predicate "
            f"(fqn, param) -> bool."
        )
    return frozenset(chosen)


def _check(freeze: frozenset[str], thaw: frozenset[str], params: dict) -> None:
    both = sorted(freeze & thaw)
    if both:
        raise ValueError(
            f"funcshard.refreeze: {format_names(both)} would be both frozen and trainable. "
            f"Name each parameter in one of frozen= and trainable=."
        )
    not_float = [
        f for f in sorted(thaw) if not (params[f][1].is_floating_point or params[f][1].is_complex)
    ]
    if not_float:
        raise ValueError(
            f"funcshard.refreeze: trainable names {format_names(not_float)}, a "
            f"{params[not_float[0]][1]} parameter; only floating-point parameters get "
            f"gradients. Leave it frozen."
        )


def _moved_shards(state: ShardedState, layout: Layout) -> tuple[Tensor, ...]:
    """This rank's shards on `layout`: an old shard where its buffer is unchanged, else cut
    from the unit's old buffers gathered whole (one unit's at a time)."""
    old = state.layout
    at = {
        f: (i, offset)
        for i, flat in enumerate(old.flats)
        for f, offset in zip(flat.fqns, flat.offsets, strict=True)
    }
    gathered = Gathered(old.mesh)
    shards, unit = [], None
    for flat in layout.flats:
        if flat.unit != unit:
            gathered.release()
            unit = flat.unit
        same = [i for i, o in enumerate(old.flats) if same_buffer(o, flat)]
        if same:
            shards.append(state.shards[same[0]])
            continue
        first = state.shards[at[flat.fqns[0]][0]]

        def source(fqn: str) -> tuple[Tensor, int]:
            i, offset = at[fqn]
            return gathered.full(i, state.shards[i], old.flats[i], None), offset

        for fqn in flat.fqns:  # every rank gathers alike, whichever pieces it holds
            source(fqn)
        start = torch.zeros(flat.shard_numel, dtype=flat.dtype, device=first.device)
        shard = repacked(start, flat, old.mesh.shard_rank, None, source)
        shards.append(shard.pin_memory() if first.is_pinned() else shard)
    gathered.release()
    return tuple(shards)
