"""What `fs.deferred_init` costs: recording a constructor, replaying it into shards, and the
peak memory of that replay against the whole model's bytes.

    python -m benchmarks.deferred_init [--layers 8] [--d-model 384] [--world 2]

The model is the tests' GPT (funcshard/testing/models.py: torch layers, tied embedding and
head), built three ways in each rank of a `world`-rank gloo pool: on the CPU (the
constructor's own time), under `fs.deferred_init()` (the recording, which also runs every
random op once on a CPU scratch to keep the random stream), and then `fs.shard` of the
deferred model with each block a unit (the replay: every parameter rebuilt once on every
rank, sliced and dropped). Peak is `LiveTensors`' count around `fs.shard`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from tabulate import tabulate

import funcshard as fs
from funcshard import testing
from funcshard.testing.memory import LiveTensors
from funcshard.testing.models import GPT, Block, GPTConfig


def _one_rank(cfg: GPTConfig, world: int, rank: int) -> dict[str, float]:
    torch.manual_seed(0)
    start = time.perf_counter()
    cpu = GPT(cfg)
    built = time.perf_counter() - start
    torch.manual_seed(0)
    start = time.perf_counter()
    with fs.deferred_init():
        model = GPT(cfg)
    recorded = time.perf_counter() - start
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    mesh = fs.Mesh(shard=world)
    start = time.perf_counter()
    with LiveTensors() as live:
        state = fs.shard(model, plan, mesh)
    replayed = time.perf_counter() - start
    same = all(torch.equal(v, cpu.state_dict()[k]) for k, v in fs.unshard(state).items())
    return {
        "cpu_s": built,
        "record_s": recorded,
        "replay_s": replayed,
        "peak": live.peak,
        "local": sum(s.numel() * s.element_size() for s in state.shards),
        "largest": max(p.numel() * p.element_size() for p in cpu.parameters()),
        "whole": sum(p.numel() * p.element_size() for p in cpu.parameters()),
        "bitwise": float(same),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cfg = GPTConfig(vocab_size=8192, block_size=256, n_layer=args.layers, d_model=args.d_model)
    rounds = [
        testing.run(functools.partial(_one_rank, cfg, args.world), args.world)[0]
        for _ in range(args.rounds)
    ]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    mib = 2**20
    print(
        tabulate(
            [
                ["CPU constructor (s)", f"{med['cpu_s']:.3f}"],
                ["deferred_init record (s)", f"{med['record_s']:.3f}"],
                ["fs.shard replay, per rank (s)", f"{med['replay_s']:.3f}"],
                ["whole model (MiB)", f"{med['whole'] / mib:.2f}"],
                ["largest parameter (MiB)", f"{med['largest'] / mib:.2f}"],
                ["local shards (MiB)", f"{med['local'] / mib:.2f}"],
                ["peak while sharding (MiB)", f"{med['peak'] / mib:.2f}"],
                ["bitwise the CPU build", bool(med["bitwise"])],
            ],
            headers=[f"GPT {med['whole'] / 4 / 1e6:.1f}M params, {args.world} ranks", "median"],
        )
    )


if __name__ == "__main__":
    main()
