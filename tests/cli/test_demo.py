"""`funcshard demo`, briefly: it trains, checks itself against one process, and reports.

Its resume from a checkpoint is tests/recipes/test_recovery.py's: a run killed mid-way, then
resumed, whose output is checked for what a resumed run prints."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(("mode", "dropout"), [("fsdp", "0.2"), ("replicate", "0")])
def test_the_demo_trains_and_passes_its_own_parity_check(mode, dropout):
    """With dropout, the one-process replay draws each rank's masks from its own stream."""
    cmd = [sys.executable, "-m", "funcshard", "demo", "--steps", "6", "--mode", mode]
    cmd += ["--plot", "", "--dropout", dropout]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "parity with one unsharded process   passed" in out.stdout
    assert "unigram baseline" in out.stdout and "sample: 'def " in out.stdout

