"""Run a function on every rank of a pool of worker processes that outlives the call.

`run` keeps one pool per world size and backend (see [Note: the worker pool] in
funcshard/testing/pool.py), recycles one that failed, and caps its timeout below the running
test's pytest-timeout, so that the pool's report of a hang is what fails the test.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable
from typing import TypeVar

from funcshard.testing.pool import WorkerPool
from funcshard.testing.rank_errors import RankDied
from funcshard.testing.worker import check_main_can_be_rerun

T = TypeVar("T")


def run(
    fn: Callable[[int], T],
    world_size: int = 2,
    backend: str = "gloo",
    timeout: float = 60.0,
    fresh: bool = False,
) -> list[T]:
    """Run `fn(rank)` on every rank of a `world_size` process group; return the results by rank.

    `fn` must pickle by reference (a module-level function, or `functools.partial` of one with
    picklable arguments). Draw hypothesis examples in the caller and bind them with partial, so
    every rank sees the same example. A rank's exception is re-raised here with its rank and
    remote traceback, within `pool.ERROR_GRACE` seconds even while other ranks wait for it (their
    stacks become a note on it and the pool is recycled); a hang past `timeout` seconds raises
    TimeoutError naming the ranks that did not finish, where each was waiting and the last
    collective each issued. Under pytest with pytest-timeout, `timeout` is capped to end a few
    seconds before the test's, so this report is what fails a hung test (see
    funcshard/testing/pytest_plugin.py).

    A task that leaves a rank's process-wide state changed (default dtype, grad mode, a mode
    on torch's stacks, an environment variable, ...) fails with `ProcessStateChanged` naming
    the change, and the ranks are replaced, so a later call never inherits it.

    `fresh=True` runs on ranks of their own, ended afterwards: for tests that break process
    groups on purpose (timeouts, faults) and must not leave them to later calls.
    """
    if world_size < 1:
        raise ValueError(f"testing.run: world_size must be at least 1, got {world_size}.")
    check_main_can_be_rerun()
    timeout = _within_test_deadline(timeout)
    if fresh:
        own = WorkerPool(world_size, backend)
        try:
            return own.run(fn, timeout)
        finally:
            own.quit()
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is None or not pool.alive():
        pool = _POOLS[key] = WorkerPool(world_size, backend)
    try:
        return pool.run(fn, timeout)
    except (TimeoutError, RankDied):
        _POOLS.pop(key, None)
        raise
    except BaseException:
        if not pool.alive():
            _POOLS.pop(key, None)
        raise


DEADLINE: float | None = None  # when the running test's pytest-timeout fires (pytest_plugin)
DEADLINE_MARGIN = 5.0  # seconds left for the report: ask for the stacks, kill the pool


def _within_test_deadline(timeout: float) -> float:
    """`timeout`, capped to end `DEADLINE_MARGIN` seconds before the running test's
    pytest-timeout, so that the runner's report (every rank's stack and last collective)
    reaches the user instead of pytest-timeout's."""
    if DEADLINE is None:
        return timeout
    left = DEADLINE - time.monotonic() - DEADLINE_MARGIN
    return max(min(timeout, left), min(timeout, 1.0))


_POOLS: dict[tuple[int, str], WorkerPool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
