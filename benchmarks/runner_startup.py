"""How long `funcshard.testing.run` takes on a fresh pool and on a reused one (world size 2).

    python benchmarks/runner_startup.py

A fresh spawn of two gloo processes (what torch.multiprocessing.spawn does per test) is timed
alongside, for comparison.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from tabulate import tabulate

from funcshard import testing
from funcshard.testing.pool import WorkerPool

REPEATS = 20


def one_all_reduce(rank: int) -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    first = timed(lambda: testing.run(one_all_reduce, world_size=2))
    reused = [timed(lambda: testing.run(one_all_reduce, world_size=2)) for _ in range(REPEATS)]

    def fresh_spawn() -> None:
        pool = WorkerPool(2, start_method="spawn")
        pool.run(one_all_reduce, timeout=60)
        pool.close()

    spawn = [timed(fresh_spawn) for _ in range(3)]
    rows = [
        ["first call (starts forkserver + pool)", f"{first:.3f}", 1],
        [
            f"second call, pool reused (median of {REPEATS})",
            f"{statistics.median(reused):.4f}",
            REPEATS,
        ],
        ["fresh spawn of 2 gloo ranks (median of 3)", f"{statistics.median(spawn):.3f}", 3],
    ]
    print(tabulate(rows, headers=["testing.run, world size 2", "seconds", "runs"]))
    ratio = statistics.median(spawn) / statistics.median(reused)
    print(f"\nreused pool vs fresh spawn: {ratio:.0f}x faster")


if __name__ == "__main__":
    main()
