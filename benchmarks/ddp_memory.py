"""Where a DDP step's memory goes: plain PyTorch, torch DDP and `fs.replicate`, phase by phase.

    python -m benchmarks.ddp_memory [--layers 4] [--d-model 128] [--batch 8] [--detail]

Live tensor bytes (`funcshard.testing.memory.LiveTensors`) of a GPT's training step with
AdamW, the second step (the optimizer state exists), phase by phase: the peak of each phase
and what was live at its end. The contenders: one plain process (`loss.backward`,
`torch.optim.AdamW`), torch's DistributedDataParallel and `fs.replicate` on 2 gloo ranks
(rank 0's figures), the last in the forms a user writes: `opt.update` + `fs.apply_updates`
with the loop's names `grads` and `updates` kept until the next step rebinds them (a
script's top-level loop, README's), the same with `del grads, updates`, `opt.step` (which
donates), and `opt.step` with `comm_dtype=torch.bfloat16`. `--detail` breaks each phase's
peak down by what held the bytes: the state and optimizer state held before the step, then
every other storage by the phase and the op that made it. The defaults are the demo's GPT
(`funcshard demo`, examples/train_gpt.py): vocab 256, 64 tokens, 4 blocks of d 128, batch 8.
"""

from __future__ import annotations

import argparse
import functools
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from tabulate import tabulate

import funcshard as fs
from funcshard import testing
from funcshard.testing.memory import LiveTensors
from funcshard.testing.models import GPT, GPTConfig, random_tokens

MIB = 2**20
KEPT, DELETED, STEP, STEP_BF16 = (
    "update+apply",
    "update+apply, del",
    "opt.step",
    "opt.step, bf16 comm",
)
FORMS = (KEPT, DELETED, STEP, STEP_BF16)
PHASES = ("forward", "backward", "update", "apply_updates", "optimizer")


class Ledger(LiveTensors):
    """LiveTensors that labels each storage with the phase and op that made it, and keeps
    each phase's peak, what was live then and at the phase's end."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: dict[int, str] = {}
        self.phase = ""
        self.op = ""
        self.window_peak = 0
        self.at_peak: Counter[str] = Counter()
        self.phases: dict[str, dict[str, Any]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.op = str(func).removeprefix("aten.").removesuffix(".default")
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._note()
        return out

    def _track(self, tensor: torch.Tensor, watched: bool) -> None:
        super()._track(tensor, watched)
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return
        self.labels.setdefault(key, f"{self.phase}: {self.op}")

    def _release(self, ptr: int, tensor_id: int) -> None:
        super()._release(ptr, tensor_id)
        if ptr not in self._users:
            self.labels.pop(ptr, None)

    def _note(self) -> None:
        if self.live > self.window_peak:
            self.window_peak = self.live
            self.at_peak = self.breakdown()

    def breakdown(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for key, nbytes in self._bytes.items():
            out[self.labels.get(key, "?")] += nbytes
        return out

    def hold(self, tree: Any, label: str) -> None:
        """Count tensors made before the step (the state, the optimizer state) as `label`."""
        for t in torch.utils._pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                self._track(t, watched=False)
                self.labels[t.untyped_storage()._cdata] = label
        self._note()

    def begin(self, phase: str) -> None:
        """End the current phase (recording it) and start `phase`."""
        self._note()
        if self.phase:
            self.phases[self.phase] = {
                "peak": self.window_peak,
                "end": self.live,
                "at_peak": dict(self.at_peak),
            }
        self.phase = phase
        self.window_peak = self.live
        self.at_peak = self.breakdown()


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _torch_rank(cfg: GPTConfig, batch: int, steps: int, ddp: bool, rank: int) -> dict:
    """Plain PyTorch (or torch DDP over the default group): zero_grad, forward, backward,
    optimizer step."""
    torch.manual_seed(0)
    model: torch.nn.Module = GPT(cfg)
    x, y = random_tokens(cfg, batch, seed=rank)
    ledger = Ledger()
    with ledger:
        ledger.hold(list(model.parameters()), "params")
        if ddp:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(steps):
            ledger.begin(f"{step}.zero_grad")
            opt.zero_grad(set_to_none=True)
            ledger.begin(f"{step}.forward")
            loss = _loss(model(x), y)
            ledger.begin(f"{step}.backward")
            loss.backward()
            del loss
            ledger.begin(f"{step}.optimizer")
            opt.step()
        ledger.begin("end")
    return ledger.phases


def _replicate_rank(cfg: GPTConfig, batch: int, steps: int, form: str, rank: int) -> dict:
    """fs.replicate in one of FORMS."""
    with torch.device("meta"):
        model = GPT(cfg)
    comm_dtype = torch.bfloat16 if form == STEP_BF16 else None
    state = fs.replicate(model, fs.Mesh(replicate=2), comm_dtype=comm_dtype)
    opt = fs.optim.adamw(1e-3)
    opt_state = opt.init(state)
    x, y = random_tokens(cfg, batch, seed=rank)
    ledger = Ledger()

    def loss_fn(s: fs.ShardedState) -> torch.Tensor:
        loss = _loss(fs.call(model, s, x), y)
        ledger.begin(f"{ledger.phase.split('.')[0]}.backward")  # forward ends here
        return loss

    grad_fn = fs.value_and_grad(loss_fn)
    with ledger:
        ledger.hold(state, "params")
        ledger.hold(opt_state, "optimizer state")
        for step in range(steps):
            ledger.begin(f"{step}.forward")
            _, grads = grad_fn(state)
            if form in (STEP, STEP_BF16):
                ledger.begin(f"{step}.optimizer")
                state, opt_state = opt.step(grads, opt_state, state)
                continue
            ledger.begin(f"{step}.update")
            updates, opt_state = opt.update(grads, opt_state, state)
            ledger.begin(f"{step}.apply_updates")
            state = fs.apply_updates(state, updates)
            if form == DELETED:
                del grads, updates
        ledger.begin("end")
    return ledger.phases


def measure(cfg: GPTConfig, batch: int, steps: int = 2, forms=FORMS) -> dict[str, dict]:
    """Each contender's phases (rank 0's), keyed `step.phase`."""
    out = {
        "plain (1 process)": testing.run(
            functools.partial(_torch_rank, cfg, batch, steps, False), world_size=1, timeout=600
        )[0]
    }
    out["torch DDP"] = testing.run(
        functools.partial(_torch_rank, cfg, batch, steps, True), world_size=2, timeout=600
    )[0]
    for form in forms:
        out[f"replicate, {form}"] = testing.run(
            functools.partial(_replicate_rank, cfg, batch, steps, form), world_size=2, timeout=600
        )[0]
    return out


def table(results: dict[str, dict], step: int, params_bytes: int) -> str:
    """Peak MiB per phase of `step` (and in units of the parameters' bytes P), per contender."""
    rows = []
    for phase in PHASES:
        cells = []
        for phases in results.values():
            p = phases.get(f"{step}.{phase}")
            cells.append(
                "" if p is None else f"{p['peak'] / MIB:.1f} ({p['peak'] / params_bytes:.1f}P)"
            )
        if any(cells):
            rows.append([phase, *cells])
    rows.append(
        [
            "step peak",
            *(
                f"{max(p['peak'] for k, p in phases.items() if k.startswith(f'{step}.')) / MIB:.1f}"
                for phases in results.values()
            ),
        ]
    )
    return tabulate(rows, headers=["peak MiB", *results], tablefmt="simple")


def detail(results: dict[str, dict], step: int) -> str:
    """What held each phase's peak, largest first (entries of at least 1% of it)."""
    lines = []
    for name, phases in results.items():
        lines.append(f"\n{name}, step {step}:")
        for key, p in phases.items():
            if not key.startswith(f"{step}."):
                continue
            lines.append(f"  {key:<16} peak {p['peak'] / MIB:7.2f} MiB, end {p['end'] / MIB:7.2f}")
            for label, nbytes in sorted(p["at_peak"].items(), key=lambda kv: -kv[1]):
                if nbytes >= 0.01 * p["peak"]:
                    lines.append(f"      {nbytes / MIB:7.2f}  {label}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=2, help="the last one is shown")
    parser.add_argument("--forms", nargs="*", default=list(FORMS), choices=FORMS)
    parser.add_argument("--detail", action="store_true")
    args = parser.parse_args()
    cfg = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.block_size,
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
    )
    params_bytes = sum(p.numel() * 4 for p in GPT(cfg).parameters())
    results = measure(cfg, args.batch, args.steps, tuple(args.forms))
    last = args.steps - 1
    print(
        f"GPT {params_bytes / 4 / 1e6:.2f}M params (P = {params_bytes / MIB:.2f} MiB fp32), "
        f"batch {args.batch}x{args.block_size} per rank, step {last}, rank 0"
    )
    print(table(results, last, params_bytes))
    if args.detail:
        print(detail(results, last))


if __name__ == "__main__":
    main()
