"""Per-unit reduction control: `value_and_grad(f, keep_local=units)` leaves the gradients of
chosen units unreduced (full-size, on each rank) while the other units reduce as usual, and
`reduce` later reduces only what is still local.

[Note: units kept local]
FSDP2 turns gradient sync off per module (`set_requires_gradient_sync(False,
recurse=False)`): those modules accumulate full-size gradients over micro-batches while
the others reduce-scatter in each. Here that is an argument of the step, not a flag on a
module: `value_and_grad(f, keep_local=units)`, with units named as the plan names them
(`state.layout.units`, "" the root). A module object is refused with a TypeError: the state
holds no modules, so it cannot map one to its unit before the first collective.

Mechanism. The one differentiable gather already decides per buffer: a gather given a sink
(a full-size gradient target) does not reduce, its backward hands the unreduced gradient to
the sink, as under `reduce=False`. `keep_local` gives sinks to the kept units' buffers only;
`specs_and_sinks` gives each buffer with a sink the spec of reduction "none", and every
other buffer reduces as before, overlapping backward. No second path.

Record. The result is a `LocalGrads`, the record of gradients not reduced yet: the kept
units' full-size gradients by FQN, the other buffers' reduced shards beside them
(`shards`, None at the local ones). `reduce=False` is the case where every unit is kept.
One record for "not reduced yet", so an optimizer refuses it as it refused LocalGrads, now
naming the units still local, and cannot mistake the reduced half for the whole.
`reduce` reduces the local units only and keeps the rest; `accumulate` adds two such
gradients with the same local units.

A unit local in one gradient and reduced in the other cannot be added without a reduce,
a collective, which `accumulate` never issues: refused, naming the units. So FSDP2's loop
(sync off but in the last micro-batch) is written: the units kept local in every
micro-batch, then one `reduce` after the last. They reduce once per step, as in FSDP2;
that reduce runs after backward instead of overlapping its end.

What is decided over ranks is decided once the gradient is fully reduced: the non-finite
verdict comes from `reduce` (over every buffer of its result, those reduced earlier
included), and `value_and_grad` gives a partly reduced gradient none (as for
`reduce=False`; `check_finite="raise"` still checks the loss and the gradients there).
Per-rank facts about the local gradients are to be agreed at that same point.

The replicated (ignored) parameters are not units: they reduce with the other buffers. On
HSDP the reduced buffers were all-reduced across replicas or not (`all_reduce`), and
`reduce` must be asked the same, or the two halves would mean different things; a
`divide_factor` is refused, since the reduced buffers already took the mean.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from torch import Tensor

from funcshard.core._layout import Layout, param_views
from funcshard.core._state import LocalGrads, ShardedGrads, ShardedState


def local_flats(layout: Layout, keep_local: Collection[Any], where: str) -> frozenset[int]:
    """The flat buffers of the units `keep_local` names (their trainable ones), checked:
    names only, each a unit of `layout` with something to train (see [Note: units kept
    local]). Raises the same error on every rank, before any collective."""
    if isinstance(keep_local, str) or not isinstance(keep_local, Collection):
        raise TypeError(
            f"funcshard.{where}: keep_local must be a collection of unit names, e.g. "
            f"keep_local=({keep_local!r},), got {type(keep_local).__name__} {keep_local!r}."
        )
    for unit in keep_local:
        if not isinstance(unit, str):
            raise TypeError(
                f"funcshard.{where}: keep_local names units by their module's name in the "
                f"model (as in model.named_modules(); '' is the root), got "
                f"{type(unit).__name__}: a state holds no modules to map it by. This state's "
                f"units are {list(layout.units)}."
            )
    unknown = [u for u in keep_local if u not in layout.units]
    if unknown:
        raise ValueError(
            f"funcshard.{where}: keep_local names {unknown}, which are not units of this "
            f"state; its units are {list(layout.units)} ('' is the root)."
        )
    frozen = [u for u in keep_local if all(f.frozen for f in layout.flats if f.unit == u)]
    if frozen:
        raise ValueError(
            f"funcshard.{where}: keep_local names {frozen}, whose parameters are all "
            f"frozen: they get no gradient to keep. Leave them out of keep_local."
        )
    return frozenset(i for i, f in enumerate(layout.flats) if f.unit in keep_local and not f.frozen)


def partly_reduced(
    layout: Layout,
    grads: list[Tensor | None],
    local: frozenset[int],
    replicated: dict[str, Tensor | None],
    across_replicas: bool,
) -> LocalGrads:
    """The record of a step whose buffers `local` were kept local: `grads[i]` is buffer i's
    full flat gradient there, its reduced shard elsewhere (None where frozen)."""
    full: dict[str, Tensor | None] = {}
    shards: list[Tensor | None] = []
    for i, (g, flat) in enumerate(zip(grads, layout.flats, strict=True)):
        if i in local and g is not None:
            full.update(zip(flat.fqns, param_views(g, flat), strict=True))
            shards.append(None)
        else:
            shards.append(None if g is None else g.to(flat.dtype))
    return LocalGrads(full, layout, tuple(shards), replicated, across_replicas)


def reduced_part(
    grads: LocalGrads, state: ShardedState, divide_factor: float | None, all_reduce: bool
) -> tuple[Tensor | None, ...] | None:
    """The shards `reduce` keeps as they are (None at the buffers it reduces), or None when
    every buffer is local; refuses what would mix two meanings (see [Note: units kept
    local])."""
    if not grads.shards:
        return None
    local = list(grads.local_units)
    if grads.layout.flats != state.layout.flats:
        raise ValueError(
            "funcshard.reduce: these partly reduced gradients were taken of a state with "
            "other flat buffers; pass the state value_and_grad differentiated."
        )
    if divide_factor is not None:
        raise ValueError(
            f"funcshard.reduce: divide_factor={divide_factor!r} for gradients of which only "
            f"units {local} are still local: the others were already reduced to the mean, "
            f"and a divide factor would apply to these alone. Scale the loss instead."
        )
    if all_reduce != grads.across_replicas and state.layout.mesh.replicate > 1:
        raise ValueError(
            f"funcshard.reduce: all_reduce={all_reduce}, but the units reduced with these "
            f"gradients were reduced with all_reduce={grads.across_replicas}; pass the same, "
            f"so that units {local} mean what the others do."
        )
    return grads.shards


def accumulate_local(
    a: Any, b: Any, add: Callable[[Tensor | None, Tensor | None], Tensor | None]
) -> LocalGrads:
    """`a + b`, where at least one is a LocalGrads: both must be, keeping the same units
    local (see [Note: units kept local])."""
    if not isinstance(a, LocalGrads | ShardedGrads) or not isinstance(b, LocalGrads | ShardedGrads):
        raise _kinds(a, b)
    local_a, local_b = (_local_units(g) for g in (a, b))
    if local_a != local_b:
        layout = (a if isinstance(a, LocalGrads) else b).layout
        differ = [u for u in layout.units if (u in local_a) != (u in local_b)]
        raise ValueError(
            f"funcshard.accumulate: units {differ} are local (unreduced) in one gradient "
            f"and reduced in the other (local: {list(local_a)} and {list(local_b)}), and "
            f"adding them would need a reduce. Keep the same units local in every "
            f"micro-batch (value_and_grad(..., keep_local=...)) and reduce once after the "
            f"last with funcshard.reduce(state, grads), or reduce each first."
        )
    if not isinstance(a, LocalGrads) or not isinstance(b, LocalGrads):
        raise _kinds(a, b)
    if (a.shards == ()) != (b.shards == ()):
        raise ValueError(
            "funcshard.accumulate: one gradient was taken with reduce=False (nothing "
            "reduced, the replicated parameters' gradients local too) and the other with "
            "keep_local=... (the replicated parameters' reduced); take both the same way."
        )
    if a.shards and a.across_replicas != b.across_replicas:
        raise ValueError(
            "funcshard.accumulate: one gradient's reduced units were all-reduced across "
            "replicas and the other's not (value_and_grad's all_reduce); take both alike."
        )
    return LocalGrads(
        {k: add(a.grads[k], b.grads[k]) for k in a.grads},
        a.layout,
        tuple(map(add, a.shards, b.shards)),
        {f: add(a.replicated.get(f), b.replicated.get(f)) for f in a.replicated},
        a.across_replicas,
        # unused only where unused in both (see [Note: unused parameters]); untracked: None
        a.unused & b.unused if a.unused is not None and b.unused is not None else None,
    )


def _local_units(grads: LocalGrads | ShardedGrads) -> tuple[str, ...]:
    return grads.local_units if isinstance(grads, LocalGrads) else ()


def _kinds(a: Any, b: Any) -> TypeError:
    return TypeError(
        f"funcshard.accumulate: both gradients must be of one kind, got {type(a).__name__} "
        f"and {type(b).__name__}."
    )
