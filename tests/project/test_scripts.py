"""The test command's two lanes: `bash scripts/test.sh --quick` hands pytest `-m quick` (the
tests marked `quick`), and CI (`.ci/run`) runs the whole suite with no marker filter. Each
script runs as written, in a copy of the repository whose env.sh puts a stand-in for Python
that records its arguments, so nothing is installed and no test runs. Also: each wing of
tests/ has a test in the quick lane."""

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

# Stands in for scripts/env.sh: no venv, no install; `$py` and lint-imports record their calls.
ENV_SH = """cd "$(dirname "${BASH_SOURCE[0]}")/.."
py=$PWD/python
"""
# the xdist workers test.sh asks for (one a core, at most 4, a file to each)
WORKERS = "-n auto --maxprocesses 4 --dist loadfile"
RECORDER = '#!/usr/bin/env bash\necho "$*" >> "$(dirname "$0")/calls"\n'


def _calls(tmp_path: Path, *command: str) -> list[str]:
    """Run `command` in a copy of scripts/test.sh and .ci/run; the recorded Python calls."""
    (tmp_path / "scripts").mkdir(parents=True)
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / "scripts/test.sh", tmp_path / "scripts/test.sh")
    shutil.copy(ROOT / ".ci/run", tmp_path / ".ci/run")
    (tmp_path / "scripts/env.sh").write_text(ENV_SH)
    (tmp_path / ".venv/bin").mkdir(parents=True)
    for tool in (tmp_path / "python", tmp_path / ".venv/bin/lint-imports"):
        tool.write_text(RECORDER)
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "FUNCSHARD_TEST_WORKERS"}
    out = subprocess.run(["bash", *command], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    return (tmp_path / "calls").read_text().splitlines()


@pytest.mark.quick
def test_ci_runs_every_test_with_no_marker_filter(tmp_path):
    calls = _calls(tmp_path, ".ci/run")
    assert calls[0] == "-m ruff check ." and calls[-1] == f"-m pytest {WORKERS} -q", calls
    assert any(c.startswith("-m mkdocs build --strict") for c in calls), calls


def test_the_quick_flag_runs_the_same_checks_then_only_the_quick_tests(tmp_path):
    calls = _calls(tmp_path, "scripts/test.sh", "--quick", "-x", "tests/core")
    assert calls[-1] == f"-m pytest {WORKERS} -m quick -x tests/core", calls
    assert calls[:-1] == _calls(tmp_path / "whole", "scripts/test.sh")[:-1]


def _marked_quick(path: Path) -> bool:
    """Whether `path` marks a test, or a test's parameter, with `pytest.mark.quick`."""
    return any(
        isinstance(node, ast.Attribute) and ast.unparse(node) == "pytest.mark.quick"
        for node in ast.walk(ast.parse(path.read_text()))
    )


@pytest.mark.quick
def test_every_wing_of_the_suite_has_a_quick_test():
    wings = {p.parent for p in (ROOT / "tests").glob("*/test_*.py")}
    missing = [w.name for w in sorted(wings) if not any(map(_marked_quick, w.glob("test_*.py")))]
    assert not missing, f"wings with no test marked @pytest.mark.quick: {missing}"
