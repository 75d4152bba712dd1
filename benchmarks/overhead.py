"""Framework overhead per training step: funcshard vs FSDP2 vs plain PyTorch, one process.

    python -m benchmarks.overhead [--blocks 32] [--world-size 8] [--repeats 30]

torch's "fake" process group plays rank 0 of `world_size` ranks: collectives cost nothing, so
what remains above the plain single-process step (same local batch, same AdamW) is each
framework's own CPU work per step. `python -m benchmarks` runs this at several block counts,
each in a fresh process (the fake group is the process's default group).
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import funcshard as fs
from benchmarks.common import (
    FSDP2,
    FUNCSHARD,
    PLAIN,
    fsdp2_step,
    funcshard_step,
    interleaved_medians,
    ms,
    plain_step,
    ratio,
)
from funcshard.testing.models import GPT, GPTConfig, random_tokens


@dataclass(frozen=True)
class OverheadSpec:
    """One overhead measurement: a GPT of `blocks` blocks (d=64) on a fake group."""

    blocks: int = 32
    world_size: int = 8
    repeats: int = 30  # interleaved rounds the medians are taken over
    warmup: int = 3
    batch: int = 1  # sequences per rank: tiny, so per-step framework work dominates
    seq: int = 16

    def describe(self) -> str:
        return (
            f"{self.blocks} blocks (d=64), batch {self.batch}x{self.seq} tokens per rank, fake "
            f"group of {self.world_size}, median of {self.repeats} interleaved rounds"
        )


def measure(spec: OverheadSpec) -> dict[str, float]:
    """Median seconds per step of each contender; needs a fake default process group."""
    cfg = GPTConfig(vocab_size=256, block_size=spec.seq, n_layer=spec.blocks, n_head=2, d_model=64)
    x, y = random_tokens(cfg, batch=spec.batch, seed=0)
    torch.manual_seed(0)
    model = GPT(cfg)
    steps = {
        PLAIN: plain_step(copy.deepcopy(model), x, y),
        FUNCSHARD: funcshard_step(cfg, fs.Mesh(shard=spec.world_size), x, y),
        FSDP2: fsdp2_step(copy.deepcopy(model), init_device_mesh("cpu", (spec.world_size,)), x, y),
    }
    return interleaved_medians(steps, warmup=spec.warmup, rounds=spec.repeats)


def measure_in_fake_group(spec: OverheadSpec) -> dict[str, float]:
    """`measure` inside a fake process group of `spec.world_size` that this call owns."""
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=spec.world_size)
    try:
        return measure(spec)
    finally:
        dist.destroy_process_group()


def measure_in_subprocess(spec: OverheadSpec) -> dict[str, float]:
    """`measure_in_fake_group` in a fresh spawned process.

    The fake group is the process's default group, so it must not share a process with gloo
    runs; a fresh process per spec also keeps one size's allocator and caches from the next.
    """
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure_in_fake_group, (spec,))


def table(times: dict[str, float], fmt: str = "simple") -> str:
    """Milliseconds per step and the ratio to plain PyTorch, one row per contender."""
    rows = [[name, ms(t), ratio(t, times[PLAIN])] for name, t in times.items()]
    return tabulate(rows, headers=["step", "ms", "vs plain"], tablefmt=fmt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=OverheadSpec.blocks)
    parser.add_argument("--world-size", type=int, default=OverheadSpec.world_size)
    parser.add_argument("--repeats", type=int, default=OverheadSpec.repeats)
    parser.add_argument("--batch", type=int, default=OverheadSpec.batch)
    parser.add_argument("--seq", type=int, default=OverheadSpec.seq)
    args = parser.parse_args()
    spec = OverheadSpec(args.blocks, args.world_size, args.repeats, batch=args.batch, seq=args.seq)
    times = measure_in_fake_group(spec)
    print(spec.describe())
    print(table(times))
    print(f"FSDP2 / funcshard: {ratio(times[FSDP2], times[FUNCSHARD])}")


if __name__ == "__main__":
    main()
