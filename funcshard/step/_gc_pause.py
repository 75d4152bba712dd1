"""Python's cyclic garbage collector paused while a step differentiates a sharded state.

[Note: no garbage collection inside a step]
Resharding after forward keeps autograd's saved tensors through a Python hook (see [Note:
resharding after forward]). So every saved tensor of a resharded call is a Python object that
lives from forward to backward: about two dozen per GPT block. Plain PyTorch keeps them in
C++.

CPython runs a young collection once the tracked objects allocated, minus those freed, since
the last collection pass a threshold (700 by default before Python 3.14). A step that holds
more new objects than that at once sets collections off in the middle of the step. Each
middle collection promotes what the step holds at that moment, which brings the next full
collection closer, and a full collection scans every object in the process.

Measured in the overhead benchmark (150 steps of 32 GPT blocks, in a process of 322,000
objects):
- without the pause: 277 young and 25 middle collections, 0.27 ms per step; a full
  collection there takes about 150 ms;
- plain PyTorch: none.

So `value_and_grad` on a state pauses the collector (`paused`) for its forward, its backward
and the reduces that end it. Nothing piles up for later: the hook's objects die by
reference counting as backward consumes them, and the collector's count falls back with
them. The cost is that garbage in reference cycles made during the step is freed after it,
not in the middle, which a step that makes much of it would see in its peak memory. Steps
make little: a finished step's graph is freed by reference counting
(tests/step/test_memory.py).

Not paused:
- a bare `torch.autograd.grad` over `fs.call`, whose backward runs outside any funcshard
  function;
- dict params (no resharding);
- compiled steps, which have no Python saved tensors.

torchtitan goes further for the same cost: it turns automatic collection off for the whole
run and collects every N steps.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def paused(fn: Callable[..., T], *args: Any) -> T:
    """Call `fn(*args)` with automatic garbage collection disabled, then enable it again.

    Does nothing if the collector was already disabled. The collector is enabled again after
    `fn` even when `fn` raised (or disabled it itself). While dynamo traces, `fn` runs as it
    is and outside any try block: a graph break inside one would make dynamo give up the
    whole frame."""
    if torch.compiler.is_dynamo_compiling() or not gc.isenabled():
        return fn(*args)
    gc.disable()
    try:
        return fn(*args)
    finally:
        gc.enable()
