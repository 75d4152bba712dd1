"""Params and grads as an optimizer reads them (see [Note: the optimizer's leaves] in
funcshard/optim/_leaves.py): their leaves, which of them are live or frozen, new containers over new
leaves; and the arithmetic between params and updates, `apply_updates` and `difference`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor

from funcshard.core._groups import GroupView
from funcshard.core._layout import frozen_ranges
from funcshard.core._state import LocalGrads, ShardedGrads, ShardedState, ensure_live
from funcshard.core._state import donate as donate_record
from funcshard.optim._leaves import with_leaves


def _param_leaves(params: Any) -> list[Tensor]:
    if isinstance(params, ShardedState | GroupView):
        ensure_live(params, "optim")
        # a params' view (not a grads') holds a tensor at every leaf
        return cast(list[Tensor], params.leaves())
    if isinstance(params, Mapping):
        ensure_live(params, "optim")
        return list(params.values())
    raise TypeError(
        f"funcshard.optim: params must be a ShardedState or a dict of tensors, got "
        f"{type(params).__name__}."
    )


def _grad_leaves(grads: Any) -> list[Tensor | None]:
    if isinstance(grads, ShardedGrads | GroupView):
        ensure_live(grads, "optim")
        return grads.leaves()
    if isinstance(grads, Mapping):
        ensure_live(grads, "optim")
        return list(grads.values())
    if isinstance(grads, LocalGrads):  # see [Note: units kept local] in step/_keep_local.py
        raise TypeError(
            f"funcshard.optim: these gradients are not reduced yet: units "
            f"{list(grads.local_units)} are still local (value_and_grad(..., reduce=False) "
            f"or keep_local=...). Reduce them with funcshard.reduce(state, grads) first."
        )
    raise TypeError(
        f"funcshard.optim: grads must be ShardedGrads or a dict of tensors, got "
        f"{type(grads).__name__} (reduce LocalGrads with funcshard.reduce first)."
    )


def _zeros_like(params: Any) -> tuple[Tensor | None, ...]:
    """A zero buffer per parameter leaf, None for a frozen unit's (it never gets a gradient)."""
    leaves = _param_leaves(params)
    frozen = _frozen_leaves(params) if isinstance(params, ShardedState) else [False] * len(leaves)
    return tuple(None if f else torch.zeros_like(p) for p, f in zip(leaves, frozen, strict=True))


def _frozen_leaves(state: ShardedState) -> list[bool]:
    """Per leaf of `state.leaves()`: whether it never gets a gradient."""
    layout = state.layout
    return [f.frozen for f in layout.flats] + [
        f in layout.replicated_frozen for f in layout.replicated
    ]


def _like(grads: Any, leaves: list[Tensor | None], donated: bool = False) -> Any:
    """Put leaves back into the container type of `grads` (marking `grads` as used up when
    its buffers were `donated` to hold the new leaves)."""
    new = with_leaves(grads, leaves)
    if donated:
        donate_record(grads, "an optimizer update(donate=True)")
    return new


def _live(grads: Any, params: Any) -> list[tuple[int, Tensor, Tensor]]:
    """(index, param, grad) for every leaf that has a gradient."""
    param_leaves, grad_leaves = _param_leaves(params), _grad_leaves(grads)
    if len(param_leaves) != len(grad_leaves):
        raise ValueError(
            f"funcshard.optim: {len(grad_leaves)} gradient leaves for {len(param_leaves)} "
            f"parameter leaves; pass the grads of these params."
        )
    return [
        (i, p, g)
        for i, (p, g) in enumerate(zip(param_leaves, grad_leaves, strict=True))
        if g is not None
    ]


def difference(a: Any, b: Any) -> Any:
    """`a - b` leaf by leaf, as gradients of these params: ShardedGrads of two states (None
    for frozen leaves, which never move), a dict of two dicts. Local SGD's and DiLoCo's
    outer gradient is `difference(anchor, state)`, the parameters' move since the last outer
    step reversed, which an optimizer then takes as any gradient (examples/diloco.py).

    Communicates: nothing."""
    a_leaves, b_leaves = _param_leaves(a), _param_leaves(b)
    if len(a_leaves) != len(b_leaves) or type(a) is not type(b):
        raise ValueError(
            f"funcshard.optim.difference: both arguments must be params of one model, got a "
            f"{type(a).__name__} of {len(a_leaves)} leaves and a {type(b).__name__} of "
            f"{len(b_leaves)}."
        )
    frozen = _frozen_leaves(a) if isinstance(a, ShardedState) else [False] * len(a_leaves)
    with torch.no_grad():
        leaves = [None if f else x - y for x, y, f in zip(a_leaves, b_leaves, frozen, strict=True)]
    if isinstance(a, ShardedState):
        n = len(a.layout.flats)
        replicated = dict(zip(a.layout.replicated, leaves[n:], strict=True))
        return ShardedGrads(shards=tuple(leaves[:n]), layout=a.layout, replicated=replicated)
    return dict(zip(a.keys(), leaves, strict=True))


def apply_updates(params: Any, updates: Any, donate: bool = False) -> Any:
    """Add `updates` to `params` (None updates leave a leaf unchanged).

    The new leaves have no autograd history and require grad where the old ones did (unless
    the updates carry history themselves, as in a differentiable inner step).
    `donate=True` adds in place into the old params' memory: the caller promises never to
    read the old params again.
    """
    old = _param_leaves(params)
    delta = _grad_leaves(updates)
    if len(old) != len(delta):
        raise ValueError(
            f"funcshard.apply_updates: {len(delta)} updates for {len(old)} parameter leaves; "
            f"pass the updates computed for these params."
        )
    if isinstance(params, ShardedState):
        delta = _without_frozen_members(params, delta)
    with torch.no_grad() if donate else contextlib.nullcontext():  # in place, as torch.optim
        new = [
            p if u is None else (p.add_(u) if donate else _added(p, u))
            for p, u in zip(old, delta, strict=True)
        ]
    result = with_leaves(params, new)
    if donate:
        donate_record(params, "apply_updates(donate=True)")
    return result


def _added(param: Tensor, update: Tensor) -> Tensor:
    """`param + update` as a new leaf, as JAX's optax.apply_updates returns arrays: no autograd
    history (a loop would otherwise chain every step's addition), requiring grad where the
    parameter did. Updates that carry history (a differentiable inner step, as in MAML)
    keep it."""
    if update.requires_grad and torch.is_grad_enabled():
        return param + update
    with torch.no_grad():
        return (param + update).requires_grad_(param.requires_grad)


def _without_frozen_members(state: ShardedState, delta: list[Tensor | None]) -> list:
    """Zero the updates of frozen parameters that share a trainable unit (frozen="warn"):
    their gradients are zero, but weight decay would still move them."""
    rank = state.layout.mesh.shard_rank
    out = list(delta)
    for i, (flat, u) in enumerate(zip(state.layout.flats, delta, strict=False)):
        if u is None or not flat.frozen_fqns:
            continue
        start = rank * flat.shard_numel
        ranges = frozen_ranges(flat, start, start + flat.shard_numel)
        if ranges:
            cleared = out[i] = u.clone()  # the caller's updates are not written
            for r in ranges:
                cleared[r] = 0
    return out
