"""Shared pieces of the benchmarks: names, timing, data and the training steps compared."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import funcshard as fs
from funcshard.testing.models import GPT, Block, GPTConfig

# The contenders, named alike in every benchmark, table and plot.
FUNCSHARD = "funcshard"
REPLICATE = "funcshard replicate"  # funcshard's functional DDP
FSDP2 = "FSDP2"
DDP = "DDP"
PLAIN = "plain (1 process)"


def ratio(a: float, b: float) -> str:
    """`a / b` as it appears in the tables, e.g. `0.73x`."""
    return f"{a / b:.2f}x"


def ms(seconds: float) -> str:
    """Milliseconds to three or so significant digits: `447`, `53.3`, `0.42`."""
    return _digits(seconds * 1e3)


def mib(nbytes: int) -> str:
    """Mebibytes to three or so significant digits."""
    return _digits(nbytes / 2**20)


def _digits(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def interleaved_medians(
    steps: dict[str, Callable[[], object]], warmup: int, rounds: int
) -> dict[str, float]:
    """Median wall time of each step, timed in rotation (see `interleaved_samples`)."""
    samples = interleaved_samples(steps, warmup, rounds)
    return {name: statistics.median(t) for name, t in samples.items()}


def interleaved_samples(
    steps: dict[str, Callable[[], object]], warmup: int, rounds: int, settle: int = 0, seed: int = 0
) -> dict[str, list[float]]:
    """Every wall time of each step, timed in rounds that run every step once.

    Interleaving makes slow drifts of a shared machine hit every contender alike, so the
    ratios hold even when the absolute times wander. Each round runs the steps in a fresh
    seeded order, and with `settle`, each timed step follows that many untimed ones of the
    same contender, as in a training loop: the timed step finds the caches warm with its own
    code and data and meets the garbage collections its own allocations trigger, not those
    of the contender before it (on small models those effects dwarf the differences).
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    order = random.Random(seed)
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        order.shuffle(names)
        for name in names:
            for _ in range(settle):
                steps[name]()
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def plain_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Loss = lm_loss
) -> Callable[[], None]:
    """A single-process PyTorch training step (AdamW), the baseline."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        opt.step()

    return step


def funcshard_step(
    cfg: GPTConfig,
    mesh: fs.Mesh,
    x: torch.Tensor,
    y: torch.Tensor,
    replicate: bool = False,
    **options: object,
) -> Callable[[], None]:
    """funcshard's step on a GPT of `cfg` (see `sharded_step`)."""
    return sharded_step(lambda: GPT(cfg), Block, mesh, x, y, replicate=replicate, **options)


def sharded_step(
    build: Callable[[], nn.Module],
    unit: type[nn.Module],
    mesh: fs.Mesh,
    x: torch.Tensor,
    y: torch.Tensor,
    loss: Loss = lm_loss,
    replicate: bool = False,
    fused: bool = True,
    **options: object,
) -> Callable[[], None]:
    """funcshard's step: a meta-built model sharded straight into local shards, one unit per
    `unit` module (or, with `replicate`, held whole on every rank with bucketed all-reduce:
    functional DDP), and AdamW: `opt.step` (`fused`) or `opt.update` then `apply_updates`."""
    with torch.device("meta"):
        model = build()
    if replicate:
        state = fs.replicate(model, mesh, **options)
    else:
        state = fs.shard(
            model, fs.plan(model, policy=fs.policy.module_classes({unit})), mesh, **options
        )
    box = {"state": state}
    opt = fs.optim.adamw(1e-3)
    box["opt"] = opt.init(box["state"])

    def loss_fn(state: fs.ShardedState) -> torch.Tensor:
        return loss(fs.call(model, state, x), y)

    grad_fn = fs.value_and_grad(loss_fn)

    def step() -> None:
        _, grads = grad_fn(box["state"])
        box["state"], box["opt"] = opt.step(grads, box["opt"], box["state"])  # all donated

    def update_and_apply() -> None:
        _, grads = grad_fn(box["state"])
        updates, box["opt"] = opt.update(grads, box["opt"], box["state"])
        box["state"] = fs.optim.apply_updates(box["state"], updates)

    return step if fused else update_and_apply


def fsdp2_step(
    model: nn.Module, mesh: object, x: torch.Tensor, y: torch.Tensor, loss: Loss = lm_loss
) -> Callable[[], None]:
    """FSDP2: fully_shard on every block and the root, the way its docs apply it."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return plain_step(model, x, y, loss)


def ddp_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss: Loss = lm_loss,
    comm_hook: Callable | None = None,
) -> Callable[[], None]:
    """DistributedDataParallel over the default process group (with `comm_hook`, if given)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    if comm_hook is not None:
        ddp.register_comm_hook(None, comm_hook)
    return plain_step(ddp, x, y, loss)
