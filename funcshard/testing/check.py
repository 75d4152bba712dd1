"""Check the laws of sharded training (DESIGN.md §10) on your own model, in one call.

`fs.testing.check(make_model, make_batch, loss_fn)` trains the model sharded over gloo ranks
in many configurations (FSDP, HSDP and DDP meshes of the world sizes given, plans,
`reshard_after_forward`, mixed precision, seeds) and checks, on each: the round trip of
`shard` and `unshard`, parity with one plain process, determinism, checkpoints that load at
another world size, collectives, purity and gathered memory. See docs/check.md.

[Note: hypothesis drives the configurations]
A configuration (`laws.Config`) is drawn by a hypothesis strategy and checked by one
`fs.testing.run` call that observes every law at once (see [Note: one run per
configuration]); the parent judges the observations (funcshard/testing/judge.py). A
configuration that breaks any law fails the inner hypothesis test, so hypothesis shrinks it
toward the smallest mesh, the first policy and precision, seed 0, and the configuration it
replays last is the smallest failure found. Each configuration runs once: results are kept
by configuration, so hypothesis's repeated and replayed examples cost nothing.

Hypothesis draws 20 times `examples` configurations, but only `examples` of them run: first
one per mesh not yet checked (1 rank, FSDP, HSDP, DDP at each world size), each with recipe
switches no earlier one had, then one per combination of mesh, policy, resharding,
precision and recipe not yet checked; the rest count as passing without running. So a few
examples cover the meshes, which hypothesis's own choice (it favours the first and last
option) would not. Once a failure is found, at most `shrink_budget` new configurations run
while shrinking, the others again counting as passing, so the smallest failure reported is
always one that really failed. `seed` fixes the examples drawn; with a hypothesis
`database` instead (hypothesis saves nothing from a seeded run), the failures saved by
earlier checks are replayed first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch.nn.functional as F
from torch import Tensor, nn

from funcshard.optim_base import Optimizer
from funcshard.testing import judge
from funcshard.testing.harness import LAWS, MP, Case, Config, PhaseFailed, global_batch
from funcshard.testing.laws import observe as _observe
from funcshard.testing.recipe import Axes, OptimizerChoice
from funcshard.testing.report import LawResult, LawViolation, Report
from funcshard.testing.resume import resume as _resume
from funcshard.testing.runner import RankDied, run

__all__ = ["LAWS", "LawResult", "LawViolation", "Report", "check", "default_loss"]


def check(
    make_model: Callable[[], nn.Module],
    make_batch: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    *,
    policy: Any = None,
    world_sizes: Sequence[int] = (1, 2, 4),
    steps: int = 3,
    examples: int = 8,
    mixed_precision: bool = False,
    recipes: bool | Axes = True,
    backend: str = "aot_eager",
    optimizer: OptimizerChoice = "adamw",
    lr: float = 1e-2,
    laws: Sequence[str] = LAWS,
    seed: int = 0,
    database: Any = None,
    shrink_budget: int = 8,
    batch_stats: bool | None = None,
    meta: bool | None = None,
    setup: Callable[[], contextlib.AbstractContextManager] | None = None,
    quick: bool = False,
    timeout: float = 120.0,
    progress: Callable[[str], None] | None = None,
    raise_on_failure: bool = True,
) -> Report:
    """Check the sharding laws on a model; return a `Report`, raise `LawViolation` on failure.

    `make_model()` builds the model (on every rank, and on the meta device where
    `fs.shard` can initialize it: `meta=None` tries, `True` insists, `False` builds on the
    CPU). `make_batch(step)` returns the global batch `(inputs, targets)`: tensors, tuples of
    tensors or a dict of keyword tensors, split along dim 0 over the data-parallel ranks; the
    model is called as `model(*inputs)`, `model(**inputs)` or `model(inputs)`.
    `loss_fn(outputs, targets)` is a mean loss (default: `default_loss`). All three must be
    module-level functions (every rank unpickles them). Dropout is off on both sides: the
    model runs in eval mode, its batch-norm layers in train mode.

    `policy` is the plan's policy (default: several drawn: the blocks inside the first
    ModuleList, a size threshold, the root alone). `world_sizes` are the meshes' sizes (each
    must divide the batch); `examples` configurations are drawn, `steps` optimizer steps
    each (`optimizer` "adamw" with eps 1e-3, or "sgd" with momentum, at `lr`; or a
    module-level function returning your own `fs.optim.Optimizer`, whose rates are its own:
    parity then compares it on the shards with the same optimizer on one process's params
    dict, where each leaf is a whole parameter, and no parameter groups or schedule are
    drawn for it);
    `mixed_precision=True` also draws bf16 gathers. `recipes` draws the features a real
    step combines on top (see [Note: recipes compose] in funcshard/testing/recipe.py):
    activation checkpointing of every other block, each block's first Linear frozen
    (`frozen="split"`), the step compiled by `fs.compile(backend=backend)`, clipping,
    accumulation over 2 micro-batches (where the batch splits), two parameter groups, a
    warmup schedule and a user `fs.Comm`; an `Axes` picks some, False none. `laws` picks
    among `LAWS`.
    `batch_stats` says whether the model normalizes by batch statistics (default: whether it
    holds batch-norm layers): then the reference runs each rank's micro-batch apart. `setup()`
    returns a context manager entered on every rank around each configuration's work (to
    patch something under test, say). `quick=True` checks world sizes up to 2, 3
    configurations of 2 steps, with every recipe axis but compilation. `seed` fixes the
    configurations drawn; with `database` (a hypothesis database, or a directory) they are
    drawn afresh instead, and the failures saved there by earlier checks replayed first.
    `progress(line)` hears of each configuration as it ends.
    """
    axes = recipes if isinstance(recipes, Axes) else Axes() if recipes else Axes.none()
    if callable(optimizer):  # its groups and rates are its own
        axes = dataclasses.replace(axes, groups=False, schedule=False)
    if quick:
        world_sizes = [w for w in world_sizes if w <= 2] or [min(world_sizes)]
        steps, examples, shrink_budget = min(steps, 2), min(examples, 3), min(shrink_budget, 4)
        axes = dataclasses.replace(axes, compiled=False)
    case = Case(
        make_model=make_model,
        make_batch=make_batch,
        loss_fn=loss_fn if loss_fn is not None else default_loss,
        policy=policy,
        steps=steps,
        optimizer=optimizer,
        lr=lr,
        batch_stats=batch_stats,
        meta=meta,
        setup=setup,
        laws=tuple(laws),
        backend=backend,
    )
    worlds = _validated(case, world_sizes, steps, examples)
    micro = (1, 2) if axes.micro_batches and _splits(case, [2 * w for w in worlds]) else (1,)
    start = time.monotonic()
    search = _Search(case, worlds, examples, shrink_budget, timeout, progress)
    search.recipes = axes != Axes.none()
    _explore(search, worlds, mixed_precision, axes, micro, examples, seed, database)
    report = Report(
        results=tuple(r for results in search.results.values() for r in results),
        smallest=search.failing[-1] if search.failing else None,
        seed=seed if database is None else None,
        seconds=time.monotonic() - start,
        model=_name(make_model),
        notes=tuple(dict.fromkeys(search.notes)),
    )
    if raise_on_failure and not report.ok:
        raise LawViolation(report)
    return report


def default_loss(outputs: Any, targets: Tensor) -> Tensor:
    """Cross entropy for integer targets (class scores along the last dim), mean squared error
    for float targets; `outputs.logits` (a transformers output) or `outputs[0]` if needed."""
    if not isinstance(outputs, Tensor):
        outputs = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    if targets.is_floating_point():
        return F.mse_loss(outputs, targets)
    return F.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten())


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _validated(
    case: Case, world_sizes: Sequence[int], steps: int, examples: int
) -> tuple[int, ...]:
    """Check the arguments on the caller's side, before any rank starts."""
    worlds = tuple(sorted(set(world_sizes)))
    if not worlds or any(not isinstance(w, int) or w < 1 for w in worlds):
        raise ValueError(f"fs.testing.check: world_sizes must be positive ints, got {world_sizes}.")
    unknown = [law for law in case.laws if law not in LAWS]
    if unknown or not case.laws:
        raise ValueError(f"fs.testing.check: laws must be among {LAWS}, got {case.laws}.")
    if steps < 2 or examples < 1:
        raise ValueError(
            f"fs.testing.check: steps must be at least 2 (the checkpoint is saved before the "
            f"last) and examples at least 1, got steps={steps}, examples={examples}."
        )
    _check_optimizer(case.optimizer)
    try:
        pickle.dumps(case)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"fs.testing.check: make_model, make_batch, loss_fn, policy and setup are sent to "
            f"every rank, so they must pickle by reference, got {e}. Define them as "
            f"module-level functions (not lambdas or closures), or use functools.partial of one."
        ) from e
    _check_batch(case, worlds)
    return worlds


def _check_optimizer(optimizer: Any) -> None:
    """'adamw', 'sgd', or a factory that pickles by reference and returns an Optimizer."""
    if isinstance(optimizer, str) and optimizer in ("adamw", "sgd"):
        return
    if not callable(optimizer):
        raise ValueError(
            f"fs.testing.check: optimizer must be 'adamw', 'sgd' or a module-level function "
            f"returning an fs.optim.Optimizer, got {optimizer!r}."
        )
    try:
        pickle.dumps(optimizer)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"fs.testing.check: optimizer={_name(optimizer)} is sent to every rank, so it "
            f"must pickle by reference, got {e}. Define the factory as a module-level "
            f"function returning an fs.optim.Optimizer (not a lambda or closure), or pass "
            f"functools.partial of one."
        ) from e
    made = optimizer()
    if not isinstance(made, Optimizer):
        raise TypeError(
            f"fs.testing.check: optimizer={_name(optimizer)} must return an "
            f"fs.optim.Optimizer, got {type(made).__name__}. Return "
            f"fs.optim.Optimizer(init, update)."
        )


def _first_batch(case: Case) -> Any:
    return global_batch(case, Config(1, 1, False, "root", True, None, 0, 1), 0)


def _splits(case: Case, parts: Sequence[int]) -> bool:
    """Whether the batch's rows split evenly into each of `parts`."""
    tensors = [t for t in optree.tree_leaves(_first_batch(case)) if isinstance(t, Tensor)]
    return all(t.dim() and t.shape[0] % p == 0 for t in tensors for p in parts)


def _check_batch(case: Case, worlds: tuple[int, ...]) -> None:
    """The batch is a pair whose tensors all split evenly over every world size."""
    batch = _first_batch(case)
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise TypeError(
            f"fs.testing.check: make_batch(step) must return (inputs, targets), got "
            f"{type(batch).__name__}. Return e.g. ((x,), y) or ({{'input_ids': x}}, y)."
        )
    tensors = [t for t in optree.tree_leaves(batch, none_is_leaf=False) if isinstance(t, Tensor)]
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if not tensors or None in sizes or len(sizes) != 1:
        raise ValueError(
            f"fs.testing.check: every tensor of make_batch's (inputs, targets) must hold the "
            f"batch along dim 0 with one size, got sizes {sorted(map(str, sizes))}."
        )
    size = sizes.pop()
    bad = [w for w in worlds if size % w]
    if bad:
        raise ValueError(
            f"fs.testing.check: the global batch of {size} rows does not split evenly over "
            f"world sizes {bad}. Return a batch whose size every world size divides (e.g. "
            f"{math.lcm(*worlds)} rows), or pass other world_sizes."
        )


class _Search:
    """The configurations checked so far, their results, and the failures in the order
    hypothesis met them (see [Note: hypothesis drives the configurations])."""

    def __init__(
        self,
        case: Case,
        worlds: tuple[int, ...],
        examples: int,
        shrink_budget: int,
        timeout: float,
        progress: Callable[[str], None] | None,
    ) -> None:
        self.case, self.examples, self.shrink_budget = case, examples, shrink_budget
        self.timeout, self.progress = timeout, progress
        self.meshes = {
            Config(w // s, s, ddp, "", True, None, 0, w).mesh_name
            for w in worlds
            for s in range(1, w + 1)
            if w % s == 0
            for ddp in ((False, True) if s == 1 and w > 1 else (False,))
        }
        self.results: dict[Config, list[LawResult]] = {}
        self.failing: list[Config] = []
        self.notes: list[str] = []
        self.shrunk = 0
        self.recipes = False  # whether recipe switches are drawn (each mesh then its own)

    def examine(self, config: Config) -> None:
        """Check `config` (once); raise `_Failed` if it breaks a law."""
        if config not in self.results:
            if not self._worth_running(config):
                return  # counted as passing (see the Note)
            self.shrunk += bool(self.failing)
            started = time.monotonic()
            self.results[config] = self._check(config)
            if self.progress is not None:
                failed = [r.law for r in self.results[config] if r.failed]
                verdict = f"FAIL {', '.join(failed)}" if failed else "ok"
                self.progress(f"{config}: {verdict} ({time.monotonic() - started:.1f} s)")
        if any(r.failed for r in self.results[config]):
            self.failing.append(config)
            raise _Failed(config)

    def _worth_running(self, config: Config) -> bool:
        """While shrinking, whether the budget allows one more; before, whether `examples`
        allows one more and the configuration adds a mesh not yet checked (once every mesh
        was, a combination of mesh, policy, resharding and precision not yet checked)."""
        if self.failing:
            return self.shrunk < self.shrink_budget
        if len(self.results) >= self.examples:
            return False
        seen = {c.mesh_name for c in self.results}
        if seen < self.meshes:  # each mesh with a combination of recipe switches of its own
            recipes = {c.recipe for c in self.results} if self.recipes else set()
            return config.mesh_name not in seen and config.recipe not in recipes
        return _kind(config) not in {_kind(c) for c in self.results}

    def _check(self, config: Config) -> list[LawResult]:
        return examine(self.case, config, self.timeout, self.notes)


def examine(
    case: Case, config: Config, timeout: float = 120.0, notes: list[str] | None = None
) -> list[LawResult]:
    """Check one configuration: every law of `case.laws`, judged (see [Note: one run per
    configuration]); a note for `notes` when the model had to be built on the CPU."""
    path = tempfile.mkdtemp(prefix="funcshard-check-")
    try:
        task = functools.partial(_observe, case, config, path)
        observed = _run(task, config.world, timeout)
        resumed = None
        if "checkpoint" in case.laws and not isinstance(observed, PhaseFailed):
            saved = {
                **observed[0]["run"]["saved"],
                "buffers": [o["run"]["saved"]["buffers"] for o in observed],
            }
            task = functools.partial(_resume, case, config, path, saved)
            resumed = _run(task, config.resume_world, timeout)
        built_on_cpu = not isinstance(observed, PhaseFailed) and observed[0]["built_on"] == "cpu"
        if built_on_cpu and notes is not None:
            notes.append(
                "built on the CPU: fs.shard could not initialize the model on the meta "
                "device (some tensor has no reset_parameters()); meta=False skips the try"
            )
        return judge.judge(case, config, observed, resumed)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run(task: Callable[[int], Any], world: int, timeout: float) -> list[Any] | PhaseFailed:
    """Run `task` on `world` ranks; a rank's `PhaseFailed`, or a dead or hung rank (a
    collective that differs across ranks), comes back as a `PhaseFailed`."""
    try:
        return run(task, world_size=world, timeout=timeout)
    except PhaseFailed as e:
        return e
    except (RankDied, TimeoutError) as e:
        if isinstance(e.__cause__, PhaseFailed):
            return e.__cause__
        lines = "\n".join(str(e).splitlines()[:4])
        return PhaseFailed("collectives", f"{type(e).__name__}: {lines}")


def _kind(config: Config) -> tuple:
    """A configuration without its seed and resume world size."""
    return (config.mesh_name, config.policy, config.reshard_after_forward, config.mp, config.recipe)


class _Failed(Exception):
    """A configuration broke a law (what fails the inner hypothesis test)."""


# What `_simplify` tries, in order: the seed, then each recipe switch at its simplest.
_SIMPLEST = (
    {"seed": 0},
    {"compiled": False},
    {"comm": False},
    {"micro_batches": 1},
    {"checkpointing": False},
    {"frozen": False},
    {"groups": False},
    {"schedule": False},
    {"clip": False},
)


def _simplify(search: _Search) -> None:
    """Finish shrinking where hypothesis's budget ran out: try the smallest failure with the
    seed 0 and each recipe switch off, one at a time, keeping each change under which it
    still fails. With eight switches to turn off, hypothesis's own shrinking seldom gets
    to them all within a small budget; this costs at most one run per switch."""
    config = search.failing[-1]
    for change in _SIMPLEST:
        simpler = dataclasses.replace(config, **change)
        if simpler == config:
            continue
        if simpler not in search.results:
            search.results[simpler] = search._check(simpler)
        if any(r.failed for r in search.results[simpler]):
            config = simpler
            search.failing.append(config)


def _explore(
    search: _Search,
    worlds: tuple[int, ...],
    mixed_precision: bool,
    axes: Axes,
    micro: tuple[int, ...],
    examples: int,
    seed: int,
    database: Any,
) -> None:
    """Let hypothesis draw, check and shrink configurations (see the Note)."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as seeded
    from hypothesis.database import DirectoryBasedExampleDatabase
    from hypothesis.errors import Flaky

    if isinstance(database, str | os.PathLike):
        database = DirectoryBasedExampleDatabase(os.fspath(database))
    policies = ("given",) if search.case.policy is not None else ("blocks", "size", "root")
    precisions = (None, "bf16") if mixed_precision else (None,)

    @settings(
        max_examples=20 * examples,  # most are skipped at once (see _Search._worth_running)
        deadline=None,
        database=database,
        derandomize=False,
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        print_blob=False,
    )
    @given(configurations(worlds, policies, precisions, axes, micro))
    def laws_hold(config: Config) -> None:
        search.examine(config)

    # failures saved in a database are the model's and options', not this function's (whose
    # digest hypothesis would use: every check would replay every model's failures)
    key = repr((_name(search.case.make_model), worlds, policies, precisions, axes)).encode()
    laws_hold._hypothesis_internal_database_key = hashlib.sha256(key).digest()
    simplest = hashlib.sha256(key + b" simplified").digest()  # `_simplify`'s, saved by us
    if database is None:  # hypothesis saves nothing from a seeded run
        seeded(seed)(laws_hold)
    else:
        _replay(search, database.fetch(simplest))
    try:
        laws_hold()
    except _Failed:
        pass
    except Flaky:  # a replay that did not fail again: the failures are recorded all the same
        if not search.failing:
            raise
    if search.failing:
        _simplify(search)
        if database is not None:
            database.save(simplest, json.dumps(dataclasses.asdict(search.failing[-1])).encode())


def _replay(search: _Search, saved: Any) -> None:
    """Check first the smallest failures `_simplify` saved in the database (hypothesis
    replays only its own)."""
    for blob in saved:
        try:
            config = Config(**json.loads(blob))
        except (ValueError, TypeError):  # another version's: nothing to replay
            continue
        with contextlib.suppress(_Failed):
            search.examine(config)


def configurations(
    worlds: tuple[int, ...],
    policies: tuple[str, ...] = ("blocks", "size", "root"),
    precisions: tuple[str | None, ...] = (None,),
    axes: Axes | None = None,
    micro: tuple[int, ...] = (1, 2),
) -> Any:
    """A hypothesis strategy of `Config`s; each shrinks toward the smallest world size (then
    the fewest shards), the first policy and precision listed, resharding after forward,
    seed 0, and every recipe switch off. `axes` says which recipe switches are drawn (none
    by default); `micro` the numbers of micro-batches."""
    from hypothesis import strategies as st

    from funcshard.testing.strategies import meshes

    unknown = [p for p in precisions if p is not None and p not in MP]
    if unknown:
        raise ValueError(f"fs.testing.check: precisions must be among {list(MP)}, got {unknown}.")

    @st.composite
    def draw_config(draw: st.DrawFn) -> Config:
        seed = draw(st.integers(0, 99))  # first: shrinking reaches 0 within a small budget
        mesh = draw(meshes(worlds))
        ddp = mesh.shard == 1 and mesh.replicate > 1 and draw(st.booleans())
        reshard: bool | int = not ddp
        if mesh.shard > 1:
            ks = [k for k in range(2, mesh.shard) if mesh.shard % k == 0]
            reshard = draw(st.sampled_from([True, False, *ks]))
        others = [w for w in worlds if w != mesh.world_size] or [mesh.world_size]
        on = axes if axes is not None else Axes.none()

        def switch(drawn: bool) -> bool:
            return drawn and draw(st.booleans())

        return Config(
            replicate=mesh.replicate,
            shard=mesh.shard,
            ddp=ddp,
            policy="buckets" if ddp else draw(st.sampled_from(policies)),
            reshard_after_forward=reshard,
            mp=draw(st.sampled_from(precisions)),
            seed=seed,
            resume_world=draw(st.sampled_from(others)),
            checkpointing=switch(on.checkpointing),
            frozen=switch(on.frozen),
            compiled=switch(on.compiled),
            clip=switch(on.clip),
            micro_batches=draw(st.sampled_from(micro)) if on.micro_batches else 1,
            groups=switch(on.groups),
            schedule=switch(on.schedule),
            comm=switch(on.comm and mesh.shard > 1),  # see recipe.REFUSED
        )

    return draw_config()
