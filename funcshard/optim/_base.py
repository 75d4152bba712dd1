"""The Optimizer record: a pair of pure functions `(init, update)` (see [Note: optimizers] in
funcshard/optim/__init__.py), how a user's `update` is wrapped (it may ignore donation, it records
no autograd history unless the grads carry some), and optimizer state records: registered as
pytrees, and donated when an update reuses their memory.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from funcshard.core._groups import GroupView
from funcshard.core._state import ShardedGrads, donatable
from funcshard.core._state import donate as donate_record
from funcshard.core._tree import register_record
from funcshard.optim._leaves import with_leaves
from funcshard.optim._mixed_reduction import warning_on_mixed_reductions
from funcshard.optim._params import _grad_leaves, apply_updates
from funcshard.step import _finite as finite


@dataclass(frozen=True)
class Optimizer:
    """A gradient transformation: `init(params) -> state`, `update(grads, state, params)`.

    `step(grads, state, params) -> (new_params, new_state)` is update and `apply_updates` in
    one, donating all three inputs: the same numbers, without materializing the updates
    (Adam and AdamW run torch's fused kernel on the parameters themselves, as torch.optim
    does: three fewer passes over memory per step).
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]  # (grads, state, params, donate=False)
    fused_step: Callable[..., tuple[Any, Any] | None] | None = None  # None: not applicable
    skips_nonfinite: bool = False  # it decides on non-finite steps itself (skip_nonfinite)
    # its non-finite steps skipped in a row (see funcshard/step/_finite.py)
    _skips: finite.Skips = field(
        default_factory=finite.Skips, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        update = warning_on_mixed_reductions(_accepting_donate(self.update))
        update = _recording_only_through_grads(_donating_its_state(update))
        if self.skips_nonfinite:
            update = _claiming_the_verdict(update)
        else:
            update = _skipping_nonfinite_steps(update, self._skips)
        object.__setattr__(self, "update", update)

    def step(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        """Update and apply, donating `grads`, `state` and `params` (see the class)."""
        if self.skips_nonfinite:
            finite.claim(grads)
        else:
            skip = finite.skip_this_step(grads, self._skips)
            if isinstance(skip, Tensor):  # a compiled step: see finite.skip_this_step
                updates, new_state = self.update(grads, state, params, donate=False)
                new_state = finite.masked(skip, new_state, state)
                _donate_state(state, new_state, "Optimizer.step")
                updates = finite.masked_updates(skip, updates)
                return apply_updates(params, updates, donate=True), new_state
            if skip:
                return params, state
        if self.fused_step is not None:
            done = self.fused_step(grads, state, params)
            if done is not None:
                _donate_state(state, done[1], "Optimizer.step")
                return done
        updates, new_state = self.update(grads, state, params, donate=True)
        return apply_updates(params, updates, donate=True), new_state


def _skipping_nonfinite_steps(
    update: Callable[..., Any], skips: finite.Skips
) -> Callable[..., Any]:
    """`update` that leaves out a step whose gradients' verdict says some rank's loss or
    gradients were not finite: no updates, the state as it was (see [Note: non-finite steps
    skipped by default] in funcshard/step/_finite.py)."""
    if getattr(update, "_skips_nonfinite_steps", False):
        return update

    def wrapped(grads: Any, state: Any, params: Any, **kwargs: Any) -> Any:
        skip = finite.skip_this_step(grads, skips)
        if isinstance(skip, Tensor):  # a compiled step: see finite.skip_this_step
            updates, new_state = update(grads, state, params, **{**kwargs, "donate": False})
            return finite.masked_updates(skip, updates), finite.masked(skip, new_state, state)
        if skip:
            return with_leaves(grads, [None] * len(grads.leaves())), state
        return update(grads, state, params, **kwargs)

    wrapped = functools.wraps(update)(wrapped)
    wrapped._skips_nonfinite_steps = True  # type: ignore[attr-defined]
    return wrapped


def _claiming_the_verdict(update: Callable[..., Any]) -> Callable[..., Any]:
    """`update` of an optimizer with a `skip_nonfinite` inside: it decides on the gradients'
    verdict, so the optimizers it calls before reaching it do not warn or skip first."""

    def wrapped(grads: Any, state: Any, params: Any, **kwargs: Any) -> Any:
        finite.claim(grads)
        return update(grads, state, params, **kwargs)

    return functools.wraps(update)(wrapped)


def _accepting_donate(update: Callable[..., Any]) -> Callable[..., Any]:
    """A user's `update(grads, state, params)` that takes no `donate` as one that does (and
    ignores it: donation only permits reusing memory, it never changes the numbers)."""
    try:
        parameters = inspect.signature(update).parameters
    except (TypeError, ValueError):
        return update
    if "donate" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return update

    def wrapped(grads: Any, state: Any, params: Any, donate: bool = False) -> Any:
        return update(grads, state, params)

    return functools.wraps(update)(wrapped)


def _donating_its_state(update: Callable[..., Any]) -> Callable[..., Any]:
    """`update` that, called with donate=True, marks the state it was given as donated (its
    moments now hold the new state's numbers; see [Note: donation])."""
    if getattr(update, "_donates_its_state", False):
        return update

    def wrapped(grads: Any, state: Any, params: Any, **kwargs: Any) -> Any:
        updates, new_state = update(grads, state, params, **kwargs)
        if kwargs.get("donate"):
            _donate_state(state, new_state, "an optimizer update(donate=True)")
        return updates, new_state

    wrapped = functools.wraps(update)(wrapped)
    wrapped._donates_its_state = True  # type: ignore[attr-defined]
    return wrapped


def _donate_state(old: Any, new: Any, to: str) -> None:
    """Mark an optimizer state record donated, unless the update handed the same record
    back (a stateless transformation) or it is not one of funcshard's records."""
    if new is not old and hasattr(type(old), "_donated_fields"):
        donate_record(old, to)


def _recording_only_through_grads(update: Callable[..., Any]) -> Callable[..., Any]:
    """Run `update` without autograd recording, as torch.optim steps do, unless the grads
    carry history themselves (`create_graph`: a differentiable inner step, as in MAML); so
    weight decay on parameters that require grad builds no graph step after step."""
    if getattr(update, "_records_only_through_grads", False):
        return update

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        grads = args[0] if args else kwargs.get("grads")
        if not isinstance(grads, ShardedGrads | GroupView | Mapping):
            return update(*args, **kwargs)  # not ours to judge: recorded as written
        unpacked = grads.unpacked() if isinstance(grads, GroupView) else _grad_leaves(grads)
        if any(isinstance(g, Tensor) and g.requires_grad for g in unpacked):
            return update(*args, **kwargs)
        with torch.no_grad():
            return update(*args, **kwargs)

    wrapped = functools.wraps(update)(wrapped)
    wrapped._records_only_through_grads = True  # type: ignore[attr-defined]
    return wrapped


@dataclass(frozen=True)
class EmptyState:
    """The state of a stateless transformation."""


def _state_record(cls: type, data_fields: tuple[str, ...]) -> None:
    """Register an optimizer state record: a pytree whose tensors are `data_fields`, which a
    donating update replaces by placeholders."""
    register_record(cls, data_fields=data_fields, meta_fields=())
    donatable(cls, data_fields)


register_record(EmptyState, data_fields=(), meta_fields=())
