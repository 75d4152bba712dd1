"""Python's cyclic garbage collector paused while a step differentiates a sharded state.

[Note: no garbage collection inside a step]
Resharding after forward keeps autograd's saved tensors through a Python hook (see [Note:
resharding after forward]), so every saved tensor of a resharded call is a Python object
that lives from forward to backward: about two dozen per unit of a GPT block. Plain PyTorch
keeps them in C++. Once more than 700 tracked objects are alive at once, the collector runs
a young collection in the middle of the step. Their survivors are promoted, and every few
dozen steps that brings a full collection, which scans every object in the process: in the
overhead benchmark (32 GPT blocks, 322,000 objects) about 150 ms every 20 steps, 7.7 ms per
step on average and 0.03-0.06 ms per block on the median, against none for plain PyTorch.

So `value_and_grad` pauses the collector (`paused`) from its forward to the end of its
backward. Nothing is left over for later: those objects die by reference counting as
backward consumes them, and the collector's allocation count falls back with them. Garbage
in cycles made meanwhile waits for the next collection after the step, as it would wait for
the next threshold anyway. torchtitan goes further for the same cost: it
turns automatic collection off for the whole run and collects every N steps. This pause
covers only the step, and restores the collector's previous state.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def paused(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` with automatic garbage collection disabled, if it was enabled; the
    collector's state restored after, also when `fn` raises. While dynamo traces, `fn`
    runs as it is (a compiled step keeps no Python saved tensors), and outside any try
    block: a graph break inside one would make dynamo give up the whole frame."""
    if torch.compiler.is_dynamo_compiling() or not gc.isenabled():
        return fn(*args)
    gc.disable()
    try:
        return fn(*args)
    finally:
        gc.enable()
