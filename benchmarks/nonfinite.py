"""What the step's default checks cost: `check_finite="skip"` (the default) against `"off"`,
or (`--what unused`) tracking unused parameters (`unused="skip"`, the default) against
`unused="zeros"`, or (`--what both`) the two defaults against neither (`check_finite="off",
unused="zeros"`: a step as it was before either), interleaved in one process, on the
overhead matrix's fake group and on real gloo ranks.

    python -m benchmarks.nonfinite [--what finite|unused|both|split] [--rounds 200]
        [--gloo-rounds 40]

`--what split` runs four modes interleaved on the fake group (neither, the check alone, the
tracking alone, both) and gives each against neither, and both against the check alone:
each issue's own share of the step.

The check is a sum over each gradient shard, one all-gather of (buffers + 3) int64 after the
step's last reduction, and one read of the flags by the optimizer (see [Note: non-finite
steps skipped by default] in funcshard/step/_finite.py). Both modes carry the same trail
and gloo headers (free: see [Note: the collectives' trail], [Note: the exchange's header in
its tag]). The fake group's cells are the overhead matrix's GPT rows (32 blocks, d 64,
batch 1x16, one thread, `opt.step`); the gloo rows are benchmarks/training.py's 14M GPT on
2 ranks. Both modes step one shared state (the same tensors, so neither gains from where its
memory happens to lie, which moved single runs by +-10% when each mode had its own); each
round times one step of each mode in a seeded order, and the ratio is the median over rounds
of the default's time over the other's in the same round, with a 95% interval for that
median (order statistics: no assumption on the times' distribution). With `--what finite`,
the check is also timed inside the default's steps (`finite.judged` and the optimizer's
`finite.skip_this_step`, wrapped with a clock): its median per step over the step's median
time is its share of the step, a figure the machine's drift between rounds does not blur. The
unchecked step's `finite.judged` is timed too: it agrees on the unused parameters with an
all-reduce of its own, which the default's all-gather carries instead, so the check's time
less that one is what the default adds to a step.
Unused parameters are noted by the gathers' backwards, ride the check's all-gather as a few
int64 words and are read by the optimizer (see [Note: unused parameters] in
funcshard/step/_usage.py): every parameter is used in these steps, so it measures what the
tracking costs a step that skips nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch.testing._internal.distributed.fake_pg import FakeStore

import funcshard as fs
from benchmarks.common import interleaved_samples, lm_loss
from benchmarks.training import CFG
from funcshard import testing
from funcshard.step import _finite as finite
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

# per comparison: (the other mode, its value_and_grad options), then the default's
COMPARISONS = {
    "finite": (("off", {"check_finite": "off"}), ("skip", {})),
    "unused": (("zeros", {"unused": "zeros"}), ("skip", {})),
    "both": (("neither", {"check_finite": "off", "unused": "zeros"}), ("skip", {})),
}
# `--what split`: each issue's share, every mode against neither (fake group cells only)
SPLIT = (
    ("neither", {"check_finite": "off", "unused": "zeros"}),
    ("check", {"unused": "zeros"}),  # the check alone, as after issue 50 and before 51
    ("unused", {"check_finite": "off"}),  # the tracking alone: its words go in an all-gather
    ("skip", {}),  # both defaults
)
FAKE_MESHES = {"FSDP": (1, 8), "HSDP 2x4": (2, 4), "DDP": (8, 1)}


def _steps(
    cfg: GPTConfig, mesh: fs.Mesh, batch: int, rank: int, replicate: bool, what: str
) -> dict:
    """One AdamW `opt.step` per mode, the same batch, both stepping one shared state."""
    x, y = random_tokens(cfg, batch, seed=rank)
    with torch.device("meta"):
        model = GPT(cfg)
    if replicate:
        state = fs.replicate(model, mesh)
    else:
        state = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), mesh)
    opt = fs.optim.adamw(1e-3)
    box = {"state": state, "opt": opt.init(state)}
    steps = {}
    for mode, options in SPLIT if what == "split" else COMPARISONS[what]:
        grad_fn = fs.value_and_grad(
            functools.partial(lambda m, s: lm_loss(fs.call(m, s, x), y), model), **options
        )

        def step(box=box, grad_fn=grad_fn, opt=opt) -> None:
            _, grads = grad_fn(box["state"])
            box["state"], box["opt"] = opt.step(grads, box["opt"], box["state"])

        steps[mode] = step
    return steps


@contextlib.contextmanager
def timed_checks(times: list[float], off: list[float] | None = None) -> Iterator[None]:
    """Append to `times` the seconds each checked step spends in the non-finite check:
    `finite.judged` issuing the verdict, then the optimizer reading it; and to `off` those
    an unchecked step spends in `finite.judged` (agreeing on the unused parameters alone)."""
    judged, skip_this_step = finite.judged, finite.skip_this_step

    def timed_judged(loss, grads, policy, *args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = judged(loss, grads, policy, *args, **kwargs)
        if policy != "off":
            times.append(time.perf_counter() - start)
        elif off is not None:
            off.append(time.perf_counter() - start)
        return out

    def timed_read(grads, skips):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = skip_this_step(grads, skips)
        if getattr(grads, "verdict", None) is not None:
            times[-1] += time.perf_counter() - start
        return out

    finite.judged, finite.skip_this_step = timed_judged, timed_read
    try:
        yield
    finally:
        finite.judged, finite.skip_this_step = judged, skip_this_step


def _samples(steps: dict, warmup: int, rounds: int, what: str) -> dict[str, list[float]]:
    """`interleaved_samples` of `steps`, with the check's own seconds per step as "check"
    when `what` is "finite", and the unchecked step's `finite.judged` as "off check"
    (warm-up and settling steps included: each does the same work in each)."""
    if what != "finite":
        return interleaved_samples(steps, warmup=warmup, rounds=rounds, settle=1)
    checks: list[float] = []
    offs: list[float] = []
    with timed_checks(checks, offs):
        samples = interleaved_samples(steps, warmup=warmup, rounds=rounds, settle=1)
    return {**samples, "check": checks, "off check": offs}


def paired_ratio(default: list[float], other: list[float]) -> tuple[float, float, float]:
    """The median over rounds of `default[i] / other[i]`, and a 95% interval for it: the
    order statistics n/2 -+ 1.96 sqrt(n)/2 of the sorted ratios (the sign test's interval)."""
    ratios = sorted(d / o for d, o in zip(default, other, strict=True))
    n = len(ratios)
    half = 0.98 * math.sqrt(n)
    low, high = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)
    return statistics.median(ratios), ratios[low], ratios[high]


def _row(where: str, samples: dict[str, list[float]], what: str) -> list:
    (other, _), (default, _) = COMPARISONS[what]
    off, skip = statistics.median(samples[other]), statistics.median(samples[default])
    mid, low, high = paired_ratio(samples[default], samples[other])
    check = statistics.median(samples["check"]) if "check" in samples else None
    # what the check adds: both modes agree on the unused parameters, the default on the
    # check's all-gather, "off" on an all-reduce of its own (timed as "off check")
    extra = check - statistics.median(samples["off check"]) if check is not None else None
    return [
        where,
        f"{off * 1e3:.2f}",
        f"{skip * 1e3:.2f}",
        f"{(skip - off) * 1e3:+.3f}",
        f"{mid:.4f}x",
        f"{low:.4f}x to {high:.4f}x",
        "-" if check is None else f"{check * 1e3:.3f}",
        "-" if check is None else f"{check / skip:.2%}",
        "-" if extra is None else f"{extra * 1e3:.3f}",
        "-" if extra is None else f"{extra / skip:.2%}",
    ]


def _fake_samples(rounds: int, what: str) -> dict[str, dict[str, list[float]]]:
    """`_samples` of each of the overhead matrix's GPT cells (batch 1, one thread) on a fake
    group of 8, by the cell's name."""
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=32, n_head=2, d_model=64)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cells = {}
        for name, (replicate, shard) in FAKE_MESHES.items():
            mesh = fs.Mesh(replicate=replicate, shard=shard)
            steps = _steps(cfg, mesh, 1, 0, replicate=shard == 1, what=what)
            cells[f"fake group of 8, {name}"] = _samples(steps, 3, rounds, what)
        return cells
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()


def fake_rows(rounds: int, what: str = "finite") -> list[list]:
    """The overhead matrix's GPT cells on a fake group of 8: one row of `_row` each."""
    return [_row(where, samples, what) for where, samples in _fake_samples(rounds, what).items()]


def split_rows(rounds: int) -> list[list]:
    """Each mode of `SPLIT` against neither, interleaved in one run, on the fake group's
    cells: what the check adds, what the tracking adds alone and on top of the check."""
    rows = []
    for where, samples in _fake_samples(rounds, "split").items():
        row = [where, f"{statistics.median(samples['neither']) * 1e3:.2f}"]
        for mode, _ in SPLIT[1:]:
            mid, low, high = paired_ratio(samples[mode], samples["neither"])
            row.append(f"{mid:.4f}x ({low:.4f}-{high:.4f})")
        mid, low, high = paired_ratio(samples["skip"], samples["check"])
        rows.append([*row, f"{mid:.4f}x ({low:.4f}-{high:.4f})"])
    return rows


def _gloo_samples(rounds: int, what: str, rank: int) -> dict[str, list[float]]:
    steps = _steps(CFG, fs.Mesh(shard=2), 2, rank, replicate=False, what=what)
    return _samples(steps, 2, rounds, what)


def gloo_row(rounds: int, what: str = "finite") -> list:
    """benchmarks/training.py's 14M GPT on 2 gloo ranks, FSDP; each rank's medians averaged."""
    task = functools.partial(_gloo_samples, rounds, what)
    per_rank = testing.run(task, world_size=2, timeout=1800)
    # a round's time on the two ranks, averaged (they step together)
    samples = {
        m: [statistics.fmean(ts) for ts in zip(*(r[m] for r in per_rank), strict=True)]
        for m in per_rank[0]
    }
    return _row("2 gloo ranks, 14M GPT, FSDP", samples, what)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="fake group rounds per cell")
    parser.add_argument("--gloo-rounds", type=int, default=40)
    parser.add_argument("--what", choices=(*COMPARISONS, "split"), default="finite")
    args = parser.parse_args()
    if args.what == "split":
        headers = ["step", "neither ms", *(f"{m} / neither" for m, _ in SPLIT[1:]), "skip / check"]
        print(tabulate(split_rows(args.rounds), headers=headers, tablefmt="github"))
        return
    rows = [*fake_rows(args.rounds, args.what), gloo_row(args.gloo_rounds, args.what)]
    other = COMPARISONS[args.what][0][0]
    headers = [
        "step",
        f"{other} ms",
        "skip ms (default)",
        f"skip - {other} ms",
        f"skip / {other}, median of rounds",
        "95% interval",
        "check ms (timed inside)",
        "check / skip step",
        f"check - {other}'s own ms",
        "that / skip step",
    ]
    print(tabulate(rows, headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
