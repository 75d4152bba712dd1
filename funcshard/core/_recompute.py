"""Put a call's tensors back when backward recomputes one of its modules (activation
checkpointing).

[Note: recomputation after funcshard.call]
`funcshard.call` puts the state's (or the dict's) tensors into a module only while the call
runs, and puts the module's own back when it returns. Activation checkpointing
(`torch.utils.checkpoint`, non-reentrant) runs a module's forward again during backward,
after the call returned: left alone it would read the module's own weights and the
gradients would be silently wrong (on a meta-built model, an obscure meta-device error).

So every differentiated call registers a `Reentry`: how to put that call's tensors back
into its model, with the range of autograd sequence numbers of the nodes it created (when a
step calls one model twice, e.g. with other buffers, a recomputation belongs to the call
that created the backward node running it). During `value_and_grad`'s backward a global
module pre-hook watches: when a module of such a call starts outside any call, the call's
tensors go back in (for a sharded call: the units owning parameters under that module,
regathered if they were resharded, plus the state's replicated tensors and copies of its
buffers), and they come out again when that module's forward ends. A module nested in it
finds its tensors already in place (the call counts what it put in, so only the outermost
takes them out). The recomputed values equal the first forward's, so
the gradients are the ones an unchecked run gives. Recomputation that itself goes through
`funcshard.call` (a checkpointed function calling `fs.call(block, params, h)`) puts its
own tensors in place, as any call does. Not covered: a checkpointed function that reads a
parameter directly (not through a module's forward) starts no module, so it still reads the
module's own tensor.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from funcshard.comm import _chaos as chaos


class Reentry(Protocol):
    """How one finished call puts its tensors back into its model for a recomputation."""

    def enter(self, module: nn.Module) -> object:
        """Put the tensors `module`'s forward reads in place; return what `exit` needs."""

    def exit(self, token: object) -> None:
        """Put back what was in place before `enter`."""


@dataclass(frozen=True)
class _Call:
    """One differentiated call: its model's modules, the autograd sequence numbers of the
    nodes it created ([start, end)), and how to put its tensors back."""

    module_ids: frozenset[int]
    start: int
    end: int
    reentry: Reentry


_RAN: contextvars.ContextVar[list[_Call] | None] = contextvars.ContextVar(
    "funcshard_calls_ran", default=None
)
_INSIDE: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "funcshard_modules_inside_call", default=frozenset()
)


@contextlib.contextmanager
def calling(module_ids: frozenset[int], reentry: Reentry) -> Iterator[None]:
    """Mark these modules as running inside a funcshard.call, and (when value_and_grad is
    recording) remember how `reentry` puts this call's tensors back for a recomputation.
    Nothing to mark while dynamo traces: recomputation happens inside the traced graph."""
    if torch.compiler.is_dynamo_compiling():
        yield
        return
    ran = _RAN.get() if torch.is_grad_enabled() else None  # no graph, nothing to recompute
    start = torch._C._autograd._get_sequence_nr() if ran is not None else 0
    token = _INSIDE.set(_INSIDE.get() | module_ids)
    try:
        yield
    finally:
        _INSIDE.reset(token)
    if ran is not None:
        ran.append(_Call(module_ids, start, torch._C._autograd._get_sequence_nr(), reentry))


def refuse_reentrant_checkpoint(where: str, place: str = "around a call") -> None:
    """Raise if a reentrant torch.utils.checkpoint is running this call (or, inside one, a
    unit's module: `place` says which) without grad.

    `checkpoint(..., use_reentrant=True)` runs its function under no_grad and recomputes it in
    a backward of its own, which accumulates into `.grad` of the tensors it was given, not
    into the shards `value_and_grad` asks autograd about: the state's gradients through it
    would silently be zero. Only looked up on that rare path (a call inside value_and_grad
    with grad disabled), so the stack walk costs nothing otherwise.
    """
    target = torch.utils.checkpoint.CheckpointFunction.forward.__code__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is target:
            raise RuntimeError(
                f"funcshard.{where}: torch.utils.checkpoint(..., use_reentrant=True) {place} "
                f"on a sharded state would give its parameters no gradients (the "
                f"reentrant variant recomputes in a backward of its own). Pass "
                f"use_reentrant=False."
            )
        frame = frame.f_back


@contextlib.contextmanager
def recording() -> Iterator[list[_Call]]:
    """Collect the differentiated calls made inside the block (none while dynamo traces:
    recomputation then happens inside the traced graph)."""
    if torch.compiler.is_dynamo_compiling():
        yield []
        return
    ran: list[_Call] = []
    token = _RAN.set(ran)
    try:
        yield ran
    finally:
        _RAN.reset(token)


@contextlib.contextmanager
def recomputing(ran: list[_Call]) -> Iterator[None]:
    """During the block (a backward pass), a module of a call in `ran` that runs again
    outside any call gets that call's tensors back for the length of its forward."""
    if not ran:
        yield
        return
    entered: list[tuple[nn.Module, Reentry, object]] = []

    def before(module: nn.Module, args: object) -> None:
        chaos.point()
        if id(module) in _INSIDE.get():
            return
        calls = [c for c in ran if id(module) in c.module_ids]
        if calls:
            reentry = _the_call_recomputed(module, calls).reentry
            entered.append((module, reentry, reentry.enter(module)))

    def after(module: nn.Module, args: object, output: object) -> None:
        chaos.point()
        if entered and entered[-1][0] is module:
            _, reentry, token = entered.pop()
            reentry.exit(token)

    try:
        with around_every_module(before, after):
            yield
    finally:
        while entered:
            _, reentry, token = entered.pop()
            reentry.exit(token)


@contextlib.contextmanager
def around_every_module(
    before: Callable[[nn.Module, Any], None], after: Callable[[nn.Module, Any, Any], None]
) -> Iterator[None]:
    """Call `before(module, args)` and `after(module, args, output)` around every module's
    forward during the block (torch's global module hooks; `after` even when it raises)."""
    handles = (
        register_module_forward_pre_hook(before),
        register_module_forward_hook(after, always_call=True),
    )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _the_call_recomputed(module: nn.Module, calls: list[_Call]) -> _Call:
    """Of the calls that ran `module`, the one whose graph backward is in: autograd
    recomputes a checkpointed region while running one of the nodes it created."""
    if len(calls) == 1:
        return calls[0]
    node = torch._C._current_autograd_node()
    number = node._sequence_nr() if node is not None else -1
    found = [c for c in calls if c.start <= number < c.end]
    if len(found) != 1:
        raise RuntimeError(
            f"funcshard.value_and_grad: a {type(module).__name__} is recomputed in backward "
            f"(activation checkpointing) and {len(calls)} calls of its model ran in this "
            f"step; funcshard cannot tell which call's tensors it needs. Checkpoint a "
            f"function that itself calls funcshard.call, or call the model once per step."
        )
    return found[0]
