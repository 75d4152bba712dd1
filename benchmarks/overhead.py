"""Framework overhead per training step: funcshard vs FSDP2 vs plain PyTorch, one process.

    python benchmarks/overhead.py [--blocks 32] [--world-size 8]

torch's "fake" process group plays rank 0 of `world_size` ranks: collectives cost nothing, so
what remains above the plain single-process step (same local batch, same AdamW) is each
framework's own CPU work per step.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import funcshard as fs
from benchmarks.common import fsdp2_step, funcshard_step, interleaved_medians, plain_step, tokens
from funcshard.testing.models import GPT, GPTConfig


def measure(blocks: int, world_size: int, repeats: int, batch: int, seq: int) -> dict[str, float]:
    cfg = GPTConfig(vocab_size=256, block_size=seq, n_layer=blocks, n_head=2, d_model=64)
    x, y = tokens(cfg, batch=batch, seed=0)
    torch.manual_seed(0)
    model = GPT(cfg)
    steps = {
        "plain PyTorch (1 process)": plain_step(copy.deepcopy(model), x, y),
        "funcshard": funcshard_step(cfg, fs.Mesh(shard=world_size), x, y),
        "FSDP2 fully_shard": fsdp2_step(
            copy.deepcopy(model), init_device_mesh("cpu", (world_size,)), x, y
        ),
    }
    return interleaved_medians(steps, warmup=3, rounds=repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    times = measure(args.blocks, args.world_size, args.repeats, args.batch, args.seq)
    plain = times["plain PyTorch (1 process)"]
    rows = [[name, f"{t * 1e3:.1f}", f"{t / plain:.2f}x"] for name, t in times.items()]
    print(
        f"{args.blocks} blocks (d=64), batch {args.batch}x{args.seq} tokens per rank, fake "
        f"group of {args.world_size}, median of {args.repeats} interleaved rounds"
    )
    print(tabulate(rows, headers=["step", "ms", "vs plain"]))
    print(f"FSDP2 / funcshard: {times['FSDP2 fully_shard'] / times['funcshard']:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
