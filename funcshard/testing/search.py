"""Which configurations `fs.testing.check` runs, and how it finds the smallest failure.

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
import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

from funcshard.testing.examine import examine
from funcshard.testing.harness import MP, Case, Config
from funcshard.testing.recipe import Axes
from funcshard.testing.report import LawResult


def qualified_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


class Search:
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
    {"owned": False},
)


def _simplify(search: Search) -> None:
    """Finish shrinking where hypothesis's budget ran out: try the smallest failure with the
    seed 0 and each recipe switch off, one at a time, keeping each change under which it
    still fails. With nine switches to turn off, hypothesis's own shrinking seldom gets
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


def explore(
    search: Search,
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
        max_examples=20 * examples,  # most are skipped at once (see Search._worth_running)
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
    key = repr(
        (qualified_name(search.case.make_model), worlds, policies, precisions, axes)
    ).encode()
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


def _replay(search: Search, saved: Any) -> None:
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
            owned=switch(on.owned and mesh.shard > 1),  # (owned over one rank is even)
        )

    return draw_config()
