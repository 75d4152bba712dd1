"""Refuse a module recomputed after `funcshard.call` returned (activation checkpointing).

[Note: recomputation after funcshard.call]
`funcshard.call` puts the state's (or the dict's) tensors into a module only while the call
runs, and puts the module's own back when it returns. Activation checkpointing
(`torch.utils.checkpoint`) runs a module's forward again during backward, which comes after
the call returned, so the recomputed activations would come from the module's own weights
and the gradients would be silently wrong (on a meta-built model, an obscure meta-device
error). Until recomputation is supported, `value_and_grad` watches, during its backward,
every module that a differentiated call ran: one running again outside any
`funcshard.call` raises. A recomputation that itself goes through `funcshard.call` (a
checkpointed function calling `fs.call(block, params, h)`) puts the right tensors in place
and is allowed.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

_RAN: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar(
    "funcshard_modules_ran", default=None
)
_INSIDE: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "funcshard_modules_inside_call", default=frozenset()
)


@contextlib.contextmanager
def calling(module_ids: frozenset[int]) -> Iterator[None]:
    """Mark these modules as running inside a funcshard.call (for the watched backward).
    Nothing to mark while dynamo traces: recomputation happens inside the traced graph."""
    if torch.compiler.is_dynamo_compiling():
        yield
        return
    ran = _RAN.get()
    if ran is not None:
        ran.update(module_ids)
    token = _INSIDE.set(_INSIDE.get() | module_ids)
    try:
        yield
    finally:
        _INSIDE.reset(token)


def refuse_reentrant_checkpoint(where: str) -> None:
    """Raise if a reentrant torch.utils.checkpoint is running this call without grad.

    `checkpoint(..., use_reentrant=True)` runs its function under no_grad and recomputes it in
    a backward of its own, where no gradients of a sharded state are recorded: the state's
    gradients through it would silently be zero. Only looked up on that rare path (a call
    under a recorder with grad disabled), so the stack walk costs nothing otherwise.
    """
    target = torch.utils.checkpoint.CheckpointFunction.forward.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is target:
            raise RuntimeError(
                f"funcshard.{where}: torch.utils.checkpoint(..., use_reentrant=True) around a "
                f"call on a sharded state would give its parameters no gradients (the "
                f"reentrant variant recomputes in a backward of its own). Pass "
                f"use_reentrant=False."
            )
        frame = frame.f_back


@contextlib.contextmanager
def recording() -> Iterator[set[int]]:
    """Collect the modules that differentiated calls run inside the block."""
    token = _RAN.set(set())
    try:
        yield _RAN.get()
    finally:
        _RAN.reset(token)


@contextlib.contextmanager
def refused(ran: set[int]) -> Iterator[None]:
    """During the block (a backward pass), running any of `ran` outside a call raises."""
    if not ran:
        yield
        return

    def check(module: nn.Module, args: object) -> None:
        if id(module) in ran and id(module) not in _INSIDE.get():
            raise RuntimeError(
                f"funcshard.value_and_grad: a {type(module).__name__} ran again during "
                f"backward, after funcshard.call had returned (activation checkpointing "
                f"recomputes it then). It would read the module's own parameters instead of "
                f"the state's and give wrong gradients. Recomputing inside funcshard.call is "
                f"not supported yet: drop checkpointing from modules run through it, or, with "
                f"a params dict, checkpoint a function that itself calls "
                f"funcshard.call(submodule, params, ...)."
            )

    handle = register_module_forward_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()
