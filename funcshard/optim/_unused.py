"""Parameters no rank used this step, as an optimizer's leaves see them, and the steps each
parameter sat out (Adam's per-parameter step counts).

[Note: optimizers skip unused parameters]
torch.optim leaves a parameter whose `.grad` is None alone: no weight decay, no moment
update, no step count; its Adam bias correction later uses its own count of steps taken. The
gradient record names such parameters (`grads.unused`, see [Note: unused parameters] in
funcshard/step/_usage.py), and `idle(grads, params)` turns them into what a leaf-wise update
needs: per leaf, False (all used), True (every parameter of the leaf unused: the leaf is
left out like a frozen one) or a boolean tensor over the leaf's elements (a flat shard where
some parameters were used and some not). A masked leaf is computed as usual and then keeps
its old moments and a zero update where the mask holds.

Adam's step counts per parameter: `AdamState.skipped_steps` maps each parameter's FQN to the
number of steps it sat out (an int64 0-d tensor on the CPU, so every leaf of an optimizer
state stays a tensor), and its count is `step - skipped_steps[fqn]`. A step decides on the
host: the mapping's values are read as ints once per mapping object (cached by identity;
a state hands the same mapping on while nothing is skipped), so a run where every
parameter always trains reads nothing and takes the unchanged path (one fused kernel call
per leaf group). While dynamo traces, the counts cannot be read without a graph break: a
compiled step takes every parameter's count as the optimizer's (and, tracking no usage,
skips nothing), which differs only after eager steps skipped some parameter, and only in
the bias correction of early steps. Keyed by FQN, a checkpoint stores them by name, so
they load under another plan or world size; a checkpoint written before they existed lacks
them, and its load keeps the fresh state's zeros, as it does for any number a checkpoint
does not hold (tests/recipes/test_from_fsdp2_unused.py checks it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from funcshard.core._groups import GroupView
from funcshard.core._state import ShardedGrads, ShardedState
from funcshard.optim._segments import segments
from funcshard.step import _usage as usage


def unused_of(grads: Any) -> frozenset[str]:
    """The parameters no rank used, as `grads` say (none for a dict: plain autograd's)."""
    if isinstance(grads, ShardedGrads | GroupView):
        return grads.unused
    return frozenset()


def idle(grads: Any, params: Any) -> list[bool | Tensor] | None:
    """Per leaf of `params`: whether its elements belong to parameters no rank used (see
    [Note: optimizers skip unused parameters]); None when every parameter was used."""
    unused = unused_of(grads)
    if not unused:
        return None
    seg = segments(params)
    out: list[bool | Tensor] = []
    for i, fqns in enumerate(seg.fqns):
        hit = [f in unused for f in fqns]
        if not any(hit):
            out.append(False)
        elif all(hit):
            out.append(True)
        else:
            out.append(seg.per_element(i, hit))
    return out


def param_names(params: Any) -> list[str]:
    """Every trainable parameter's FQN, in leaf order (what `skipped_steps` keys)."""
    if isinstance(params, ShardedState):
        return list(usage.tracked(params.layout))  # the parameters usage is said of
    if isinstance(params, GroupView | Mapping):
        return [f for fqns in segments(params).fqns for f in fqns]
    raise TypeError(
        f"funcshard.optim: params must be a ShardedState or a dict of tensors, got "
        f"{type(params).__name__}."
    )


def zero_counts(params: Any) -> dict[str, Tensor]:
    """`AdamState.skipped_steps` of a new state: a 0 per trainable parameter."""
    counts = {f: torch.zeros((), dtype=torch.int64) for f in param_names(params)}
    _remember(counts, dict.fromkeys(counts, 0))
    return counts


def lags(skipped: Mapping[str, Any]) -> dict[str, int] | None:
    """`skipped` as Python ints (None while dynamo traces: see the note), read from the
    tensors once per mapping: a state passes the same mapping on while no parameter sits a
    step out, so a step reads nothing."""
    if torch.compiler.is_dynamo_compiling():
        return None
    hit = _KNOWN.get(id(skipped))
    if hit is not None and hit[0] is skipped:
        return hit[1]
    ints = {f: int(n) for f, n in skipped.items()}
    _remember(skipped, ints)
    return ints


def any_lag(skipped: Mapping[str, Any]) -> bool:
    """Whether some parameter has sat a step out (False while traced: see the note)."""
    ints = lags(skipped)
    if ints is None:
        return False
    hit = _KNOWN[id(skipped)]
    if hit[2] is None:
        _KNOWN[id(skipped)] = (hit[0], hit[1], any(ints.values()))
    return bool(_KNOWN[id(skipped)][2])


def skipped_after(skipped: Mapping[str, Tensor], grads: Any) -> Mapping[str, Tensor]:
    """`skipped` with one more for every parameter no rank used this step (the same
    mapping when there are none)."""
    unused = unused_of(grads)
    if not unused:
        return skipped
    ints = dict(lags(skipped) or {})
    out = dict(skipped)
    for f in unused:
        ints[f] = ints.get(f, 0) + 1
        out[f] = torch.tensor(ints[f], dtype=torch.int64)
    _remember(out, ints)
    return out


def _remember(skipped: Mapping[str, Any], ints: dict[str, int]) -> None:
    if len(_KNOWN) >= 256:
        _KNOWN.pop(next(iter(_KNOWN)))  # the oldest: a state long replaced
    _KNOWN[id(skipped)] = (skipped, ints, None)  # (holding it keeps the id from being reused)


# id of a skipped_steps mapping -> (it, its ints, whether any is nonzero once asked)
_KNOWN: dict[int, tuple[Mapping[str, Any], dict[str, int], bool | None]] = {}


def counts(step: int, lags: Mapping[str, int], params: Any) -> list[int | Tensor]:
    """Per leaf of `params`: the step count of its parameters after this step, one number
    when all agree, else a float64 tensor over its elements (padding counts as `step`).
    (`idle` says which leaves sit the step out whole.)"""
    seg = segments(params)
    out: list[int | Tensor] = []
    for i, fqns in enumerate(seg.fqns):
        own = [step - lags.get(f, 0) for f in fqns]
        if len(set(own)) == 1:
            out.append(own[0])
            continue
        per_param = torch.tensor(own, dtype=torch.float64)
        out.append(seg.per_element(i, per_param, fill=float(step)))
    return out
