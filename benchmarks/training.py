"""Real training on 2 gloo ranks: funcshard vs FSDP2 vs DDP vs plain PyTorch, side by side.

    python benchmarks/training.py [--world-size 2] [--rounds 8]

Each rank trains a ~14M-parameter GPT (vocab 8192, d 384, 6 blocks, tied embedding, AdamW)
on its own batch. Step times are medians over rounds that rotate through the frameworks;
peak live tensor memory is counted op by op (funcshard.testing.memory.LiveTensors) from
before each framework builds its state through three steps, parameters and optimizer
state included.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics

import torch
from tabulate import tabulate
from torch.distributed.device_mesh import init_device_mesh

import funcshard as fs
from benchmarks.common import (
    ddp_step,
    fsdp2_step,
    funcshard_step,
    interleaved_medians,
    plain_step,
    tokens,
)
from funcshard import testing
from funcshard.testing.memory import LiveTensors
from funcshard.testing.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=8192, block_size=64, n_layer=6, n_head=6, d_model=384)
BATCH = 2  # sequences per rank


def _builders(world: int, x: torch.Tensor, y: torch.Tensor, model: GPT) -> dict:
    """How each framework builds its step from the same initial model (or config)."""
    return {
        "funcshard": lambda: funcshard_step(CFG, fs.Mesh(shard=world), x, y, seed=0),
        "funcshard replicate": lambda: funcshard_step(
            CFG, fs.Mesh(replicate=world), x, y, replicate=True, seed=0
        ),
        "FSDP2": lambda: fsdp2_step(copy.deepcopy(model), init_device_mesh("cpu", (world,)), x, y),
        "DDP": lambda: ddp_step(copy.deepcopy(model), x, y),
        "plain (1 process)": lambda: plain_step(copy.deepcopy(model), x, y),
    }


def _rank(rounds: int, rank: int) -> dict:
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = tokens(CFG, BATCH, seed=rank)
    builders = _builders(world, x, y, model)
    peaks = {}
    for name, build in builders.items():
        with LiveTensors() as mode:  # from building (copying the model) through 3 steps
            step = build()
            for _ in range(3):
                step()
        peaks[name] = mode.peak
    steps = {name: build() for name, build in builders.items()}
    times = interleaved_medians(steps, warmup=2, rounds=rounds)
    return {"times": times, "peaks": peaks, "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    results = testing.run(
        functools.partial(_rank, args.rounds), world_size=args.world_size, timeout=3600
    )
    names = list(results[0]["times"])
    time_of = {n: statistics.mean(r["times"][n] for r in results) for n in names}
    peak_of = {n: max(r["peaks"][n] for r in results) for n in names}
    rows = [
        [
            n,
            f"{time_of[n] * 1e3:.0f}",
            f"{time_of[n] / time_of['FSDP2']:.2f}x",
            f"{time_of[n] / time_of['DDP']:.2f}x",
            f"{peak_of[n] / 2**20:.0f}",
            f"{peak_of[n] / peak_of['FSDP2']:.2f}x",
        ]
        for n in names
    ]
    print(
        f"GPT {results[0]['params'] / 1e6:.1f}M params, {args.world_size} gloo ranks, batch "
        f"{BATCH}x{CFG.block_size} per rank, median of {args.rounds} interleaved rounds"
    )
    headers = ["step", "ms", "vs FSDP2", "vs DDP", "peak MiB/rank", "vs FSDP2"]
    print(tabulate(rows, headers=headers))


if __name__ == "__main__":
    main()
