"""What publishing progress costs per collective (funcshard/comm/_progress.py).

    python -m benchmarks.progress [--calls 20000]

On torch's fake process group (collectives cost nothing) it times an eager funcshard
all-reduce, issue and wait, and, apart, the Python that progress adds to each collective:
the check that the writer is running in `_before` and the two writes around a wait. The
writer thread itself runs once a second, off the collective's path.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from funcshard.comm import _collectives as collectives
from funcshard.comm import _progress as progress


def _added(calls: int) -> float:
    """Seconds per collective of what progress adds: one check, two writes."""
    here = progress.Here

    def hooks() -> None:
        if here.store is None:
            pass
        here.waiting = ("all_reduce", None)
        here.waiting = None

    return min(timeit.repeat(hooks, number=calls, repeat=5)) / calls


def _collective(calls: int) -> float:
    """Median seconds of an eager all-reduce of one element, issued and waited."""
    group = dist.group.WORLD
    x = torch.ones(1)

    def one() -> None:
        collectives.all_reduce(x, group, "sum").wait()

    one()
    rounds = [timeit.timeit(one, number=calls // 10) / (calls // 10) for _ in range(10)]
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        total, added = _collective(args.calls), _added(args.calls)
        print(f"eager all-reduce on a fake group of 8, issue + wait: {total * 1e6:.2f} us")
        print(f"of which progress's per-collective Python: {added * 1e6:.3f} us")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
