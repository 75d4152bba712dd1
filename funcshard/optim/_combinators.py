"""Transformations of optimizers: `chain` runs them in order, `masked` applies one where a
mask holds (as optax.masked), `skip_nonfinite` skips a step on every rank when any gradient
holds NaN or inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from funcshard.optim._base import Optimizer, _state_record
from funcshard.optim._params import _grad_leaves, _like
from funcshard.optim._segments import Where, segments
from funcshard.step import _finite as finite


@dataclass(frozen=True, eq=False)
class ChainState:
    """The states of chained transformations, in order."""

    states: tuple[Any, ...]


@dataclass(frozen=True, eq=False)
class SkipState:
    """The wrapped optimizer's state and how many steps were skipped for NaN or inf."""

    inner: Any
    skipped: Tensor


_state_record(ChainState, ("states",))
_state_record(SkipState, ("inner", "skipped"))


def chain(*optimizers: Optimizer) -> Optimizer:
    """Apply transformations in order, each to the updates of the one before."""

    def init(params: Any) -> ChainState:
        return ChainState(states=tuple(o.init(params) for o in optimizers))

    def update_each(grads: Any, states: tuple, params: Any, donate: bool) -> tuple[Any, tuple]:
        """Run the first len(states) transformations in order, each on the last's output."""
        new_states = []
        for optimizer, inner in zip(optimizers, states, strict=False):
            grads, inner = optimizer.update(grads, inner, params, donate=donate)
            new_states.append(inner)
        return grads, tuple(new_states)

    def update(
        grads: Any, state: ChainState, params: Any, donate: bool = False
    ) -> tuple[Any, ChainState]:
        grads, new_states = update_each(grads, state.states, params, donate)
        return grads, ChainState(states=new_states)

    def fused_step(grads: Any, state: ChainState, params: Any) -> tuple[Any, ChainState]:
        *first, last = state.states
        transformed, new_states = update_each(grads, tuple(first), params, donate=True)
        params, last = optimizers[-1].step(transformed, last, params)
        return params, ChainState(states=(*new_states, last))

    skips = any(o.skips_nonfinite for o in optimizers)  # a skip_nonfinite inside decides
    return Optimizer(init, update, fused_step if optimizers else None, skips_nonfinite=skips)


def masked(optimizer: Optimizer, where: Where) -> Optimizer:
    """Apply `optimizer` only where `where` holds (a predicate `(fqn, param) -> bool` or a
    dict FQN -> bool); elsewhere the incoming updates pass through unchanged, as
    `optax.masked`. On flat shards the mask is per element, built once from the layout.

    The wrapped optimizer sees every leaf (its state covers the masked-out elements too, as
    a flat shard cannot leave them out) and never a donation, since the incoming updates
    must survive it."""

    def update(grads: Any, state: Any, params: Any, donate: bool = False) -> tuple[Any, Any]:
        where_of = segments(params).mask(where)
        inner_updates, new_state = optimizer.update(grads, state, params, donate=False)
        chosen = [
            _chosen(w, u, g)
            for w, u, g in zip(
                where_of, _grad_leaves(inner_updates), _grad_leaves(grads), strict=True
            )
        ]
        return _like(grads, chosen, donate), new_state

    return Optimizer(optimizer.init, update, skips_nonfinite=optimizer.skips_nonfinite)


def _chosen(where: bool | Tensor, then: Tensor | None, otherwise: Tensor | None) -> Any:
    """`then` where `where` holds, else `otherwise` (a None operand counts as zero)."""
    if where is True or (otherwise is None and then is None):
        return then
    if where is False:
        return otherwise
    if then is None:
        assert otherwise is not None  # not both None: returned above
        return torch.where(where, 0, otherwise)
    return torch.where(where, then, 0 if otherwise is None else otherwise)


def skip_nonfinite(optimizer: Optimizer) -> Optimizer:
    """Skip the step on every rank when any rank's loss or gradients hold NaN or inf.

    A skipped step returns None updates (the parameters stay as they are) and the wrapped
    state untouched, and counts itself in `opt_state.skipped`. All ranks decide together
    (see funcshard/step/_finite.py), so replicas never diverge, without the warning and
    without the limit on skips in a row of the default (`value_and_grad(check_finite="skip")`).
    Communicates nothing when the gradients carry that default's verdict; else one
    all-reduce of one integer per step.
    """

    def init(params: Any) -> SkipState:
        return SkipState(inner=optimizer.init(params), skipped=torch.zeros((), dtype=torch.int64))

    def update(
        grads: Any, state: SkipState, params: Any, donate: bool = False
    ) -> tuple[Any, SkipState]:
        if finite.any_nonfinite(grads):
            nothing = _like(grads, [None] * len(_grad_leaves(grads)))
            return nothing, SkipState(inner=state.inner, skipped=state.skipped + 1)
        updates, inner = optimizer.update(grads, state.inner, params, donate=donate)
        return updates, SkipState(inner=inner, skipped=state.skipped)

    def fused_step(grads: Any, state: SkipState, params: Any) -> tuple[Any, SkipState]:
        if finite.any_nonfinite(grads):
            return params, SkipState(inner=state.inner, skipped=state.skipped + 1)
        params, inner = optimizer.step(grads, state.inner, params)
        return params, SkipState(inner=inner, skipped=state.skipped)

    return Optimizer(init, update, fused_step, skips_nonfinite=True)
