"""The estimator against a measured step: `funcshard.estimate`'s peak vs LiveTensors.

    python -m benchmarks.estimate [--quick] [--out DIR]

On 2 gloo ranks each model is sharded (FSDP, one unit per block, the rest in the root) and
trained with AdamW: one step to warm up, then one step measured by
`funcshard.testing.memory.LiveTensors`, counting the state and optimizer state (adopted)
and everything the step makes, written as a function of (state, opt_state, batch), once with
`opt.update` + `fs.apply_updates` (README's form) and once with `opt.step` (in place). The
estimate is made in this process, with no process group: by arithmetic on the plan alone
(no activations) and with a dry run of the same loss function on the meta device. The
error is (estimate - measured) / measured, of the larger rank's peak.

Models: the demo's GPT (`funcshard demo`, batch 8x64 per rank), a 17M-parameter GPT, and a
GPT whose root unit holds most of the model: untied 32,000-token embedding and head, two
small blocks. Rewrites the `estimate` section of DIR/RESULTS.md (benchmarks/ by default;
`--quick` runs a tiny model and writes only where --out says).
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

import funcshard as fs
from benchmarks import report
from funcshard import testing
from funcshard.cli import demo
from funcshard.planning._estimate import estimate, format_bytes
from funcshard.testing.memory import LiveTensors
from funcshard.testing.models import GPT, Block, GPTConfig

WORLD_SIZE = 2


@dataclass(frozen=True)
class Case:
    """One model and the batch each rank trains on."""

    name: str
    cfg: GPTConfig
    batch: int  # sequences of cfg.block_size tokens per rank


MODELS = (
    Case("demo GPT", demo.model_config(demo.DemoConfig()), demo.DemoConfig().batch),
    Case(
        "17M GPT",
        GPTConfig(vocab_size=8192, block_size=64, n_layer=8, n_head=6, d_model=384),
        batch=8,
    ),
    Case(
        "root holds the embeddings",
        GPTConfig(
            vocab_size=32000,
            block_size=64,
            n_layer=2,
            n_head=4,
            d_model=256,
            tie_embeddings=False,
        ),
        batch=8,
    ),
)
QUICK = (Case("tiny GPT (--quick)", GPTConfig(), batch=2),)


def lm_loss(model: GPT, params: object, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _plan(model: GPT) -> fs.Plan:
    return fs.plan(model, policy=fs.policy.module_classes({Block}))


def _step(model: GPT, opt: fs.optim.Optimizer, donate: bool, state, opt_state, x, y):
    """One training step as a function: its caller holds nothing but what it passes."""
    _, grads = fs.value_and_grad(functools.partial(lm_loss, model))(state, x, y)
    if donate:
        return opt.step(grads, opt_state, state)
    updates, opt_state = opt.update(grads, opt_state, state)
    return fs.apply_updates(state, updates), opt_state


def _batch(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(case.cfg.vocab_size, (case.batch, case.cfg.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _measured_rank(case: Case, donate: bool, loop: bool, rank: int) -> int:
    """Peak live tensor bytes on this rank: README's loop of 3 steps, counted from before
    `fs.shard`, or (`loop=False`) a second step written as a function."""
    with torch.device("meta"):
        model = GPT(case.cfg)
    x, y = _batch(case, rank)
    opt = fs.optim.adamw(1e-3)
    if loop:
        grad_fn = fs.value_and_grad(functools.partial(lm_loss, model))
        with LiveTensors() as memory:
            state = fs.shard(model, _plan(model), fs.Mesh(shard=WORLD_SIZE), seed=0)
            opt_state = opt.init(state)
            for _ in range(3):
                _loss, grads = grad_fn(state, x, y)  # README: print(loss) etc.
                if donate:
                    state, opt_state = opt.step(grads, opt_state, state)
                else:
                    updates, opt_state = opt.update(grads, opt_state, state)
                    state = fs.apply_updates(state, updates)
        return memory.peak
    state = fs.shard(model, _plan(model), fs.Mesh(shard=WORLD_SIZE), seed=0)
    opt_state = opt.init(state)
    state, opt_state = _step(model, opt, donate, state, opt_state, x, y)  # warm up
    gc.collect()
    with LiveTensors() as memory:
        memory.adopt((state, opt_state))
        state, opt_state = _step(model, opt, donate, state, opt_state, x, y)
    return memory.peak


def compare(case: Case, donate: bool) -> dict:
    """Measured peaks (the larger rank's) and estimates of one model and optimizer form:
    in README's loop and as a step function, and by arithmetic on the plan alone."""
    with torch.device("meta"):
        model = GPT(case.cfg)
    plan = _plan(model)
    x = torch.zeros(case.batch, case.cfg.block_size, dtype=torch.long)
    result: dict = {"params": sum(p.numel() for p in model.parameters())}
    for loop in (True, False):
        measure = functools.partial(_measured_rank, case, donate, loop)
        started = time.perf_counter()
        estimated = estimate(
            plan,
            WORLD_SIZE,
            model=model,
            loss_fn=functools.partial(lm_loss, model),
            args=(x, x),
            donate=donate,
            loop=loop,
            device="cpu",
        )
        result[loop] = {
            "seconds": time.perf_counter() - started,
            "estimate": estimated,
            "measured": max(testing.run(measure, timeout=900)),
        }
    result["plan only"] = estimate(plan, WORLD_SIZE, model=model, donate=donate)
    return result


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"


def _error(estimated: int, measured: int) -> str:
    return f"{(estimated - measured) / measured:+.2%}"


def rows(cases: tuple[Case, ...]) -> list[list[str]]:
    out = []
    for case in cases:
        for donate in (False, True):
            r = compare(case, donate)
            loop, function = r[True], r[False]
            out.append(
                [
                    case.name,
                    _count(r["params"]),
                    f"{case.batch}x{case.cfg.block_size}",
                    "opt.step" if donate else "update + apply",
                    format_bytes(loop["measured"]),
                    format_bytes(loop["estimate"].peak),
                    _error(loop["estimate"].peak, loop["measured"]),
                    loop["estimate"].peak_phase,
                    format_bytes(function["measured"]),
                    format_bytes(function["estimate"].peak),
                    _error(function["estimate"].peak, function["measured"]),
                    format_bytes(r["plan only"].peak),
                    _error(r["plan only"].peak, loop["measured"]),
                    f"{loop['seconds']:.2f}",
                ]
            )
            print(" | ".join(out[-1]), flush=True)
    return out


HEADERS = [
    "model",
    "params",
    "batch/rank",
    "optimizer",
    "loop: measured",
    "estimate",
    "error",
    "peak in",
    "step fn: measured",
    "estimate",
    "error",
    "plan only",
    "error",
    "estimate s",
]


def markdown(table: list[list[str]], took: float, quick: bool) -> str:
    parts = [
        "## The memory estimate against a measured step",
        "Written by `benchmarks/estimate.py`. Measured: the peak live tensor memory that "
        "`LiveTensors` counts on 2 gloo ranks (the larger rank's), FSDP with one unit per "
        "block, AdamW; *loop* is README's training loop of 3 steps counted from before "
        "`fs.shard` (`loss, grads = ...` holds the previous step's gradients until the next "
        "returns), *step fn* one step written as a function of (state, opt_state, batch). "
        "Estimated: `funcshard.estimate(plan, 2, model=, loss_fn=, args=, loop=)`, which runs "
        "the step once on the meta device, in this process without a process group; *plan "
        "only* is `funcshard.estimate(plan, 2)` by arithmetic, without activations (error "
        "against the loop). Error = (estimate - measured) / measured."
        + (" A `--quick` run: a tiny model." * quick),
        f"- Date: {report.now()}\n- Command: `{report.command()}` ({took / 60:.1f} min)\n"
        f"- Machine: {report.machine()}",
        tabulate(table, HEADERS, "github"),
    ]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model: a check")
    parser.add_argument("--out", type=Path, help="folder of RESULTS.md (benchmarks/)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    print(" | ".join(HEADERS))
    table = rows(QUICK if args.quick else MODELS)
    took = time.monotonic() - began
    print()
    print(tabulate(table, HEADERS))
    if args.quick and args.out is None:
        return  # a check: the committed figures stay
    out = args.out or Path(__file__).resolve().parent
    out.mkdir(parents=True, exist_ok=True)
    report.write_section(out / "RESULTS.md", "estimate", markdown(table, took, args.quick))
    print(f"wrote the estimate section of {out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
