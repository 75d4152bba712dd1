"""`funcshard demo`, briefly: it trains, checks itself against one process, and reports."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("mode", ["fsdp", "replicate"])
def test_the_demo_trains_and_passes_its_own_parity_check(mode):
    cmd = [sys.executable, "-m", "funcshard", "demo", "--steps", "6", "--mode", mode, "--plot", ""]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "parity with one unsharded process   passed" in out.stdout
    assert "unigram baseline" in out.stdout and "sample: 'def " in out.stdout
