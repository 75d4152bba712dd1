"""A rank killed mid-run: the demo resumes from its last checkpoint as if nothing happened,
and under torchrun's elastic restarts the example recovers by itself."""

import argparse
import contextlib
import functools
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from funcshard import testing
from funcshard.cli import _demo as demo

pytestmark = pytest.mark.timeout(600)

DEMO = [sys.executable, "-m", "funcshard", "demo", "--plot", "", "--timeout", "20"]


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid`, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _grandchildren(pid: int) -> list[int]:
    return sorted(g for c in _children(pid) for g in _children(c))


def _workers(pid: int) -> list[int]:
    """The demo's ranks are forked by a forkserver (grandchildren); torchrun's are its
    children."""
    return _grandchildren(pid) or _children(pid)


def _committed_step(directory) -> int:
    """The step of the checkpoint LATEST names (a save in progress does not count)."""
    try:
        with open(os.path.join(directory, "LATEST")) as f:
            return int(f.read().split("-")[1])
    except FileNotFoundError:
        return 0


def _kill_a_rank_after(process: subprocess.Popen, directory, step: int) -> None:
    """Wait until a checkpoint of at least `step` is committed, then SIGKILL the last-started
    rank (ranks are the grandchildren of the launcher: it forks them through a forkserver or
    an elastic agent)."""
    deadline = time.monotonic() + 300
    while _committed_step(directory) < step:
        assert process.poll() is None, "the run ended before a rank could be killed"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    ranks = _workers(process.pid)
    assert ranks, "found no rank processes"
    os.kill(ranks[-1], signal.SIGKILL)


def _outcome(out: str) -> tuple[str, str]:
    """The run's final loss (the summary's "first -> last") and its generated sample."""
    summary = next(line for line in out.splitlines() if line.startswith("loss, first -> last"))
    return summary.rsplit("->", 1)[1].strip(), out.split("sample:", 1)[1]


def _quiet_rank(cfg: demo.DemoConfig, rank: int) -> dict:
    """The demo's own rank function, its progress bar silenced."""
    with contextlib.redirect_stdout(io.StringIO()):
        return demo.train_rank(cfg, rank)


def _uninterrupted(argv: list[str]) -> tuple[str, str]:
    """The outcome `funcshard demo ARGV` prints (`_outcome`), from the demo's own rank function
    run on the test's pool (the ranks `funcshard demo` runs, with the configuration its
    command line gives), not from a process of its own."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    cfg = demo.from_arguments(parser.parse_args(argv))
    reports = testing.run(functools.partial(_quiet_rank, cfg), world_size=cfg.nproc, timeout=300)
    return f"{reports[0]['losses'][-1]:.3f}", f" {reports[0]['sample']!r}\n"


def test_the_demo_killed_mid_run_resumes_and_ends_exactly_as_an_uninterrupted_run(tmp_path):
    """20 steps of 2 sequences a rank (it was 40 of 8), a checkpoint every 10: the kill comes
    once step 10 is committed, so the resumed run still trains 10 steps from the checkpoint
    before its last loss and sample are compared with the uninterrupted run's. Mutation
    check: resuming with a fresh optimizer state (AdamW's moments and count not loaded) ends
    on another loss and sample, and fails. The uninterrupted run is the demo's rank function
    on the test's pool (`_uninterrupted`): a third `funcshard demo` process would add an
    interpreter, a pool and the demo's parity check (tests/cli/test_demo.py's) to the same
    numbers. It saves no checkpoints, so the killed run's saves are checked to change nothing
    too."""
    steps = ["--steps", "20", "--batch", "2", "--checkpoint-every", "10"]
    whole = _uninterrupted([*DEMO[4:], *steps])  # no checkpoints: saving must change nothing

    directory = tmp_path / "killed"
    first = subprocess.Popen(
        [*DEMO, *steps, "--checkpoint-dir", str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _kill_a_rank_after(first, directory, step=10)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 2, err[-2000:]
    assert "demo stopped: " in err and "died with signal 9" in err
    assert "Run the same command with --resume" in err
    saved = _committed_step(directory)
    assert saved >= 10

    again = subprocess.run(
        [*DEMO, *steps, "--checkpoint-dir", str(directory), "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from step {saved} ({directory})" in again.stdout
    # the bar counts the whole run, and a resumed run skips the parity replay, saying why
    # (this is where tests/cli/test_demo.py's resume test went: the same two launches)
    assert "training: 100%" in again.stdout and "20/20" in again.stdout
    assert "skipped (a resumed or bf16 run" in again.stdout
    # the same final parameters: the same last loss and the same greedy sample
    assert _outcome(again.stdout) == whole


def test_under_torchrun_elastic_restarts_a_killed_rank_is_recovered_from_the_checkpoint(tmp_path):
    """30 steps of 2 sequences a rank (it was 40 of 8): the kill comes once step 10 is
    committed, so the restarted round still resumes from a checkpoint (10 or later) and must
    train on to commit step 30."""
    script = Path(__file__).parents[2] / "examples" / "train_gpt.py"
    # One restart is what the kill needs; more, because a restarted round has once failed
    # its gloo rendezvous (connectFullMesh: connection refused) and torchrun retries it.
    cmd = [
        *[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
        *["--max-restarts", "3", str(script), "--steps", "30", "--batch", "2"],
        *["--checkpoint-every", "5"],
        *["--checkpoint-dir", str(tmp_path)],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _kill_a_rank_after(run, tmp_path, step=10)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    resumed = int(out.split("resumed from step ")[1].split()[0])
    assert resumed >= 10 and resumed % 5 == 0
    assert "final loss" in out and _committed_step(tmp_path) == 30
