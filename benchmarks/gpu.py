"""funcshard vs FSDP2 vs plain PyTorch on one CUDA GPU over NCCL (world size 1).

    python -m benchmarks.gpu [--rounds 20] [--out DIR]
    python -m benchmarks.gpu --device cpu --quick --out DIR    (a check of the code, on gloo)

Runs training.py's comparison, the same builders and interleaved medians, on the 14M GPT of
the CPU benchmarks (batch 2x64), a GPT-2-small-shaped 124M one and a GPT-2-medium-shaped
350M one (batch 8x1024). On CUDA
every timed step ends with torch.cuda.synchronize, so wall time is GPU time, and peak memory
is torch.cuda.max_memory_allocated above what was allocated before the framework built its
state. Rewrites the `gpu` section of DIR/RESULTS.md (benchmarks/ by default), naming the GPU.

`--device cpu` runs the same code on gloo at world size 1 with LiveTensors for memory: it
exercises everything but the CUDA specifics and writes CPU figures, so it needs --out.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

from benchmarks import report, training
from benchmarks.common import FSDP2, FUNCSHARD, PLAIN, ratio
from funcshard.testing.models import GPTConfig

FRAMEWORKS = (FUNCSHARD, FSDP2, PLAIN)
MODELS = {
    "14M GPT (the CPU benchmarks' model)": training.TrainingSpec(
        cfg=training.CFG, batch=2, rounds=20, warmup=5, frameworks=FRAMEWORKS
    ),
    "124M GPT (GPT-2 small's shape)": training.TrainingSpec(
        cfg=GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, d_model=768),
        batch=8,
        rounds=20,
        warmup=5,
        frameworks=FRAMEWORKS,
    ),
    "350M GPT (GPT-2 medium's shape)": training.TrainingSpec(
        cfg=GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, d_model=1024),
        batch=8,
        rounds=10,
        warmup=3,
        frameworks=FRAMEWORKS,
    ),
}
QUICK_MODELS = {
    "tiny GPT (--quick)": training.TrainingSpec(
        cfg=training.QUICK_CFG, rounds=2, warmup=1, frameworks=FRAMEWORKS
    ),
}


def _check_device(device: str | None) -> str:
    """The device to run on; exit with the reason when CUDA is wanted but absent."""
    if device == "cpu":
        return device
    if not torch.cuda.is_available():
        raise SystemExit(
            f"benchmarks.gpu: no CUDA GPU is visible (torch {torch.__version__}, "
            f"torch.cuda.is_available() is False). Run it on a machine with a GPU, or pass "
            f"`--device cpu --out DIR` to check the code path on gloo (no GPU figures)."
        )
    if not dist.is_nccl_available():
        raise SystemExit(
            f"benchmarks.gpu: this torch ({torch.__version__}) has no NCCL. Install a CUDA "
            f"build of torch with NCCL, or pass `--device cpu --out DIR`."
        )
    return "cuda"


def markdown(results: dict[str, training.TrainingResult], took: float, quick: bool) -> str:
    """The `gpu` section of RESULTS.md: which device, how it was run, a table per model."""
    first = next(iter(results.values()))
    on_gpu = first.device != "cpu"
    heading = (
        f"## GPU: {first.device}"
        if on_gpu
        else "## GPU script run on CPU (gloo): a check of the code path, not GPU figures"
    )
    cuda = f", CUDA {torch.version.cuda}, {first.device}" if on_gpu else ""
    parts = [
        heading,
        "Written by `benchmarks/gpu.py`: funcshard vs FSDP2 vs plain PyTorch at world size 1"
        f" ({'NCCL' if on_gpu else 'gloo'}); each framework's steps are timed in rotation and "
        + (
            "synchronized, peak memory is torch.cuda.max_memory_allocated from building the "
            f"state through {training.MEMORY_STEPS} steps."
            if on_gpu
            else f"peak live tensor memory counts {training.MEMORY_STEPS} steps."
        )
        + (" A `--quick` run: tiny sizes." * quick),
        f"- Date: {report.now()}\n- Command: `{report.command()}` ({took / 60:.1f} min)\n"
        f"- Machine: {report.machine()}{cuda}",
    ]
    for label, result in results.items():
        t, p = result.times, result.peaks
        parts += [
            f"### {label}: {result.describe()}",
            gpu_table(result),
            f"funcshard step time vs plain {ratio(t[FUNCSHARD], t[PLAIN])}, vs FSDP2 "
            f"{ratio(t[FUNCSHARD], t[FSDP2])}; peak memory vs FSDP2 "
            f"{ratio(p[FUNCSHARD], p[FSDP2])}.",
        ]
    return "\n\n".join(parts) + "\n"


def gpu_table(result: training.TrainingResult) -> str:
    """Median step time, its spread (interquartile range), tokens per second and peak
    memory per framework, with ratios to plain PyTorch and to FSDP2."""
    t, p = result.times, result.peaks
    rows = [
        [
            name,
            f"{t[name] * 1e3:.1f}",
            f"{result.spreads.get(name, 0.0) * 1e3:.2f}",
            f"{result.tokens_per_second(name):,.0f}",
            ratio(t[name], t[PLAIN]),
            ratio(t[name], t[FSDP2]),
            f"{p[name] / 2**20:,.0f}",
            ratio(p[name], p[FSDP2]),
        ]
        for name in t
    ]
    headers = ["step", "median ms", "IQR ms", "tokens/s", "vs plain", "vs FSDP2", "peak MiB"]
    return tabulate(rows, headers=[*headers, "vs FSDP2"], tablefmt="github")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], help="cuda unless given")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 2 rounds")
    parser.add_argument("--rounds", type=int, help="timed rounds per model (20)")
    parser.add_argument("--out", type=Path, help="folder of RESULTS.md (benchmarks/)")
    args = parser.parse_args(argv)
    device = _check_device(args.device)
    if device == "cpu" and args.out is None:
        parser.error(
            "--device cpu checks the code path and writes CPU figures: give --out DIR so that "
            "they do not replace the GPU section of benchmarks/RESULTS.md."
        )
    out = args.out or Path(__file__).resolve().parent
    out.mkdir(parents=True, exist_ok=True)
    models = QUICK_MODELS if args.quick else MODELS
    backend = "nccl" if device == "cuda" else "gloo"
    began = time.monotonic()
    results = {}
    for label, spec in models.items():
        spec = replace(spec, rounds=args.rounds or spec.rounds)
        results[label] = result = training.measure(spec, world_size=1, backend=backend)
        print(f"{label}: {result.describe()}")
        print(gpu_table(result))
        print()
    took = time.monotonic() - began
    report.write_section(out / "RESULTS.md", "gpu", markdown(results, took, args.quick))
    print(f"wrote the gpu section of {out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
