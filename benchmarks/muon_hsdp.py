"""Muon on HSDP 2x2: owned blocks (each replica repeats its owners' math, no collective in
`opt.step`) against even blocks (`whole_params` spreads owners over the whole mesh, all four
ranks, and exchanges by all-to-alls), the optimizer step timed as in `benchmarks.muon`.

    python -m benchmarks.muon_hsdp [--rounds 8] [--quick]

On gloo (4 ranks, wall time, averaged over ranks) and on the fake group of 4 (rank 0, one
thread, its CPU time; see `benchmarks.muon`). Which the code picks, and why: [Note: owned
placement] in funcshard/core/_placement.py.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from tabulate import tabulate

import funcshard as fs
from benchmarks.common import ms, ratio
from benchmarks.muon import EVEN, FAKE_ROUNDS, OWNED, QUICK_CFG, Funcshard, MuonSpec, _timed
from funcshard import testing
from funcshard.testing.models import GPT, random_tokens

REPLICATE, SHARD = 2, 2


def _contenders(spec: MuonSpec, rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(spec.cfg)
    x, y = random_tokens(spec.cfg, spec.batch, seed=rank)
    mesh = fs.Mesh(replicate=REPLICATE, shard=SHARD)
    return {n: Funcshard(model, mesh, x, y, p) for n, p in ((OWNED, "owned"), (EVEN, "even"))}


def _rank(spec: MuonSpec, rank: int) -> dict:
    times = _timed(_contenders(spec, rank), spec.warmup, spec.rounds, dist.barrier)
    return {n: statistics.median(t["step"]) for n, t in times.items()}


def _fake(spec: MuonSpec) -> dict:
    """The fake group's times; the even path's where the fake group runs it: its all-to-all
    refuses an empty input beside a nonzero receive (a check only FakeProcessGroup makes),
    which rank 0 of HSDP 2x2 meets, so there it is left out."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # the fake group's buffers are garbage
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=REPLICATE * SHARD)
    try:
        rounds = spec.rounds * FAKE_ROUNDS
        out = {}
        for name, contender in _contenders(spec, 0).items():
            try:
                times = _timed(
                    {name: contender}, spec.warmup, rounds, lambda: None, time.thread_time
                )
            except RuntimeError:  # the even path's all-to-all, see above
                continue
            out[name] = statistics.median(times[name]["step"])
        return out
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=MuonSpec.rounds)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks, not figures")
    args = parser.parse_args(argv)
    spec = MuonSpec(rounds=args.rounds)
    if args.quick:
        spec = MuonSpec(cfg=QUICK_CFG, rounds=min(args.rounds, 2), warmup=1)
    results = testing.run(functools.partial(_rank, spec), world_size=REPLICATE * SHARD)
    gloo = {n: statistics.mean(r[n] for r in results) for n in (OWNED, EVEN)}
    with mp.get_context("spawn").Pool(1) as pool:
        fake = pool.apply(_fake, (spec,))
    print(spec.describe(f"HSDP {REPLICATE}x{SHARD}"))
    rows = [
        [
            where,
            ms(t[OWNED]),
            ms(t[EVEN]) if EVEN in t else "n/a",
            ratio(t[OWNED], t[EVEN]) if EVEN in t else "",
        ]
        for where, t in (("gloo, 4 ranks", gloo), ("fake group of 4", fake))
    ]
    headers = ["opt step", "owned ms", "even + whole_params ms", "owned / even"]
    print(tabulate(rows, headers, "github"))


if __name__ == "__main__":
    main()
