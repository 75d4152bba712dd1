"""`funcshard demo`, briefly: it trains, checks itself against one process, and reports."""

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


def test_the_demo_resumes_from_its_checkpoint(tmp_path):
    base = [
        sys.executable,
        "-m",
        "funcshard",
        "demo",
        "--plot",
        "",
        "--checkpoint-dir",
        str(tmp_path),
    ]
    first = subprocess.run([*base, "--steps", "4"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run(
        [*base, "--steps", "7", "--resume"], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from step 4 ({tmp_path})" in again.stdout
    assert (
        "training: 100%" in again.stdout
        and "7/7" in again.stdout
        and "skipped (a resumed or bf16 run" in again.stdout
    )
