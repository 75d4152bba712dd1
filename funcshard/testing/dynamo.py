"""Compile inside a pooled worker without leaving anything behind for the next call.

Workers of `funcshard.testing.run` outlive each call, so what torch.compile keeps (compiled
graphs, fake tensors, dynamo's counters and config) would otherwise leak into whatever the
worker runs next: memory tests would count it, counters would add up across tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from funcshard.testing import collector

F = TypeVar("F", bound=Callable[..., Any])


def isolated(trace_autograd_ops: bool = True) -> Callable[[F], F]:
    """Decorate a rank function so it starts with dynamo reset and counters at zero, runs
    with `torch._dynamo.config.trace_autograd_ops` as given, and leaves dynamo reset.

    The decorated function keeps its name, so it still pickles by reference for `run`."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            import torch._dynamo

            if _compiled_since_reset():
                _reset()
            try:
                with torch._dynamo.config.patch(trace_autograd_ops=trace_autograd_ops):
                    return fn(*args, **kwargs)
            finally:
                _reset()

        return wrapped  # type: ignore[return-value]

    return decorate


def _compiled_since_reset() -> bool:
    """Whether dynamo ran since the last reset: its counters are cleared by `_reset` and count
    every frame it compiles. Most calls follow an isolated one, so the reset before them, and
    its garbage collection, is skipped."""
    return any(torch._dynamo.utils.counters.values())


def _reset() -> None:
    """Reset dynamo and collect; in a pool worker, freeze what is left, so the next reset's
    collection walks only what was made since (see [Note: a worker's long-lived objects are
    frozen])."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    collector.collect()
