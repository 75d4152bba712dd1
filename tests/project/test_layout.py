"""The package's shape stays what README "Layout" says: no module over 500 lines, no import
circle (scripts/layout_stats.py), and the old flat module paths still import."""

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import layout_stats  # noqa: E402


@pytest.mark.quick
def test_no_module_is_over_the_line_limit_and_no_imports_go_round_in_a_circle():
    found = layout_stats.stats(ROOT)
    assert found["over_limit"] == [], found["over_limit"]
    assert found["circles"] == [], found["circles"]


def test_the_old_flat_module_paths_are_the_moved_modules():
    import funcshard
    from funcshard.comm import _collectives
    from funcshard.compiling import _compiled_schedule

    assert importlib.import_module("funcshard.collectives") is _collectives
    assert funcshard.collectives.record is _collectives.record
    from funcshard.compiled_schedule import reshard_backend

    assert reshard_backend is _compiled_schedule.reshard_backend
    assert callable(funcshard.estimate)  # the function, not its old module
    assert importlib.import_module("funcshard.estimate").Estimate is funcshard.Estimate
