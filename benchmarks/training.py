"""Real training on 2 gloo ranks: funcshard vs FSDP2 vs DDP vs plain PyTorch, side by side.

    python -m benchmarks.training [--world-size 2] [--rounds 8]

Each rank trains a ~14M-parameter GPT (vocab 8192, d 384, 6 blocks, tied embedding, AdamW)
on its own batch. Step times are medians over rounds that rotate through the frameworks;
peak live tensor memory is counted op by op (funcshard.testing.memory.LiveTensors) from
before each framework builds its state through three steps, parameters and optimizer
state included. On CUDA (benchmarks/gpu.py runs this code over NCCL) each timed step ends
with a synchronize and peak memory is torch.cuda.max_memory_allocated above the start.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch.distributed.device_mesh import init_device_mesh

import funcshard as fs
from benchmarks.common import (
    DDP,
    FSDP2,
    FUNCSHARD,
    PLAIN,
    REPLICATE,
    ddp_step,
    fsdp2_step,
    funcshard_step,
    interleaved_samples,
    mib,
    ms,
    plain_step,
    ratio,
)
from funcshard import testing
from funcshard.testing.memory import LiveTensors
from funcshard.testing.models import GPT, GPTConfig, random_tokens

CFG = GPTConfig(vocab_size=8192, block_size=64, n_layer=6, n_head=6, d_model=384)
QUICK_CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=32)
FRAMEWORKS = (FUNCSHARD, REPLICATE, FSDP2, DDP, PLAIN)
MEMORY_STEPS = 3  # steps inside the memory count: the optimizer state exists from the first


@dataclass(frozen=True)
class TrainingSpec:
    """One training comparison: the model, the batch per rank, the rounds, the contenders."""

    cfg: GPTConfig = CFG
    batch: int = 2  # sequences per rank
    rounds: int = 8
    warmup: int = 2
    frameworks: tuple[str, ...] = FRAMEWORKS


@dataclass(frozen=True)
class TrainingResult:
    """Medians of one comparison at one world size, gathered from every rank."""

    spec: TrainingSpec
    world_size: int
    device: str  # "cpu", or the GPU's name
    params: int
    times: Mapping[str, float]  # seconds per step: each rank's median, averaged over ranks
    peaks: Mapping[str, int]  # bytes: the largest rank's peak
    spreads: Mapping[str, float] = field(default_factory=dict)  # seconds: interquartile
    # range of each rank's step times, averaged over ranks

    def tokens_per_second(self, name: str) -> float:
        """Tokens every rank together trains on per second at the median step time."""
        return self.spec.batch * self.spec.cfg.block_size * self.world_size / self.times[name]

    def describe(self) -> str:
        n = self.world_size
        where = f"{n} gloo rank{'s' * (n > 1)}" if self.device == "cpu" else f"{self.device}, NCCL"
        return (
            f"GPT {params(self.params)} params, {where}, batch {self.spec.batch}x"
            f"{self.spec.cfg.block_size} per rank, median of {self.spec.rounds} interleaved rounds"
        )


def params(n: int) -> str:
    """A parameter count: `13.8M`, or thousands (`K`) for the quick models."""
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _builders(
    cfg: GPTConfig, world: int, device: torch.device, x: torch.Tensor, y: torch.Tensor, model: GPT
) -> dict[str, Callable[[], Callable[[], None]]]:
    """How each framework builds its step from the same initial model (or config)."""
    return {
        FUNCSHARD: lambda: funcshard_step(cfg, fs.Mesh(shard=world), x, y, seed=0),
        REPLICATE: lambda: funcshard_step(
            cfg, fs.Mesh(replicate=world), x, y, replicate=True, seed=0
        ),
        FSDP2: lambda: fsdp2_step(
            copy.deepcopy(model).to(device), init_device_mesh(device.type, (world,)), x, y
        ),
        DDP: lambda: ddp_step(copy.deepcopy(model).to(device), x, y),
        PLAIN: lambda: plain_step(copy.deepcopy(model).to(device), x, y),
    }


def _peak_bytes(build: Callable[[], Callable[[], None]], device: torch.device) -> int:
    """Peak memory from building a framework's state through MEMORY_STEPS steps."""
    if device.type != "cuda":
        with LiveTensors() as mode:
            step = build()
            for _ in range(MEMORY_STEPS):
                step()
        return mode.peak
    gc.collect()  # the previous framework's state is gone before the count starts
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step = build()
    for _ in range(MEMORY_STEPS):
        step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def _warm_up_cuda(build: Callable[[], Callable[[], None]]) -> None:
    """One plain step before any peak is counted: what CUDA allocates once per process (the
    cuBLAS workspace, 32 MiB on an H200) would otherwise count against whichever framework
    is measured first."""
    build()()
    gc.collect()
    torch.cuda.synchronize()


def _iqr(samples: list[float]) -> float:
    """The interquartile range of step times (0 for fewer than two)."""
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return q3 - q1


def _synced(step: Callable[[], None]) -> Callable[[], None]:
    """A CUDA step that returns when the GPU is done, so wall time is GPU time."""

    def synced() -> None:
        step()
        torch.cuda.synchronize()

    return synced


def _rank(spec: TrainingSpec, rank: int) -> dict:
    world = dist.get_world_size()
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    torch.manual_seed(0)
    model = GPT(spec.cfg)
    x, y = (t.to(device) for t in random_tokens(spec.cfg, spec.batch, seed=rank))
    every = _builders(spec.cfg, world, device, x, y, model)
    builders = {name: every[name] for name in spec.frameworks}
    if nccl:
        _warm_up_cuda(every[PLAIN])
    peaks = {name: _peak_bytes(build, device) for name, build in builders.items()}
    steps = {name: build() for name, build in builders.items()}
    if nccl:
        steps = {name: _synced(step) for name, step in steps.items()}
    samples = interleaved_samples(steps, warmup=spec.warmup, rounds=spec.rounds)
    return {
        "times": {name: statistics.median(t) for name, t in samples.items()},
        "spreads": {name: _iqr(t) for name, t in samples.items()},
        "peaks": peaks,
        "params": sum(p.numel() for p in model.parameters()),
        "device": torch.cuda.get_device_name(device) if nccl else "cpu",
    }


def measure(spec: TrainingSpec, world_size: int, backend: str = "gloo") -> TrainingResult:
    """Run the comparison on `world_size` ranks of a worker pool; times averaged over ranks."""
    results = testing.run(
        functools.partial(_rank, spec), world_size=world_size, backend=backend, timeout=3600
    )
    return TrainingResult(
        spec=spec,
        world_size=world_size,
        device=results[0]["device"],
        params=results[0]["params"],
        times={n: statistics.mean(r["times"][n] for r in results) for n in spec.frameworks},
        peaks={n: max(r["peaks"][n] for r in results) for n in spec.frameworks},
        spreads={n: statistics.mean(r["spreads"][n] for r in results) for n in spec.frameworks},
    )


def table(result: TrainingResult, fmt: str = "simple") -> str:
    """Step time and peak memory per framework, with ratios to FSDP2 (and DDP, if it ran)."""
    times, peaks = result.times, result.peaks
    with_ddp = DDP in times
    rows = [
        [
            name,
            ms(times[name]),
            ratio(times[name], times[FSDP2]),
            *([ratio(times[name], times[DDP])] if with_ddp else []),
            mib(peaks[name]),
            ratio(peaks[name], peaks[FSDP2]),
        ]
        for name in times
    ]
    headers = ["step", "ms", "vs FSDP2", *(["vs DDP"] if with_ddp else []), "peak MiB/rank"]
    return tabulate(rows, headers=[*headers, "vs FSDP2"], tablefmt=fmt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=TrainingSpec.rounds)
    args = parser.parse_args()
    result = measure(TrainingSpec(rounds=args.rounds), args.world_size)
    print(result.describe())
    print(table(result))


if __name__ == "__main__":
    main()
