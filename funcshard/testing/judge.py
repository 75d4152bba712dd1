"""Judge what the ranks observed (funcshard/testing/laws.py) against each law, in the parent.

Each `judge_<law>` takes the observations of one configuration, every rank's, and returns
its `LawResult`. Most laws are exact (bitwise, or by count); parity has tolerances (see
`Bounds`) and reports the worst error against them, a tensor's error measured leaf by leaf as
max |a - b| / max |b|, relative to the leaf's scale (elementwise relative errors blow up on
entries that are zero in one run and 1e-9 in the other).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from funcshard.testing.harness import Case, Config, PhaseFailed
from funcshard.testing.report import FAIL, NOT_RUN, PASS, LawResult


@dataclass(frozen=True)
class Bounds:
    """Tolerances of one comparison: `loss` relative; `tensor` on max |a - b| / max(max |b|,
    `floor`), relative to the leaf's scale, or absolute below `floor`."""

    loss: float
    tensor: float
    floor: float = 0.0


def bounds(config: Config, lr: float, steps: int, across: bool = False) -> Bounds:
    """The tolerances of parity over `steps` optimizer steps at rate `lr`.

    fp32: 1e-5 against one process (roundoff grows to ~1e-6 over a few AdamW steps, DESIGN.md
    §10 item 4), 1e-6 `across` world sizes (the same numbers summed in another order; per
    micro-batch for the weights, which sum in more partial sums with accumulation). With
    bf16 or fp16 gathers the reference computes in the same dtype on fp32 master weights (see
    funcshard/testing/reference.py), so what differs is where the rounding happens (each
    rank's gradient rounded before the fp32 reduce, against the whole batch's): the losses
    within 2e-3 relative, each weight within 2e-3 of max(its largest value, 1) (a gradient
    near zero can change sign under rounding, and AdamW then moves that weight about lr the
    other way), and each weight's update judged on its own (`MP_UPDATE_TOLERANCE`).
    """
    if config.mp is None and across:  # accumulation adds partial sums in another grouping
        return Bounds(1e-6, 1e-6 * config.micro_batches)
    if config.mp is None:
        return Bounds(1e-5, 1e-5)
    return Bounds(2e-3, 2e-3, floor=1.0)


# With low-precision gathers each parameter's total update (final - first) must be within
# this fraction of the reference's, in L2 norm: a wrong or sign-flipped gradient moves the
# weights the other way and fails it, where a bound on the weights themselves cannot (AdamW
# moves every weight about lr a step whatever its gradient).
MP_UPDATE_TOLERANCE = 0.25


def update_error(ours: Tensor, theirs: Tensor, first: Tensor) -> float:
    """|(ours - first) - (theirs - first)| / |theirs - first| in L2 norm (absolute when the
    reference did not move)."""
    moved = theirs.detach().double() - first.detach().double()
    diff = (ours.detach().double() - theirs.detach().double()).norm().item()
    scale = moved.norm().item()
    return diff / scale if scale > 0 else diff


def judge(
    case: Case,
    config: Config,
    observed: list[dict[str, Any]] | PhaseFailed,
    resumed: list[dict[str, Any]] | PhaseFailed | None,
) -> list[LawResult]:
    """Every law asked for, on one configuration."""
    if isinstance(observed, PhaseFailed):
        return [_raised(config, law, observed, "", case.laws) for law in case.laws]
    results = []
    for law in case.laws:
        if isinstance(resumed, PhaseFailed) and law in (resumed.law, "checkpoint"):
            where = f"at {config.resume_world} ranks: "
            results.append(_raised(config, law, resumed, where, case.laws))
        elif law == "checkpoint" and resumed is None:
            results.append(LawResult(law, config, NOT_RUN, detail="nothing to resume"))
        else:
            results.append(_JUDGES[law](case, config, observed, resumed))
    return results


def _raised(
    config: Config, law: str, error: PhaseFailed, where: str, asked: tuple[str, ...]
) -> LawResult:
    """A law's result when a phase raised: a failure of the law whose phase it was, or, when
    that law was not asked for, of the first law asked for (a configuration that crashed
    never passes); the others did not run."""
    if error.law == law:
        return LawResult(law, config, FAIL, detail=where + error.message)
    if error.law not in asked and law == asked[0]:
        detail = f"{where}{error.law} failed first: {error.message}"
        return LawResult(law, config, FAIL, detail=detail)
    return LawResult(law, config, NOT_RUN, detail=f"not run: {error.law} failed first")


def _result(law: str, config: Config, problems: list[str], what: str) -> LawResult:
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        return LawResult(law, config, FAIL, detail="; ".join(problems[:3]) + more)
    return LawResult(law, config, PASS, detail=what)


def judge_round_trip(case: Case, config: Config, observed: list, resumed: Any) -> LawResult:
    """Every rank's round trip (shard, unshard, reshard) held bitwise, padding zero."""
    problems = [f"rank {r}: {p}" for r, o in enumerate(observed) for p in o["round_trip"]]
    return _result("round_trip", config, problems, "reshard(unshard(state)) bitwise, padding 0")


def judge_parity(case: Case, config: Config, observed: list, resumed: Any) -> LawResult:
    """Losses, parameters and buffers against the one-process reference, and a run resumed
    at another world size against the uninterrupted one (see `bounds`)."""
    reference = observed[0]["reference"]
    if isinstance(reference, str):
        detail = f"the one-process reference raised {reference}"
        return LawResult("parity", config, FAIL, detail=detail)
    batch_stats = observed[0]["batch_stats"]
    limits = bounds(config, case.lr, case.steps)
    worst = _Worst()
    for step, (ours, theirs) in enumerate(
        zip(observed[0]["run"]["losses"], reference["losses"], strict=True)
    ):
        worst.add(_relative(ours, theirs), limits.loss, f"the loss of step {step}")
    for rank, o in enumerate(observed):
        if config.mp is not None:
            for fqn, v in reference["final"].items():
                error = update_error(o["run"]["final"][fqn], v, reference["first"][fqn])
                worst.add(error, MP_UPDATE_TOLERANCE, f"the update of {fqn} on rank {rank}")
            pairs = [(fqn, o["run"]["final"][fqn], v) for fqn, v in reference["final"].items()]
        else:
            pairs = [(fqn, o["run"]["final"][fqn], v) for fqn, v in reference["final"].items()]
        buffers = reference["buffers"][rank if len(reference["buffers"]) > 1 else 0]
        pairs += [(f"buffer {k}", o["run"]["buffers"][k], v) for k, v in buffers.items()]
        for name, ours, theirs in pairs:
            error = tensor_error(ours, theirs, limits.floor)
            worst.add(error, limits.tensor, f"{name} on rank {rank}")
    how = "the ranks' micro-batches" if batch_stats else "the global batch"
    result = worst.result("parity", config, f"against one process on {how}, {case.steps} steps")
    if result.failed or not isinstance(resumed, list):
        return result
    across = _across_world_sizes(case, config, observed, resumed)
    return across if across.failed else result


def _across_world_sizes(case: Case, config: Config, observed: list, resumed: list) -> LawResult:
    """A run resumed at `resume_world` ranks against the uninterrupted one (see [Note: the
    checkpoint law, apart from parity]): the first loss (on the same parameters and
    micro-batches), and the parameters after the last step unless batch statistics make
    another split of the batch another computation."""
    limits = bounds(config, case.lr, len(resumed[0]["losses"]), across=True)
    worst = _Worst()
    at = f"at {config.resume_world} ranks (resumed from {config.world})"
    expected = observed[0]["run"]["saved"]["next_loss"]
    worst.add(_relative(resumed[0]["losses"][0], expected), limits.loss, f"the first loss {at}")
    if not observed[0]["batch_stats"]:
        for fqn, value in observed[0]["run"]["final"].items():
            error = tensor_error(resumed[0]["final"][fqn], value, limits.floor)
            worst.add(error, limits.tensor, f"{fqn} after the last step {at}")
    ranks = f"{config.world} rank{'s' if config.world > 1 else ''}"
    return worst.result("parity", config, f"against the uninterrupted run on {ranks}")


def _relative(ours: float, theirs: float) -> float:
    return abs(ours - theirs) / max(abs(theirs), 1e-12)


def judge_determinism(case: Case, config: Config, observed: list, resumed: Any) -> LawResult:
    """The second run, under chaos, was bitwise the first."""
    problems = [
        f"rank {r}: {', '.join(o['same_again'][:3])} differ between two runs"
        for r, o in enumerate(observed)
        if o["same_again"]
    ]
    return _result("determinism", config, problems, "two runs bitwise equal (second under chaos)")


def judge_checkpoint(case: Case, config: Config, observed: list, resumed: Any) -> LawResult:
    """Loaded bitwise as saved, and continued bitwise as from memory (see [Note: the
    checkpoint law, apart from parity])."""
    problems = [f"rank {r}: {p}" for r, o in enumerate(resumed) for p in o["problems"]]
    what = (
        f"saved at {config.world}, loaded at {config.resume_world} bitwise as saved, "
        f"continued bitwise as from memory"
    )
    return _result("checkpoint", config, problems, what)


def judge_collectives(case: Case, config: Config, observed: list, resumed: Any) -> LawResult:
    """The same collectives on every rank and under chaos, each waited for."""
    problems = []
    runs = ["run", "again"] if "again" in observed[0] else ["run"]
    for run in runs:
        first = observed[0][run]["collectives"]
        for rank, o in enumerate(observed[1:], start=1):
            difference = _first_difference(first, o[run]["collectives"])
            if difference:
                problems.append(f"rank 0 and rank {rank} differ at {difference}")
    for rank, o in enumerate(observed):
        if "again" in o and o["run"]["collectives"] != o["again"]["collectives"]:
            problems.append(f"rank {rank} issued other collectives under other timing")
        problems += [f"rank {rank} never waited for {w}" for w in o["run"]["unwaited"]]
    counts = [len(step) for step in observed[0]["run"]["collectives"]]
    what = f"the same on every rank and under chaos, all waited ({counts} per step)"
    return _result("collectives", config, problems, what)


def _first_difference(a: list[list[tuple]], b: list[list[tuple]]) -> str:
    """Where two ranks' collective sequences part, in words ("" if they do not)."""
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        for i in range(max(len(x), len(y))):
            mine = _words(x[i]) if i < len(x) else "nothing"
            theirs = _words(y[i]) if i < len(y) else "nothing"
            if mine != theirs:
                return f"step {step}, collective #{i + 1}: {mine} against {theirs}"
    return ""


def _words(record: tuple) -> str:
    op, ranks, numel, dtype = record
    return f"{op} of {numel} x {str(dtype).removeprefix('torch.')} over {ranks} ranks"


def judge_purity(case: Case, config: Config, observed: list, resumed: Any) -> LawResult:
    """No step wrote its inputs or changed the model."""
    problems = []
    for rank, o in enumerate(observed):
        for run in ("run", "again"):
            problems += [f"rank {rank}: {m}" for m in o.get(run, {}).get("mutated", [])]
        problems += [f"rank {rank}: the model's own {n} was written" for n in o["model_written"]]
    what = "the state, optimizer state, batch and model unchanged by every step"
    return _result("purity", config, problems, what)


def judge_memory(case: Case, config: Config, observed: list, resumed: Any) -> LawResult:
    """The first step's live all-gathered bytes within the plan's bound on every rank."""
    problems = [
        f"rank {r} held {peak:,} gathered bytes, over the plan's bound of {bound:,}"
        for r, (peak, bound) in enumerate(o["run"]["gathered"] for o in observed)
        if peak > bound
    ]
    peak, bound = observed[0]["run"]["gathered"]
    return _result("memory", config, problems, f"peak {peak:,} of {bound:,} gathered bytes")


_JUDGES: dict[str, Callable[..., LawResult]] = {
    "round_trip": judge_round_trip,
    "parity": judge_parity,
    "determinism": judge_determinism,
    "checkpoint": judge_checkpoint,
    "collectives": judge_collectives,
    "purity": judge_purity,
    "memory": judge_memory,
}


def tensor_error(ours: Tensor, theirs: Tensor, floor: float = 0.0) -> float:
    """max |ours - theirs| / max(max |theirs|, floor); exact for integer tensors (0 or inf)."""
    if ours.shape != theirs.shape:
        return float("inf")
    if not theirs.is_floating_point():
        return 0.0 if torch.equal(ours, theirs) else float("inf")
    if theirs.numel() == 0:
        return 0.0
    a, b = ours.detach().double(), theirs.detach().double()
    diff = (a - b).abs().max().item()
    scale = max(b.abs().max().item(), floor)
    if diff != diff:  # NaN
        return float("inf")
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


class _Worst:
    """The error furthest beyond (or nearest to) its tolerance, and where."""

    def __init__(self) -> None:
        self.error, self.tolerance, self.where = 0.0, 1.0, "nothing"

    def add(self, error: float, tolerance: float, where: str) -> None:
        if error != error:  # NaN
            error = float("inf")
        if self.where == "nothing" or error / tolerance > self.error / self.tolerance:
            self.error, self.tolerance, self.where = error, tolerance, where

    def result(self, law: str, config: Config, what: str) -> LawResult:
        status = PASS if self.error <= self.tolerance else FAIL
        detail = f"worst {self.error:.2g} at {self.where} (tolerance {self.tolerance:g}), {what}"
        return LawResult(law, config, status, error=self.error, detail=detail)
