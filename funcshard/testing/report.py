"""What `fs.testing.check` found: each law on each configuration, and the smallest failure.

A `Report` is a record of `LawResult`s, one per law and configuration checked, with the
configuration hypothesis shrank a failure to. `report.table()` shows them as the check
command prints them; `LawViolation` is what a failing check raises (an AssertionError, so
pytest shows it as a test failure), naming the law, the configuration and how to replay it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tabulate import tabulate

from funcshard.testing.harness import LAWS, Config

PASS, FAIL, NOT_RUN = "pass", "FAIL", "-"


@dataclass(frozen=True)
class LawResult:
    """One law on one configuration: `status` is "pass", "FAIL" or "-" (not run, because an
    earlier phase failed or the law was not asked for); `error` is the worst error measured
    against the law's tolerance (None where the law is exact or nothing was measured);
    `detail` says what failed, or what was compared."""

    law: str
    config: Config
    status: str
    error: float | None = None
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL


@dataclass(frozen=True)
class Report:
    """Every law checked on every configuration tried, and the smallest failure.

    `smallest` is the failing configuration hypothesis shrank to (None when every law held);
    `seed` replays the same configurations; `seconds` is how long the check took.
    """

    results: tuple[LawResult, ...]
    smallest: Config | None
    seed: int | None  # None: drawn afresh, with a hypothesis database
    seconds: float
    model: str = "the model"  # its factory, module:name
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True when no law failed on any configuration."""
        return not any(r.failed for r in self.results)

    @property
    def configs(self) -> tuple[Config, ...]:
        """The configurations checked, in the order they ran."""
        return tuple(dict.fromkeys(r.config for r in self.results))

    @property
    def failures(self) -> tuple[LawResult, ...]:
        """The failed results on the smallest failing configuration (all of them if it is
        unknown)."""
        failed = [r for r in self.results if r.failed]
        smallest = [r for r in failed if r.config == self.smallest]
        return tuple(smallest or failed)

    def table(self) -> str:
        """One row per configuration, one column per law: pass, FAIL or - (not run), with the
        worst error where one was measured; then the failures and the time taken."""
        laws = [law for law in LAWS if any(r.law == law for r in self.results)]
        cells = {(r.config, r.law): r for r in self.results}
        rows = []
        for config in self.configs:
            mark = "* " if config == self.smallest else ""
            rows.append([mark + str(config), *(_cell(cells.get((config, law))) for law in laws)])
        lines = [tabulate(rows, headers=["configuration", *laws])]
        lines += [f"note: {note}" for note in self.notes]
        lines.append(self.summary())
        return "\n".join(lines)

    def summary(self) -> str:
        """A line or a paragraph: what held, or which laws failed where, and the time."""
        replay = "a hypothesis database" if self.seed is None else f"seed {self.seed}"
        counted = f"{len(self.configs)} configurations in {self.seconds:.1f} s ({replay})"
        if self.ok:
            return f"{self.model}: every law held on {counted}."
        lines = [f"{self.model}: laws failed; checked {counted}."]
        if self.smallest is not None:
            lines.append(f"smallest failing configuration (marked *): {self.smallest}")
        lines += [f"  {r.law}: {r.detail}" for r in self.failures]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _cell(result: LawResult | None) -> str:
    if result is None:
        return NOT_RUN
    if result.error is None:
        return result.status
    return f"{result.status} {result.error:.1e}"


def _replay(report: Report) -> str:
    if report.seed is None:
        return "the same database (its failures are replayed first)"
    return f"the same seed={report.seed}, or database=DIR to replay failures first"


class LawViolation(AssertionError):
    """A law of sharded training does not hold for this model: `law` names it, `config` is
    the smallest configuration it fails on, `report` has everything that was checked."""

    def __init__(self, report: Report) -> None:
        first = report.failures[0]
        self.law, self.config, self.report = first.law, first.config, report
        names = ", ".join(dict.fromkeys(r.law for r in report.failures))
        super().__init__(
            f"fs.testing.check: law {names} fails on {first.config}.\n{report.table()}\n"
            f"Replay it with {_replay(report)}; docs/guides/checking.md says what each law means."
        )
