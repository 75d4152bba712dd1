"""`funcshard demo`: train a small character-level GPT, sharded over local ranks, and check it.

The text is the Python standard library's own source, which every machine with Python has,
so nothing is downloaded. Rank 0 shows progress and, at the end, a summary (loss, tokens/s,
peak live tensor memory per rank against one unsharded process, bytes sent per step), a
loss-curve PNG when matplotlib is installed, and a generated sample. Before training, the
first steps are replayed in one unsharded process and the losses must agree (fp32).
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn.functional as F
from tabulate import tabulate
from tqdm import tqdm

import funcshard as fs
from funcshard import testing
from funcshard.comm import _collectives as collectives
from funcshard.io import _checkpoint as checkpoint
from funcshard.testing.memory import LiveTensors
from funcshard.testing.models import GPT, Block, GPTConfig

PARITY_STEPS = 3


@dataclass(frozen=True)
class DemoConfig:
    """What the demo trains; the defaults fit a 2-core laptop in a few minutes."""

    nproc: int = 2
    steps: int = 300
    mode: str = "fsdp"  # fsdp | hsdp | replicate
    reshard_after_forward: bool = True
    mp: str | None = None  # "bf16" or None
    batch: int = 8  # sequences per rank
    block_size: int = 64
    d_model: int = 128
    n_layer: int = 4
    lr: float = 3e-3
    dropout: float = 0.0  # each rank draws its own masks (fs.manual_seed per rank and step)
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    resume: bool = False
    timeout: float = 60.0  # seconds a collective may wait for the other ranks
    plot: str | None = "demo_loss.png"


def stdlib_text(limit: int = 2_000_000) -> bytes:
    """Up to `limit` bytes of the standard library's Python sources, in a fixed order."""
    root = os.path.dirname(os.__file__)
    chunks, size = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


def batches(data: torch.Tensor, cfg: DemoConfig, step: int, rows: int, offset: int = 0):
    """The global batch of `step` (rows sequences), as (x, y) next-byte pairs."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(len(data) - cfg.block_size - 1, (rows,), generator=g)[offset:]
    windows = torch.stack([data[s : s + cfg.block_size + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def _mesh(cfg: DemoConfig) -> fs.Mesh:
    timeout = timedelta(seconds=cfg.timeout)
    if cfg.mode == "replicate":
        return fs.Mesh(replicate=cfg.nproc, timeout=timeout)
    if cfg.mode == "hsdp":
        if cfg.nproc % 2:
            raise ValueError(f"demo: --mode hsdp needs an even --nproc, got {cfg.nproc}")
        return fs.Mesh(replicate=2, shard=cfg.nproc // 2, timeout=timeout)
    return fs.Mesh(shard=cfg.nproc, timeout=timeout)


def model_config(cfg: DemoConfig) -> GPTConfig:
    return GPTConfig(
        vocab_size=256,
        block_size=cfg.block_size,
        n_layer=cfg.n_layer,
        n_head=4,
        d_model=cfg.d_model,
        dropout=cfg.dropout,
    )


def lm_loss(
    model: GPT,
    params: fs.ShardedState | Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    logits = fs.call(model, params, x).float()
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def train_rank(cfg: DemoConfig, rank: int) -> dict:
    """One rank's training; rank 0 returns the report."""
    data = torch.frombuffer(bytearray(stdlib_text()), dtype=torch.uint8).long()
    mesh = _mesh(cfg)
    with torch.device("meta"):
        model = GPT(model_config(cfg))
    mp = (
        fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.mp
        else None
    )
    with LiveTensors() as memory:
        if cfg.mode == "replicate":
            state = fs.replicate(model, mesh, comm_dtype=torch.bfloat16 if cfg.mp else None)
        else:
            plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
            state = fs.shard(
                model, plan, mesh, mp=mp, reshard_after_forward=cfg.reshard_after_forward
            )
        opt = fs.optim.chain(
            fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(cfg.lr, weight_decay=0.01)
        )
        opt_state = opt.init(state)
        start_step = 0
        if (
            cfg.resume
            and cfg.checkpoint_dir
            and os.path.exists(os.path.join(cfg.checkpoint_dir, checkpoint.LATEST))
        ):
            state, opt_state, start_step, _ = checkpoint.load(
                cfg.checkpoint_dir, like=(state, opt_state)
            )
            if rank == 0:
                print(f"resumed from step {start_step} ({cfg.checkpoint_dir})", flush=True)
        grad_fn = fs.value_and_grad(functools.partial(lm_loss, model))
        losses, sent, started = [], 0, time.perf_counter()
        bar = _progress_bar(cfg, start_step) if rank == 0 else None
        for step in range(start_step, cfg.steps):
            # the same global batch on every rank, each training on its part; each rank's
            # own dropout stream, a function of (seed, rank, step), so a resumed run draws
            # what an uninterrupted one would
            fs.manual_seed(cfg.seed, mesh, step)
            x, y = batches(data, cfg, step, cfg.batch * cfg.nproc)
            x, y = x.chunk(cfg.nproc)[rank], y.chunk(cfg.nproc)[rank]
            with collectives.record() as log:
                loss, grads = grad_fn(state, x, y)
                state, opt_state = opt.step(grads, opt_state, state)  # update and apply
            sent = collectives.bytes_sent(log)
            losses.append(_mean_over_ranks(loss, mesh))
            if bar is not None:
                _advance(bar, losses[-1], step + 1 - start_step, started, cfg)
            if cfg.checkpoint_dir and (
                (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps
            ):
                checkpoint.save(cfg.checkpoint_dir, state, opt_state, step=step + 1)
        elapsed = time.perf_counter() - started
        if bar is not None:
            bar.close()
    prompt = torch.tensor([list(b"def ")])
    every_rank_alike = torch.Generator().manual_seed(cfg.seed)  # greedy decoding loops
    sample = fs.call(
        model, state, prompt, 120, temperature=0.8, generator=every_rank_alike, method="generate"
    )
    return {
        "losses": losses,
        "start_step": start_step,
        "tokens_per_s": (cfg.steps - start_step) * _tokens_per_step(cfg) / elapsed,
        "peak_bytes": memory.peak,
        "sent_per_step": sent,
        "sample": bytes(sample[0].tolist()).decode("utf-8", "replace"),
    }


def _mean_over_ranks(loss: torch.Tensor, mesh: fs.Mesh) -> float:
    return collectives.all_reduce(loss.detach().reshape(1), mesh.group, "avg").wait().item()


def _tokens_per_step(cfg: DemoConfig) -> int:
    return cfg.batch * cfg.nproc * cfg.block_size


def _progress_bar(cfg: DemoConfig, start_step: int) -> tqdm:
    """Rank 0's bar: steps done, loss (mean over ranks) and tokens/s of all ranks together."""
    return tqdm(total=cfg.steps, initial=start_step, desc="training", unit="step", file=sys.stdout)


def _advance(bar: tqdm, loss: float, done: int, started: float, cfg: DemoConfig) -> None:
    rate = done * _tokens_per_step(cfg) / max(time.perf_counter() - started, 1e-9)
    bar.set_postfix(loss=f"{loss:.3f}", tokens_per_s=f"{rate:,.0f}", refresh=False)
    bar.update()


def parity_check(cfg: DemoConfig, reports: list[dict]) -> tuple[bool, float, int]:
    """Replay the first steps in one unsharded process on the whole batch and compare the
    losses (fp32); also returns that process's peak live tensor bytes."""
    # the same initialization as shard's meta path, on one rank of a 1-rank gloo group
    single, peak = testing.run(functools.partial(_single_process_losses, cfg), world_size=1)[0]
    ours = reports[0]["losses"][:PARITY_STEPS]
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, single, strict=True))
    return worst < 1e-4, worst, peak


def _single_process_losses(cfg: DemoConfig, rank: int) -> tuple[list[float], int]:
    one = DemoConfig(
        **{
            **cfg.__dict__,
            "nproc": 1,
            "mode": "fsdp",
            "mp": None,
            "steps": PARITY_STEPS,
            "checkpoint_dir": None,
            "resume": False,
        }
    )
    data = torch.frombuffer(bytearray(stdlib_text()), dtype=torch.uint8).long()
    with torch.device("meta"):
        model = GPT(model_config(one))
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=1)
    )
    # plain tensors: from here on, plain single-process training
    params = {k: v.clone().requires_grad_() for k, v in fs.unshard(state).items()}
    opt = fs.optim.chain(
        fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(one.lr, weight_decay=0.01)
    )
    opt_state = opt.init(params)
    losses: list[float] = []
    with LiveTensors() as memory:
        memory.adopt((params, opt_state))
        for step in range(PARITY_STEPS):
            loss, grads = _data_parallel_grads(model, params, data, cfg, step)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = fs.apply_updates(params, updates)
            losses.append(loss.item())
    return losses, memory.peak


def _data_parallel_grads(
    model: GPT, params: dict, data: torch.Tensor, cfg: DemoConfig, step: int
) -> tuple[torch.Tensor, dict]:
    """What `cfg.nproc` data-parallel ranks compute at `step`, in one process: each rank's
    part of the global batch, with that rank's dropout stream, loss and grads averaged."""
    x, y = batches(data, cfg, step, cfg.batch * cfg.nproc)
    grad_fn = fs.value_and_grad(functools.partial(lm_loss, model))
    results = []
    for rank, (xr, yr) in enumerate(zip(x.chunk(cfg.nproc), y.chunk(cfg.nproc), strict=True)):
        torch.manual_seed(fs.fold_in(cfg.seed, rank, step))
        results.append(grad_fn(params, xr, yr))
    losses, grads = zip(*results, strict=True)
    mean = torch.stack(losses).mean()
    return mean, {k: torch.stack([g[k] for g in grads]).mean(0) for k in grads[0]}


def unigram_baseline() -> float:
    """Cross-entropy (nats) of predicting each byte by its frequency: the bar to clear."""
    counts = torch.bincount(
        torch.frombuffer(bytearray(stdlib_text()), dtype=torch.uint8).long(), minlength=256
    ).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def report(cfg: DemoConfig, reports: list[dict], parity: tuple[bool | None, float, int]) -> str:
    r0 = reports[0]
    losses = r0["losses"]
    rows = [
        ["loss, first -> last", f"{losses[0]:.3f} -> {losses[-1]:.3f}"],
        ["unigram baseline", f"{unigram_baseline():.3f}"],
        ["tokens/s (all ranks)", f"{r0['tokens_per_s']:,.0f}"],
        ["peak live tensors per rank", f"{max(r['peak_bytes'] for r in reports) / 2**20:,.1f} MiB"],
        [
            "one unsharded process, whole batch",
            f"{parity[2] / 2**20:,.1f} MiB" if parity[2] else "not measured",
        ],
        ["sent per step per rank", f"{r0['sent_per_step'] / 2**20:,.2f} MiB"],
        ["parity with one unsharded process", _parity_text(parity)],
    ]
    return tabulate(rows, tablefmt="simple")


def _parity_text(parity: tuple[bool | None, float, int]) -> str:
    if parity[0] is None:
        return "skipped (a resumed or bf16 run has no fp32 single-process replay)"
    verdict = "passed" if parity[0] else "FAILED"
    return f"{verdict} (worst relative loss gap {parity[1]:.1e})"


def plot(losses: list[float], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses)
    ax.axhline(unigram_baseline(), linestyle="--", color="gray", label="unigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("funcshard demo: character-level GPT on the stdlib's source")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run(cfg: DemoConfig) -> int:
    """Train, check parity, report. Returns a process exit code."""
    print(f"funcshard demo: {cfg.mode} on {cfg.nproc} local gloo ranks, {cfg.steps} steps")
    try:
        reports = testing.run(
            functools.partial(train_rank, cfg), world_size=cfg.nproc, timeout=3600
        )
    except (testing.RankDied, fs.CollectiveError) as e:
        print(f"demo stopped: {str(e).splitlines()[0]}", file=sys.stderr)
        if cfg.checkpoint_dir:
            print(
                f"Run the same command with --resume to continue from the last checkpoint in "
                f"{cfg.checkpoint_dir}.",
                file=sys.stderr,
            )
        return 2
    parity = (
        parity_check(cfg, reports)
        if reports[0]["start_step"] == 0 and not cfg.mp
        else (None, 0.0, 0)  # resumed or bf16: no fp32 single-process replay to compare
    )
    print(report(cfg, reports, parity))
    if cfg.plot and (path := plot(reports[0]["losses"], cfg.plot)):
        print(f"loss curve: {path}")
    print(f"sample: {reports[0]['sample']!r}")
    return 1 if parity[0] is False else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    parser.add_argument("--nproc", type=int, default=d.nproc)
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch", type=int, default=d.batch, help="sequences per rank")
    parser.add_argument("--mode", choices=["fsdp", "hsdp", "replicate"], default=d.mode)
    parser.add_argument(
        "--reshard-after-forward", type=lambda s: s.lower() != "false", default=True
    )
    parser.add_argument("--mp", choices=["bf16"], default=None)
    parser.add_argument(
        "--dropout", type=float, default=d.dropout, help="each rank draws its own masks"
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="folded with rank and step")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--timeout", type=float, default=d.timeout, help="seconds a collective may wait"
    )
    parser.add_argument("--plot", default=d.plot)


def from_arguments(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(
        nproc=args.nproc,
        steps=args.steps,
        batch=args.batch,
        mode=args.mode,
        reshard_after_forward=args.reshard_after_forward,
        mp=args.mp,
        dropout=args.dropout,
        seed=args.seed,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        timeout=args.timeout,
        plot=args.plot,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(from_arguments(parser.parse_args())))
