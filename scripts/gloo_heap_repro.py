"""torch's gloo backend corrupting the heap or hanging, without funcshard: the reproduction.

    python scripts/gloo_heap_repro.py [--world 4] [--seconds 30] [--api functional|c10d]

Each rank issues the same seeded stream of collectives of mixed sizes (all-gather, in-place
all-reduce, reduce-scatter, a 3-element int64 all-gather), keeps one to three in flight and
waits for them in issue order, as funcshard does. With `--api functional` (torch's
`_c10d_functional` ops, what torch.compile and funcshard's traced steps issue) a rank now and
then dies inside `wait_tensor`: glibc's "malloc(): unaligned tcache chunk detected", or a
segmentation fault. The same stream through torch.distributed's own async API (`--api c10d`,
each Work held until waited, what funcshard's eager steps use on gloo) did not crash.
Measured 2026-11-26 on 2 cores with torch 2.13.0, 4 ranks, the two APIs alternating:
10 pairs of 30 s runs on an idle machine, functional 3 crashes (2 tcache, 1 segmentation
fault) in 10 runs, c10d 0 in 10 (about 85,000 collectives); 20 pairs of 10 s runs beside
a stress run, neither crashed. Measured 2026-11-26 on a lent 16-core machine with torch
2.11.0, 8 copies at once, each pinned to its own 2 cores (`taskset`), 4 ranks each, 75 s
allowed per 30 s run (scripts/gloo_heap_pairs.sh): functional 2 runs hung (every rank
alive, no collective completing) and 1 died of a segmentation fault in `wait_tensor`, in 22
runs; c10d 0 of 24. A hang is the other face of the same bug: issue 20's soak hang, where
both ranks waited in `wait_tensor` on collectives they had issued alike, ran on the
functional ops.

A rank that has not finished `--hang-after` seconds after it started (default: twice
`--seconds`, plus 15) prints every thread's stack and exits with status 1: a hang is
reported, not waited out. Exit status: 0 when every rank finished.
"""

from __future__ import annotations

import argparse
import faulthandler
import random
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_ops = torch.ops._c10d_functional
SIZES = (1, 3, 8, 17, 64, 683, 4096, 50000)


def _issue_functional(kind: int, size: int, world: int, name: str) -> torch.Tensor:
    if kind == 0:
        return _ops.all_gather_into_tensor(torch.randn(size), world, name)
    if kind == 1:
        return _ops.all_reduce_(torch.randn(size * world), "avg", name)
    if kind == 2:
        return _ops.all_gather_into_tensor(torch.randint(0, 9, (3,)), world, name)
    return _ops.reduce_scatter_tensor(torch.randn(size * world), "avg", world, name)


def _issue_c10d(kind: int, size: int, world: int, group: dist.ProcessGroup) -> tuple:
    if kind in (0, 2):
        shard = torch.randn(size) if kind == 0 else torch.randint(0, 9, (3,))
        out = shard.new_empty(shard.numel() * world)
        return dist.all_gather_into_tensor(out, shard, group=group, async_op=True), out
    if kind == 1:
        out = torch.randn(size * world)
        return dist.all_reduce(out, group=group, async_op=True), out
    out = torch.empty(size)
    work = dist.reduce_scatter_tensor(out, torch.randn(size * world), group=group, async_op=True)
    return work, out


def _wait(handle: torch.Tensor | tuple) -> torch.Tensor:
    if isinstance(handle, tuple):
        work, out = handle
        work.wait()
        return out
    return _ops.wait_tensor(handle)


def _rank(rank: int, world: int, port: int, seconds: float, api: str, hang_after: float) -> None:
    faulthandler.enable(all_threads=True)
    faulthandler.dump_traceback_later(hang_after, exit=True)  # a hang: stacks, then exit
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    group = dist.group.WORLD
    draw = random.Random(0)  # the same stream of collectives on every rank
    end, issued, in_flight = time.time() + seconds, 0, []
    while True:
        if issued % 50 == 0:  # stop together
            go = torch.tensor([int(time.time() < end)])
            if _ops.wait_tensor(_ops.all_reduce(go, "min", group.group_name)).item() == 0:
                break
        kind, size = draw.randrange(4), draw.choice(SIZES)
        if api == "functional":
            in_flight.append(_issue_functional(kind, size, world, group.group_name))
        else:
            in_flight.append(_issue_c10d(kind, size, world, group))
        while len(in_flight) > draw.randrange(1, 4):
            _wait(in_flight.pop(0)).sum().item()
        issued += 1
    for handle in in_flight:
        _wait(handle)
    if rank == 0:
        print(f"{issued} collectives on {world} ranks, {api} API: no crash", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--api", choices=("functional", "c10d"), default="functional")
    parser.add_argument("--hang-after", type=float, help="seconds; default 2 x --seconds + 15")
    args = parser.parse_args()
    hang_after = 2 * args.seconds + 15 if args.hang_after is None else args.hang_after
    mp.spawn(
        _rank,
        args=(args.world, _free_port(), args.seconds, args.api, hang_after),
        nprocs=args.world,
    )


def _free_port() -> int:
    """A port nobody listens on now (several copies of this script may run at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
