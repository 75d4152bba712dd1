"""Chaos for tests: random per-rank delays and garbage collections wherever funcshard issues or
waits on a collective, and in every autograd function and hook it installs.

[Note: chaos]
Whether every rank issues the same collectives in the same order must not depend on timing:
not on how long a rank's compute takes, nor on when Python's garbage collector runs (which
decides when objects die, when weak references clear and when an `id()` is reused). Chaos
makes those differ between ranks on purpose: at each `point`, a rank sleeps a random few
milliseconds and sometimes runs `gc.collect()`, drawn from a generator seeded by the seed and
the rank, so a failing run repeats. Tests turn it on with `funcshard.testing.chaos(seed)`, a
job with `FUNCSHARD_CHAOS=<seed>`; off, a point costs one global lookup. The saved-tensor
hooks of a resharding call, which run for every tensor autograd saves, get their points
only when chaos is on as the call starts (`at_point`): a chaos block must cover the call's
forward, not its backward alone.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from funcshard.comm import _process_groups as process_groups

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Chaos:
    """How much disorder to inject: the chance of a delay (up to `max_delay` seconds) and of
    a garbage collection at each point, drawn per rank from `seed`."""

    seed: int
    delay_chance: float = 0.3
    max_delay: float = 0.003
    gc_chance: float = 0.05
    points: int = 0  # how many points were hit (tests check that chaos ran)
    _rng: random.Random | None = field(default=None, repr=False)

    def hit(self) -> None:
        if self._rng is None:  # the rank is known only once the process group is up
            rank = process_groups.global_rank()
            self._rng = random.Random(f"{self.seed}/{rank}")
        self.points += 1
        rng = self._rng
        if rng.random() < self.gc_chance:
            gc.collect()
        if rng.random() < self.delay_chance:
            time.sleep(rng.random() * self.max_delay)


_active: Chaos | None = None


def point() -> None:
    """A place where timing may differ between ranks: under chaos, maybe wait or collect.
    Nothing while torch compiles: a traced read of `_active` would guard the graph on it
    (see [Note: bookkeeping outside compiled graphs] in comm/_collectives.py)."""
    if torch.compiler.is_compiling():
        return
    if _active is not None:
        _active.hit()


def active() -> bool:
    """Whether chaos is on (for hot paths that pick their functions once, see `at_point`)."""
    return _active is not None


def at_point(fn: Callable[[T], R]) -> Callable[[T], R]:
    """`fn` with a chaos `point` before each call."""

    def with_point(arg: T) -> R:
        point()
        return fn(arg)

    return with_point


@contextlib.contextmanager
def chaos(
    seed: int = 0, delay_chance: float = 0.3, max_delay: float = 0.003, gc_chance: float = 0.05
) -> Iterator[Chaos]:
    """Inject seeded per-rank delays and garbage collections inside the block (see [Note:
    chaos]): at each point, a sleep of up to `max_delay` seconds with `delay_chance`, and a
    `gc.collect()` with `gc_chance`."""
    global _active
    before, _active = _active, Chaos(seed, delay_chance, max_delay, gc_chance)
    try:
        yield _active
    finally:
        _active = before


def _from_environment() -> Chaos | None:
    seed = os.environ.get("FUNCSHARD_CHAOS")
    if not seed:
        return None
    if not seed.lstrip("-").isdigit():
        raise ValueError(
            f"FUNCSHARD_CHAOS must be an integer seed (e.g. FUNCSHARD_CHAOS=1), got {seed!r}."
        )
    return Chaos(int(seed))


_active = _from_environment()
