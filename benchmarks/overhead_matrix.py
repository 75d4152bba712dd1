"""Framework overhead per block on a matrix of shapes: funcshard vs FSDP2 (or DDP) vs plain.

    python -m benchmarks.overhead_matrix [--rounds 15] [--blocks 32] [--only MLP]
    python -m benchmarks.overhead_matrix --profile MLP,FSDP,8   # cProfile, per unit

One process plays rank 0 of a fake process group of 8 (torch's "fake" backend: collectives
cost nothing), so a step's time above the plain single-process step on the same local batch
is each framework's own CPU work. Each cell of the matrix (model x mesh x local batch x
torch threads) times plain PyTorch, FSDP2 (`fully_shard` per block and root; DDP for the DDP
row) and funcshard's two optimizer paths (`opt.update` + `apply_updates`, and the fused
`opt.step`) in rotation, and quotes medians. "Per block" is the time above plain divided by
the number of blocks, whatever the framework's buckets. Every contender uses AdamW.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import funcshard as fs
from benchmarks.common import (
    DDP,
    FSDP2,
    PLAIN,
    ddp_step,
    fsdp2_step,
    interleaved_samples,
    lm_loss,
    plain_step,
    sharded_step,
)
from funcshard.testing.models import GPT, Block, GPTConfig, MLPBlock, MLPStack, MLPStackConfig

UPDATE = "funcshard update+apply"
STEP = "funcshard opt.step"
WORLD = 8
MESHES = {"FSDP": (1, 8), "HSDP 2x4": (2, 4), "DDP": (8, 1)}  # (replicate, shard)
GOAL_MS_PER_BLOCK = 0.15
GOAL_RATIO = 10.0


@dataclass(frozen=True)
class Cell:
    """One point of the matrix."""

    model: str  # "GPT" | "MLP"
    mesh: str  # a key of MESHES
    batch: int  # local rows (sequences of 16 tokens for the GPT)
    threads: int
    blocks: int = 32
    d_model: int = 64


@dataclass(frozen=True)
class Timing:
    """A cell's step times per contender: medians and interquartile ranges, in seconds."""

    cell: Cell
    median: dict[str, float]
    iqr: dict[str, float]

    @property
    def baseline(self) -> str:
        return DDP if self.cell.mesh == "DDP" else FSDP2

    def per_block(self, name: str) -> float:
        """Seconds above plain per step, per block."""
        return (self.median[name] - self.median[PLAIN]) / self.cell.blocks

    def met(self) -> bool:
        """funcshard at most GOAL_MS_PER_BLOCK per block on both paths, and FSDP2's overhead at
        least GOAL_RATIO times funcshard's (at most DDP's, for the DDP row)."""
        ours = max(self.per_block(UPDATE), self.per_block(STEP))
        theirs = self.per_block(self.baseline)
        if ours * 1e3 > GOAL_MS_PER_BLOCK:
            return False
        if self.baseline == DDP:
            return ours <= theirs
        return ours <= 0 or theirs / ours >= GOAL_RATIO


def _model_and_batch(cell: Cell) -> tuple[nn.Module, type[nn.Module], Callable, tuple]:
    """A seeded model of the cell's kind, its unit class, its loss and a random batch."""
    torch.manual_seed(0)
    if cell.model == "GPT":
        cfg = GPTConfig(
            vocab_size=256, block_size=16, n_layer=cell.blocks, n_head=2, d_model=cell.d_model
        )
        tokens = torch.randint(cfg.vocab_size, (cell.batch, cfg.block_size + 1))
        return GPT(cfg), Block, lm_loss, (tokens[:, :-1], tokens[:, 1:])
    cfg = MLPStackConfig(d_model=cell.d_model, n_layer=cell.blocks)
    rows = (torch.randn(cell.batch, cfg.d_model), torch.randn(cell.batch, cfg.d_model))
    return MLPStack(cfg), MLPBlock, F.mse_loss, rows


def _steps(cell: Cell) -> dict[str, Callable[[], None]]:
    model, unit, loss, (x, y) = _model_and_batch(cell)
    replicate, shard = MESHES[cell.mesh]
    mesh = fs.Mesh(replicate=replicate, shard=shard)
    config = model.cfg

    def build() -> nn.Module:
        return type(model)(config)

    ddp = cell.mesh == "DDP"
    steps = {PLAIN: plain_step(copy.deepcopy(model), x, y, loss)}
    if ddp:
        steps[DDP] = ddp_step(copy.deepcopy(model), x, y, loss, comm_hook=_fake_group_all_reduce)
    else:
        names = ("replicate", "shard") if replicate > 1 else ("shard",)
        shape = (replicate, shard) if replicate > 1 else (shard,)
        device_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        steps[FSDP2] = fsdp2_step(copy.deepcopy(model), device_mesh, x, y, loss)
    for name, fused in ((UPDATE, False), (STEP, True)):
        steps[name] = sharded_step(build, unit, mesh, x, y, loss, replicate=ddp, fused=fused)
    return steps


def _fake_group_all_reduce(_, bucket):  # DDP checks the annotations; this module's are strings
    """DDP's mean all-reduce of a bucket as a Python comm hook: the fake group's Work
    completes its future with None where DDP's built-in path expects the tensor. One call
    per bucket (two here), not per block."""
    buffer = bucket.buffer().div_(WORLD)
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda _: buffer)


def measure(cell: Cell, rounds: int, warmup: int = 3) -> Timing:
    """Time one cell; needs a fake default process group of WORLD ranks."""
    torch.set_num_threads(cell.threads)
    samples = interleaved_samples(_steps(cell), warmup=warmup, rounds=rounds, settle=1)
    median = {name: statistics.median(t) for name, t in samples.items()}
    iqr = {name: _iqr(t) for name, t in samples.items()}
    return Timing(cell, median, iqr)


def _iqr(times: list[float]) -> float:
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4)
    return q3 - q1


def matrix(models: tuple[str, ...], blocks: int) -> list[Cell]:
    return [
        Cell(model, mesh, batch, threads, blocks)
        for model in models
        for mesh in MESHES
        for batch in (1, 8)
        for threads in (1, 2)
    ]


def table(timings: list[Timing], fmt: str = "github") -> str:
    """One row per cell: medians (ms), ms per block above plain, the ratio and the verdict."""
    rows = []
    for t in timings:
        c, base = t.cell, t.baseline
        ours = max(t.per_block(UPDATE), t.per_block(STEP))
        theirs = t.per_block(base)
        rows.append(
            [
                c.model,
                c.mesh,
                c.batch,
                c.threads,
                _ms(t.median[PLAIN]),
                f"{base} {_ms(t.median[base])}",
                _ms(t.median[UPDATE]),
                _ms(t.median[STEP]),
                _ms(t.iqr[STEP]),
                _per_block(t.per_block(UPDATE)),
                _per_block(t.per_block(STEP)),
                _per_block(theirs),
                _ratio(theirs, ours, base),
                "yes" if t.met() else "NO",
            ]
        )
    headers = [
        "model",
        "mesh",
        "batch",
        "threads",
        "plain ms",
        "baseline ms",
        "update+apply ms",
        "opt.step ms",
        "opt.step IQR ms",
        "update+apply ms/block",
        "opt.step ms/block",
        "baseline ms/block",
        "baseline / funcshard",
        "met",
    ]
    return tabulate(rows, headers=headers, tablefmt=fmt)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _per_block(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _ratio(theirs: float, ours: float, base: str) -> str:
    if ours <= 0:
        return "funcshard at or below plain"
    return f"{theirs / ours:.1f}x"


def run(cells: list[Cell], rounds: int, warmup: int = 3, echo: bool = True) -> list[Timing]:
    """Measure every cell inside a fake process group of WORLD ranks that this call owns."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    threads = torch.get_num_threads()
    timings = []
    try:
        for cell in cells:
            timings.append(measure(cell, rounds, warmup))
            if echo:
                print(table(timings[-1:], "plain").splitlines()[-1], flush=True)
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()
    return timings


def profile(cell: Cell, steps: int = 20, top: int = 15) -> str:
    """cProfile of funcshard's `opt.step` on one cell: the functions with the most own time,
    per unit (block) per step: calls and microseconds. Needs a fake default process group."""
    torch.set_num_threads(cell.threads)
    step = _steps(cell)[STEP]
    for _ in range(3):
        step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, ncalls, tottime, ...)
    per = steps * cell.blocks
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    table_rows = [
        [_where(key), f"{value[1] / per:.2f}", f"{value[2] / per * 1e6:.1f}"] for key, value in rows
    ]
    total = sum(value[2] for value in stats.values()) / per * 1e6
    headers = ["function", "calls per unit", "own us per unit"]
    return f"{tabulate(table_rows, headers=headers)}\nall functions: {total:.0f} us per unit"


def _where(key: tuple[str, int, str]) -> str:
    file, line, name = key
    if file == "~":
        return name  # a builtin
    parts = file.split("/")
    short = "/".join(
        parts[parts.index("site-packages") + 1 :] if "site-packages" in parts else parts[-2:]
    )
    return f"{short}:{line}({name})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per cell")
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--only", choices=["GPT", "MLP"], help="one model's rows")
    parser.add_argument(
        "--profile",
        metavar="MODEL,MESH,BATCH",
        help="instead of timing, cProfile funcshard's opt.step on one cell, e.g. MLP,FSDP,8",
    )
    args = parser.parse_args()
    if args.profile:
        model, mesh, batch = args.profile.split(",")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
        print(profile(Cell(model, mesh, int(batch), 1, args.blocks)))
        return
    models = (args.only,) if args.only else ("GPT", "MLP")
    timings = run(matrix(models, args.blocks), args.rounds)
    print()
    print(table(timings))
    met = sum(t.met() for t in timings)
    print(
        f"\n{met} of {len(timings)} cells meet the goal (funcshard <= {GOAL_MS_PER_BLOCK} ms "
        f"per block, FSDP2's overhead >= {GOAL_RATIO:.0f}x funcshard's, DDP's >= funcshard's)"
    )


if __name__ == "__main__":
    main()
