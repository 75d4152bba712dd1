"""`fs.estimate` against measured peaks for optimizers beyond plain AdamW.

    python -m benchmarks.estimate_optim [--quick] [--out DIR]

On 2 gloo ranks, FSDP-2 (`fs.shard`, one unit per block) and DDP-2 (`fs.replicate`), a
GPT trains README's loop (3 steps of `opt.update` + `fs.apply_updates`), counted by
`funcshard.testing.memory.LiveTensors` from before the state is built; the larger rank's
peak. Optimizers: AdamW; AdamW with a weight-decay mask (matrices decayed, the rest not);
`partition` into two AdamW groups (nanoGPT's decay / no-decay); Muon on the blocks'
matrices through `whole_params` beside AdamW on the rest (`partition`); AdamW after
`clip_by_global_norm`. Each on two GPTs (`--quick`: the small one, and nothing written).
The estimate is `fs.estimate(plan, 2, model=, loss_fn=, args=, optimizer=)` in this
process, with no process group (`fs.estimate(None, 2, replicate=True, ...)` for DDP).
Rewrites the `estimate-optim` section of DIR/RESULTS.md (benchmarks/ by default).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

import funcshard as fs
from benchmarks import report
from funcshard import testing
from funcshard.planning._estimate import format_bytes
from funcshard.testing.memory import LiveTensors
from funcshard.testing.models import GPT, Block, GPTConfig

WORLD_SIZE = 2
SMALL = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, d_model=32)
LARGER = GPTConfig(vocab_size=512, block_size=32, n_layer=4, n_head=4, d_model=128)


def _matrix(fqn: str, p: torch.Tensor) -> bool:
    return p.ndim >= 2


def _block_matrix(fqn: str, p: torch.Tensor) -> str:
    return "muon" if p.ndim == 2 and fqn.startswith("blocks.") else "adamw"


def adamw() -> fs.optim.Optimizer:
    return fs.optim.adamw(1e-3, weight_decay=0.1)


def masked() -> fs.optim.Optimizer:
    return fs.optim.adamw(1e-3, weight_decay=0.1, weight_decay_mask=_matrix)


def groups() -> fs.optim.Optimizer:
    opts = {
        "decay": fs.optim.adamw(1e-3, weight_decay=0.1),
        "rest": fs.optim.adamw(1e-3, weight_decay=0.0),
    }
    return fs.optim.partition(opts, lambda f, p: "decay" if p.ndim >= 2 else "rest")


def muon() -> fs.optim.Optimizer:
    opts = {"muon": fs.optim.muon(0.02), "adamw": fs.optim.adamw(1e-3)}
    return fs.optim.partition(opts, _block_matrix)


def clipped() -> fs.optim.Optimizer:
    return fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(1e-3))


OPTIMIZERS: dict[str, Callable[[], fs.optim.Optimizer]] = {
    "adamw": adamw,
    "adamw, decay mask": masked,
    "partition (2 AdamW)": groups,
    "whole_params (Muon + AdamW)": muon,
    "clip + adamw": clipped,
}


@dataclass(frozen=True)
class Case:
    optimizer: str
    cfg: GPTConfig
    ddp: bool
    batch: int = 4


def lm_loss(model: GPT, params: object, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _model(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def _plan(model: GPT) -> fs.Plan:
    return fs.plan(model, policy=fs.policy.module_classes({Block}))


def _batch(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    t = torch.randint(case.cfg.vocab_size, (case.batch, case.cfg.block_size + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def measured(case: Case, rank: int) -> int:
    """README's loop, 3 steps, counted from before the state is built."""
    model = _model(case.cfg)
    x, y = _batch(case, rank)
    opt = OPTIMIZERS[case.optimizer]()
    grad_fn = fs.value_and_grad(functools.partial(lm_loss, model))
    with LiveTensors() as memory:
        if case.ddp:
            state = fs.replicate(model, fs.Mesh(replicate=WORLD_SIZE), seed=0)
        else:
            state = fs.shard(model, _plan(model), fs.Mesh(shard=WORLD_SIZE), seed=0)
        opt_state = opt.init(state)
        for _ in range(3):
            _, grads = grad_fn(state, x, y)
            updates, opt_state = opt.update(grads, opt_state, state)
            state = fs.apply_updates(state, updates)
    return memory.peak


def estimated(case: Case) -> fs.Estimate:
    model = _model(case.cfg)
    x = torch.zeros(case.batch, case.cfg.block_size, dtype=torch.long)
    loss_fn = functools.partial(lm_loss, model)
    opt = OPTIMIZERS[case.optimizer]()
    common = dict(model=model, loss_fn=loss_fn, args=(x, x), optimizer=opt, device="cpu")
    if case.ddp:
        return fs.estimate(None, WORLD_SIZE, replicate=True, **common)
    return fs.estimate(_plan(model), WORLD_SIZE, **common)


def _all_measured(cases: list[Case], rank: int) -> list[int]:
    return [measured(c, rank) for c in cases]


def cases(quick: bool) -> list[Case]:
    """Every optimizer on both GPTs (the small one only with --quick), FSDP-2 and DDP-2."""
    sizes = (SMALL,) if quick else (SMALL, LARGER)
    return [Case(name, cfg, ddp) for name in OPTIMIZERS for cfg in sizes for ddp in (False, True)]


def rows(chosen: list[Case]) -> list[list[str]]:
    """One row per case: the larger rank's measured peak, the estimate, the error."""
    peaks = testing.run(
        functools.partial(_all_measured, chosen), world_size=WORLD_SIZE, timeout=900
    )
    out = []
    for i, case in enumerate(chosen):
        real = max(p[i] for p in peaks)
        est = estimated(case)
        params = sum(p.numel() for p in _model(case.cfg).parameters())
        out.append(
            [
                case.optimizer,
                f"{params:,}",
                "DDP-2" if case.ddp else "FSDP-2",
                format_bytes(real),
                format_bytes(est.peak),
                f"{(est.peak - real) / real:+.2%}",
                est.peak_phase,
            ]
        )
        print(" | ".join(out[-1]), flush=True)
    return out


HEADERS = ["optimizer", "params", "mesh", "measured", "estimate", "error", "peak in"]


def markdown(table: list[list[str]], took: float) -> str:
    parts = [
        "## The memory estimate against measured steps, by optimizer",
        "Written by `benchmarks/estimate_optim.py`. Measured: the peak live tensor memory "
        "`LiveTensors` counts on 2 gloo ranks (the larger rank's) in README's loop (3 steps "
        "of `opt.update` + `fs.apply_updates`, batch 4 per rank), counted from before the "
        "state is built; FSDP-2 is `fs.shard` with one unit per block, DDP-2 `fs.replicate`. "
        "Estimated: `fs.estimate(plan, 2, model=, loss_fn=, args=, optimizer=)`, DDP-2 with "
        "`fs.estimate(None, 2, replicate=True, ...)`, in one process without a process "
        "group: the optimizer's own update runs on a meta state. Error = (estimate - "
        "measured) / measured. The GPTs: d 32, 2 blocks, vocab 97 (small) and d 128, 4 "
        "blocks, vocab 512; a decay mask and `partition` decay the matrices only; Muon "
        "takes the blocks' matrices, AdamW the rest.",
        f"- Date: {report.now()}\n- Command: `{report.command()}` ({took / 60:.1f} min)\n"
        f"- Machine: {report.machine()}",
        tabulate(table, HEADERS, "github"),
    ]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small GPT only: a check")
    parser.add_argument("--out", type=Path, help="folder of RESULTS.md (benchmarks/)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    print(" | ".join(HEADERS))
    table = rows(cases(args.quick))
    took = time.monotonic() - began
    print()
    print(tabulate(table, HEADERS))
    if args.quick and args.out is None:
        return  # a check: the committed figures stay
    out = args.out or Path(__file__).resolve().parent
    out.mkdir(parents=True, exist_ok=True)
    report.write_section(out / "RESULTS.md", "estimate-optim", markdown(table, took))
    print(f"wrote the estimate-optim section of {out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
