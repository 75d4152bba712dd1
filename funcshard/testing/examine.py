"""Check one configuration of `fs.testing.check`: every law observed on its ranks in one run,
the checkpoint resumed at another world size, and the observations judged in the parent."""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from funcshard.testing import judge
from funcshard.testing.harness import Case, Config, PhaseFailed
from funcshard.testing.laws import observe as _observe
from funcshard.testing.report import LawResult
from funcshard.testing.resume import resume as _resume
from funcshard.testing.runner import RankDied, run


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
