"""Page faults and step times with host memory kept and with glibc's defaults, side by side.

    python -m benchmarks.host_memory [--pairs 6] [--rounds 12] [--quick]

Whether freed memory is kept is a setting of a whole process (see [Note: host memory kept
between steps] in funcshard/step/_host_memory.py), so each measurement is a fresh process, and the
processes alternate: glibc's defaults (FUNCSHARD_KEEP_HOST_MEMORY=0), then memory kept, for
`--pairs` pairs. Each process trains the training benchmark's GPT on 2 gloo ranks with
funcshard FSDP and DDP in interleaved rounds and reports each one's median step time and
median page faults per step (the process's minor faults, counted around each timed step).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tabulate import tabulate

import funcshard as fs
from benchmarks.common import DDP, FUNCSHARD, ddp_step, funcshard_step, ms
from benchmarks.training import CFG, QUICK_CFG
from funcshard import testing
from funcshard.step import _host_memory as host_memory
from funcshard.testing.models import GPT, GPTConfig, random_tokens

ROOT = Path(__file__).parents[1]
SETTINGS = {"glibc's defaults": "0", "memory kept": "1"}


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, tuple[float, float]]:
    """Median seconds and page faults per step of each step, over interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    faults: dict[str, list[int]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            before, start = _faults(), time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
            faults[name].append(_faults() - before)
    return {n: (statistics.median(times[n]), statistics.median(faults[n])) for n in steps}


def _rank(cfg: GPTConfig, rounds: int, rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = random_tokens(cfg, 2, seed=rank)
    steps = {
        FUNCSHARD: funcshard_step(cfg, fs.Mesh(shard=2), x, y, seed=0),
        DDP: ddp_step(copy.deepcopy(model), x, y),
    }
    for step in steps.values():  # warm-up; funcshard's first step decides the setting
        step()
        step()
    return {"kept": host_memory.kept(), "medians": _timed(steps, rounds)}


def measure_one(cfg: GPTConfig, rounds: int) -> dict:
    """One process's measurement: rank 0's medians and whether memory was kept."""
    return testing.run(functools.partial(_rank, cfg, rounds), world_size=2, timeout=1800)[0]


def _subprocess(keep: str, rounds: int, quick: bool) -> dict:
    env = {**os.environ, host_memory.ENV: keep}
    command = [sys.executable, "-m", "benchmarks.host_memory", "--one", "--rounds", str(rounds)]
    out = subprocess.run(
        [*command, *(["--quick"] if quick else [])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"{host_memory.ENV}={keep}: the measurement failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ms_and_faults(run: dict) -> str:
    return ", ".join(
        f"{name} {t * 1e3:.1f} ms, {f:.0f} faults" for name, (t, f) in run["medians"].items()
    )


def table(runs: list[tuple[str, dict]]) -> str:
    """One row per process: the setting, faults per step and step times, and the ratio."""
    rows = []
    for setting, run in runs:
        (t_fs, f_fs), (t_ddp, f_ddp) = run["medians"][FUNCSHARD], run["medians"][DDP]
        faults = [f"{f_fs:.0f}", f"{f_ddp:.0f}"]
        rows.append([setting, *faults, ms(t_fs), ms(t_ddp), f"{t_fs / t_ddp:.3f}"])
    headers = ["process", "faults/step funcshard", "faults/step DDP", "funcshard ms", "DDP ms"]
    return tabulate(rows, [*headers, "funcshard / DDP"], "github")


def summary(runs: list[tuple[str, dict]]) -> str:
    """The mean and range of funcshard / DDP under each setting."""
    lines = []
    for setting in SETTINGS:
        ratios = [
            r["medians"][FUNCSHARD][0] / r["medians"][DDP][0] for s, r in runs if s == setting
        ]
        lines.append(
            f"{setting}: funcshard / DDP {min(ratios):.3f}-{max(ratios):.3f}, "
            f"mean {statistics.mean(ratios):.3f} over {len(ratios)} processes"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """The command line (`argv`, sys.argv's unless given: tests call it in their process)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, for tests")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(QUICK_CFG if args.quick else CFG, args.rounds)))
        return
    runs = []
    for _ in range(args.pairs):
        for setting, keep in SETTINGS.items():
            run = _subprocess(keep, args.rounds, args.quick)
            if run["kept"] != (keep == "1"):
                raise SystemExit(f"{setting}: the process did not apply it (kept={run['kept']})")
            runs.append((setting, run))
            print(f"{setting}: {_ms_and_faults(run)}", flush=True)
    print(table(runs))
    print(summary(runs))


if __name__ == "__main__":
    main()
