"""Muon + AdamW: funcshard's owned placement and `whole_params` Muon vs FSDP2 + torch.optim.Muon.

    python -m benchmarks.muon [--world-sizes 2 4] [--rounds 8] [--fake] [--quick]
    python -m benchmarks.muon --state-bytes [--world-size 4]

The usual recipe: Muon on the blocks' matrices, AdamW on the rest (embeddings, norms,
biases), on a GPT (vocab 8192, d 384, 4 blocks, tied embedding) sharded per block and root.
funcshard: `fs.optim.partition({"muon": fs.optim.muon(...), "adamw": fs.optim.adamw(...)})`,
each matrix orthogonalized once per shard group, on its owner rank, in two placements:
"owned" (`fs.plan(..., placement={Block: "owned"})`: each block's parameters lie whole on
their owners, so `opt.step` sends nothing; the root stays even, since it holds no Muon
matrix and its embedding alone is over the owned bound at 4 ranks, or at 2 ranks its owner
would hold twice an even share) and "even" (flat shards; `whole_params` sends each matrix
to its owner and the update back, two all-to-alls). FSDP2: `fully_shard` per block and
root, `torch.optim.Muon` on the matrices (DTensors) and `torch.optim.AdamW` on the rest.
The same labels, learning rates and batch on all. A fourth row, the even placement with
plain AdamW everywhere, is the reference for bytes and memory only (not timed).

- Optimizer-step time: funcshard's `opt.step(grads, opt_state, params)` against FSDP2's
  `muon.step(); adamw.step()`, each after its own forward and backward (untimed), the ranks
  lined up by a barrier before the timed step; medians over rounds that rotate through the
  contenders, averaged over ranks. The whole training step (forward, backward, optimizer)
  is timed alongside.
- Peak live tensor bytes per rank of a whole training step (`LiveTensors`, op by op, a
  DTensor counted by its local shard), parameters, gradients and
  optimizer state included: the largest rank's peak over two steps after a first one that
  built the optimizer state (see `_peak_bytes`); the largest rank's and the mean.
- Bytes sent per training step (forward, backward, optimizer) by each rank, counted from
  the collectives actually issued (benchmarks/sent_bytes.py, [Note: counting the real
  sends]); the largest rank's and the mean over ranks (an owned unit's ranks send
  different amounts: each sends its own parameters, see [Note: owned placement]).
- `--fake`: the same optimizer steps on torch's fake process group (rank 0 of N, one
  process, one thread): collectives cost nothing and no rank shares a core, so what remains
  is one rank's own CPU work, timed as the thread's CPU time over 3x the rounds. The fake
  group's collectives return uninitialized buffers, so the numbers the math runs on are
  garbage; only the time means anything. A fourth row there, the floor: the Muon
  transform alone (momentum, Newton-Schulz, the move; one process's code on whole
  tensors, no funcshard around it) on the matrices rank 0 owns in the owned contender,
  timed in the same rotation: what the owned step cannot go below.
- `--state-bytes`: optimizer-state bytes per rank of the partition on an N-rank FSDP GPT,
  beside one process's torch.optim.Muon + AdamW state divided by N. Where `fs.optim.muon`
  does not exist (older funcshard), `sgd(lr, momentum=0.95)` stands in for it: the same state
  size, one momentum buffer per element; the stand-in is measured on the current code too.
"""

from __future__ import annotations

import argparse
import copy
import functools
import multiprocessing as mp
import random
import statistics
import time
import warnings
from dataclasses import dataclass

import optree
import torch
import torch.distributed as dist
from tabulate import tabulate

import funcshard as fs
from benchmarks.common import FSDP2, lm_loss, mib, ms, ratio
from benchmarks.sent_bytes import SentBytes
from funcshard import testing
from funcshard.optim._muon import muon_transform
from funcshard.testing.memory import LiveTensors
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

CFG = GPTConfig(vocab_size=8192, block_size=64, n_layer=4, n_head=6, d_model=384)
QUICK_CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=32)
MUON_LR, ADAMW_LR = 0.02, 3e-3
OWNED, EVEN, ADAMW = "owned + Muon", "even + whole_params Muon", "even + AdamW (reference)"
FLOOR = "owned: rank 0's Muon math alone (floor)"
CONTENDERS = (OWNED, EVEN, FSDP2)  # timed; ADAMW is metered only; FLOOR on the fake group only
METERED = (*CONTENDERS, ADAMW)
FAKE_ROUNDS = 3  # times the rounds on gloo: a fake round is cheap, and its median steadier


def label(fqn: str, p: torch.Tensor) -> str:
    """Muon for the blocks' matrices, AdamW for the embeddings and every vector."""
    return "muon" if p.ndim == 2 and not fqn.startswith(("wte", "wpe")) else "adamw"


@dataclass(frozen=True)
class MuonSpec:
    """One comparison: the model, the batch per rank, the rounds."""

    cfg: GPTConfig = CFG
    batch: int = 2  # sequences per rank
    rounds: int = 8
    warmup: int = 2
    memory_steps: int = 2  # steps inside the memory count, after a first one outside it

    def describe(self, where: str) -> str:
        c = self.cfg
        return (
            f"GPT d={c.d_model}, {c.n_layer} blocks, vocab {c.vocab_size} "
            f"({params(self.cfg)} params), {where}, batch {self.batch}x"
            f"{c.block_size} per rank, median of {self.rounds} interleaved rounds"
        )


def params(cfg: GPTConfig) -> str:
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(cfg).parameters())
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


class Contender:
    """A training step split in two: `grad` (forward and backward) and `step` (the
    optimizer); `held` is what lives between steps (parameters, optimizer state)."""

    def grad(self) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def held(self) -> object:
        raise NotImplementedError


class Funcshard(Contender):
    """funcshard: the GPT sharded per block and root, muon + adamw in a partition (or plain
    AdamW, `muon=False`), the blocks in `placement`."""

    def __init__(
        self,
        model: GPT,
        mesh: fs.Mesh,
        x: torch.Tensor,
        y: torch.Tensor,
        placement: str = "even",
        muon: bool = True,
    ) -> None:
        self.model = model
        policy = fs.policy.module_classes({Block})
        plan = fs.plan(model, policy, placement={Block: placement})
        self.state = fs.shard(model, plan, mesh)
        if muon:
            groups = {"muon": fs.optim.muon(MUON_LR), "adamw": fs.optim.adamw(ADAMW_LR)}
            self.opt = fs.optim.partition(groups, label)
        else:
            self.opt = fs.optim.adamw(ADAMW_LR)
        self.opt_state = self.opt.init(self.state)
        self.x, self.y = x, y
        self.grads = None
        self._grad = fs.value_and_grad(self._loss)

    def _loss(self, state: fs.ShardedState) -> torch.Tensor:
        return lm_loss(fs.call(self.model, state, self.x), self.y)

    def grad(self) -> None:
        _, self.grads = self._grad(self.state)

    def step(self) -> None:
        grads, self.grads = self.grads, None
        self.state, self.opt_state = self.opt.step(grads, self.opt_state, self.state)

    def held(self) -> object:
        return (self.state, self.opt_state)


class Fsdp2(Contender):
    """FSDP2: fully_shard per block and root; torch.optim.Muon on the matrices (DTensors),
    torch.optim.AdamW on the rest."""

    def __init__(self, model: GPT, mesh: object, x: torch.Tensor, y: torch.Tensor) -> None:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        named = dict(model.named_parameters())
        muon = [p for f, p in named.items() if label(f, p) == "muon"]
        rest = [p for f, p in named.items() if label(f, p) != "muon"]
        self.muon = torch.optim.Muon(muon, lr=MUON_LR)
        self.adamw = torch.optim.AdamW(rest, lr=ADAMW_LR)
        self.x, self.y = x, y

    def grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        lm_loss(self.model(self.x), self.y).backward()

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def held(self) -> object:
        held = list(self.model.parameters())
        for opt in (self.muon, self.adamw):
            held += [t for s in opt.state.values() for t in s.values()]
        return held


class Floor(Contender):
    """The floor of the owned contender's optimizer step: `muon_transform` alone on the
    matrices this rank owns there, whole, as one process's dicts (fresh random gradients),
    with nothing of funcshard's around it (no partition, no AdamW on the rest)."""

    def __init__(self, owned: Funcshard) -> None:
        mine = owned.opt_state.states["muon"].states  # this rank's Owned keys
        named = dict(owned.model.named_parameters())
        g = torch.Generator().manual_seed(1)
        self.params = {f: named[f].detach().clone() for f in mine}
        self.grads = {f: torch.randn(p.shape, generator=g) for f, p in self.params.items()}
        self.opt = muon_transform(MUON_LR)
        self.state = self.opt.init(self.params)

    def grad(self) -> None:
        pass

    def step(self) -> None:
        grads = {f: g.clone() for f, g in self.grads.items()}  # the step may write them
        _, self.state = self.opt.update(grads, self.state, self.params, donate=True)

    def held(self) -> object:
        return (self.params, self.state)


def _builders(spec: MuonSpec, world: int, x: torch.Tensor, y: torch.Tensor, model: GPT):
    """The timed contenders and, last, the AdamW reference (metered only)."""
    from torch.distributed.device_mesh import init_device_mesh

    def funcshard(placement: str, muon: bool = True):
        mesh = fs.Mesh(shard=world)
        return lambda: Funcshard(copy.deepcopy(model), mesh, x, y, placement, muon)

    return {
        OWNED: funcshard("owned"),
        EVEN: funcshard("even"),
        FSDP2: lambda: Fsdp2(copy.deepcopy(model), init_device_mesh("cpu", (world,)), x, y),
        ADAMW: funcshard("even", muon=False),
    }


def _metered(build, steps: int) -> tuple[int, int]:
    """`_peak_bytes`, then the bytes this rank sends in one more training step."""
    contender = build()
    peak = _peak_bytes(contender, steps)
    with SentBytes() as sent:
        contender.grad()
        contender.step()
    return peak, sent.bytes


def _peak_bytes(contender: Contender, steps: int) -> int:
    """Peak live tensor bytes of `steps` whole training steps, after one that built the
    optimizer state. The count starts before that first step, with the parameters (and
    any optimizer state) adopted, so that what the first step makes and later steps reuse
    is counted too: FSDP2's unsharded parameters live in storages it resizes to zero
    after use and back before the next, which a count started later would never see."""
    with LiveTensors() as meter:
        meter.adopt(contender.held())
        contender.grad()
        contender.step()
        meter.peak = meter.live  # the first step (lazy initialization, state) not counted
        for _ in range(steps):
            contender.grad()
            contender.step()
    return meter.peak


def _timed(
    contenders: dict[str, Contender], warmup: int, rounds: int, barrier, clock=time.perf_counter
) -> dict[str, dict[str, list[float]]]:
    """Optimizer-step and whole-step times of each contender, rounds in a seeded rotation,
    read on `clock` (wall time by default)."""
    for c in contenders.values():
        for _ in range(warmup):
            c.grad()
            c.step()
    order = random.Random(0)
    names = list(contenders)
    times = {n: {"step": [], "train": []} for n in names}
    for _ in range(rounds):
        order.shuffle(names)
        for n in names:
            barrier()
            start = clock()
            contenders[n].grad()
            barrier()
            middle = clock()
            contenders[n].step()
            end = clock()
            times[n]["step"].append(end - middle)
            times[n]["train"].append(end - start)
    return times


def _rank(spec: MuonSpec, rank: int) -> dict:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(spec.cfg)
    x, y = random_tokens(spec.cfg, spec.batch, seed=rank)
    builders = _builders(spec, world, x, y, model)
    metered = {n: _metered(b, spec.memory_steps) for n, b in builders.items()}
    contenders = {n: builders[n]() for n in CONTENDERS}
    times = _timed(contenders, spec.warmup, spec.rounds, dist.barrier)
    return {
        "peaks": {n: peak for n, (peak, _) in metered.items()},
        "sent": {n: sent for n, (_, sent) in metered.items()},
        "times": times,
    }


@dataclass(frozen=True)
class MuonResult:
    """One world size on gloo: times averaged over ranks; peaks (largest rank's and mean)
    and bytes sent per step (largest rank's) of the contenders and the AdamW reference."""

    world_size: int
    step: dict[str, float]  # seconds, optimizer step
    train: dict[str, float]  # seconds, forward + backward + optimizer
    peaks: dict[str, int]
    mean_peaks: dict[str, float]
    sent: dict[str, int]
    mean_sent: dict[str, float]


def measure(spec: MuonSpec, world_size: int) -> MuonResult:
    results = testing.run(functools.partial(_rank, spec), world_size=world_size, timeout=3600)

    def median(n: str, what: str) -> float:
        return statistics.mean(statistics.median(r["times"][n][what]) for r in results)

    return MuonResult(
        world_size,
        step={n: median(n, "step") for n in CONTENDERS},
        train={n: median(n, "train") for n in CONTENDERS},
        peaks={n: max(r["peaks"][n] for r in results) for n in METERED},
        mean_peaks={n: statistics.mean(r["peaks"][n] for r in results) for n in METERED},
        sent={n: max(r["sent"][n] for r in results) for n in METERED},
        mean_sent={n: statistics.mean(r["sent"][n] for r in results) for n in METERED},
    )


def _cell(values: dict[str, float], name: str, show) -> str:
    return show(values[name]) if name in values else ""


def table(
    results: list[MuonResult], fake: dict[int, dict[str, float]] | None = None, fmt: str = "simple"
) -> str:
    """One row per world size and contender: gloo's times, the fake group's optimizer step
    (and its ratio to FSDP2's), peaks and bytes sent; the AdamW reference row is metered
    only, the floor row (fake group) timed only."""
    rows = []
    for r in results:
        f = (fake or {}).get(r.world_size, {})
        for n in METERED:
            rows.append(
                [
                    r.world_size,
                    n,
                    _cell(r.step, n, ms),
                    _cell(f, n, ms),
                    ratio(f[n], f[FSDP2]) if n in f else "",
                    _cell(r.train, n, ms),
                    mib(r.peaks[n]),
                    mib(int(r.mean_peaks[n])),
                    mib(r.sent[n]),
                    mib(int(r.mean_sent[n])),
                ]
            )
        if FLOOR in f:
            row = ["", ms(f[FLOOR]), ratio(f[FLOOR], f[FSDP2]), "", "", "", "", ""]
            rows.append([r.world_size, FLOOR, *row])
    headers = [
        "ranks",
        "contender",
        "opt step ms: gloo",
        "fake",
        "fake vs FSDP2",
        "train step ms: gloo",
        "peak MiB/rank: max",
        "mean",
        "MiB sent/step: max",
        "mean",
    ]
    return tabulate(rows, headers, fmt, disable_numparse=True)


def goals(results: list[MuonResult], fake: dict[int, dict[str, float]] | None = None) -> str:
    """The issue's three goals at the largest world size, as measured (met or not)."""
    r = max(results, key=lambda r: r.world_size)
    f = (fake or {}).get(r.world_size)
    lines = [f"Goals at {r.world_size} ranks (owned + Muon):"]
    if f:
        got = f[OWNED] / f[FSDP2]
        lines.append(f"- opt step vs FSDP2's, fake group: {got:.2f}x (goal <= 0.25x)")
        if FLOOR in f:
            floor = f[FLOOR] / f[FSDP2]
            lines.append(f"  its floor (rank 0's Muon math alone) vs FSDP2's: {floor:.2f}x")
    got = r.sent[OWNED] / r.sent[ADAMW]
    mean = r.mean_sent[OWNED] / r.mean_sent[ADAMW]
    lines.append(
        f"- bytes sent per step vs even + AdamW: {got:.2f}x, largest rank's (goal <= 1.00x); "
        f"{mean:.2f}x, mean over ranks"
    )
    got = r.peaks[OWNED] / r.peaks[EVEN]
    lines.append(f"- peak per rank (max) vs even + whole_params: {got:.2f}x (goal <= 1.10x)")
    return "\n".join(lines)


def _fake(spec: MuonSpec, world_size: int) -> dict[str, float]:
    """Median optimizer-step seconds of rank 0 on a fake group of `world_size`, in the
    thread's CPU time: the step runs on this one thread (one intra-op thread, collectives
    that do nothing), so its CPU time is its wall time on an idle core, and a machine
    shared with other jobs preempting it does not count against either contender."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # the fake group's buffers are garbage: never mind them
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = GPT(spec.cfg)
        x, y = random_tokens(spec.cfg, spec.batch, seed=0)
        builders = _builders(spec, world_size, x, y, model)
        contenders: dict[str, Contender] = {n: builders[n]() for n in CONTENDERS}
        assert isinstance(contenders[OWNED], Funcshard)
        contenders[FLOOR] = Floor(contenders[OWNED])
        times = _timed(
            contenders, spec.warmup, spec.rounds * FAKE_ROUNDS, lambda: None, time.thread_time
        )
        return {n: statistics.median(t["step"]) for n, t in times.items()}
    finally:
        dist.destroy_process_group()


def measure_fake(spec: MuonSpec, world_size: int) -> dict[str, float]:
    """`_fake` in a fresh spawned process (the fake group is the process's default group)."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_fake, (spec, world_size))


# -- optimizer-state bytes ---------------------------------------------------------------


def _nbytes(tree: object) -> int:
    leaves = optree.tree_leaves(tree, none_is_leaf=False)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _partitions() -> dict[str, object]:
    adamw = fs.optim.adamw(ADAMW_LR)
    out = {}
    if hasattr(fs.optim, "muon"):
        out["muon + adamw"] = {"muon": fs.optim.muon(MUON_LR), "adamw": adamw}
    out["sgd(momentum=0.95) + adamw (stand-in)"] = {
        "muon": fs.optim.sgd(MUON_LR, momentum=0.95),
        "adamw": adamw,
    }
    return out


def _state_rank(cfg: GPTConfig, rank: int) -> dict[str, int]:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(cfg)
    state = fs.shard(model, fs.plan(model, fs.policy.module_classes({Block})), fs.Mesh(shard=world))
    return {
        name: _nbytes(fs.optim.partition(groups, label).init(state))
        for name, groups in _partitions().items()
    }


def _torch_state_bytes(cfg: GPTConfig) -> int:
    """torch.optim.Muon + AdamW's state after one step, one process."""
    torch.manual_seed(0)
    model = GPT(cfg)
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([p for f, p in named.items() if label(f, p) == "muon"], lr=MUON_LR)
    adamw = torch.optim.AdamW([p for f, p in named.items() if label(f, p) != "muon"])
    x, y = random_tokens(cfg, 2, seed=0)
    lm_loss(model(x), y).backward()
    muon.step()
    adamw.step()
    states = [*muon.state.values(), *adamw.state.values()]
    return _nbytes([list(s.values()) for s in states])


def state_bytes(cfg: GPTConfig, world_size: int) -> str:
    results = testing.run(functools.partial(_state_rank, cfg), world_size=world_size)
    reference = _torch_state_bytes(cfg) / world_size
    rows = [[f"torch.optim, one process / {world_size}", mib(int(reference)), "1.00x", ""]]
    for name in results[0]:
        per_rank = [r[name] for r in results]
        rows.append(
            [
                f"funcshard {name}",
                mib(max(per_rank)),
                ratio(max(per_rank), reference),
                " ".join(mib(b) for b in per_rank),
            ]
        )
    headers = ["optimizer state", "MiB/rank (largest)", "vs torch.optim / N", "per rank"]
    return tabulate(rows, headers, "github")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=MuonSpec.rounds)
    parser.add_argument("--fake", action="store_true", help="also on the fake group")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks, not figures")
    parser.add_argument("--state-bytes", action="store_true", help="optimizer state only")
    parser.add_argument("--world-size", type=int, default=4, help="for --state-bytes")
    args = parser.parse_args(argv)
    spec = MuonSpec(rounds=args.rounds)
    if args.quick:
        spec = MuonSpec(cfg=QUICK_CFG, rounds=min(args.rounds, 2), warmup=1, memory_steps=1)
    if args.state_bytes:
        print(f"Optimizer state, GPT {params(spec.cfg)} params, FSDP on {args.world_size} ranks")
        print(state_bytes(spec.cfg, args.world_size))
        return
    results = []
    for w in args.world_sizes:
        results.append(measure(spec, w))
        print(f"  {w} gloo ranks done", flush=True)
    fake = {w: measure_fake(spec, w) for w in args.world_sizes} if args.fake else None
    sizes = " and ".join(map(str, args.world_sizes))
    print(spec.describe(f"{sizes} gloo ranks"))
    if fake:
        print(f"fake group: rank 0, one thread, its CPU time, {spec.rounds * FAKE_ROUNDS} rounds")
    print(table(results, fake, "github"))
    print(goals(results, fake))


if __name__ == "__main__":
    main()
