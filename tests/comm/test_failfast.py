"""fs.fail_fast: a rank that raises ends at once, and the ranks waiting on it raise too."""

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import funcshard as fs
from funcshard import testing
from funcshard.comm import _collectives as collectives


def test_without_an_exception_the_block_is_transparent():
    with fs.fail_fast():
        value = 1 + 1
    assert value == 2


def _rank1_fails_fast_while_rank0_all_reduces(rank: int) -> None:
    mesh = fs.Mesh(shard=2, timeout=timedelta(seconds=120))
    if rank == 1:
        with fs.fail_fast():
            raise IndexError("bad batch on rank 1")
    collectives.all_reduce(torch.ones(1), mesh.shard_group, op="sum").wait()


@pytest.mark.timeout(60)
def test_a_rank_that_fails_fast_makes_the_waiting_rank_raise_within_seconds_naming_it():
    start = time.monotonic()
    with pytest.raises(testing.RankDied, match="rank 1 died with exit code 1") as info:
        testing.run(_rank1_fails_fast_while_rank0_all_reduces, world_size=2, fresh=True)
    assert time.monotonic() - start < 10  # against the mesh's 120 s timeout
    cause = info.value.__cause__  # rank 0's error
    assert isinstance(cause, fs.CollectiveError)
    message = str(cause)
    assert "rank 0: all_reduce over ranks [0, 1] did not complete" in message
    assert (
        "First failure (recorded by fs.fail_fast): rank 1 raised IndexError: bad batch" in message
    )


@pytest.mark.timeout(120)
def test_under_torchrun_a_rank_that_fails_fast_ends_the_job_within_seconds():
    script = Path(__file__).parents[1] / "scripts" / "torchrun_fail_fast.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # the agent first looks at its ranks 20 s after starting them (it sleeps, then checks):
    # rank 0 must end by itself before that, not be stopped by the agent once it sees rank 1
    # gone (at a 5 s interval that race went to the agent on a busy machine)
    cmd += ["--monitor-interval", "20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    out = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=100, env=env)
    assert time.monotonic() - start < 60, out.stderr[-3000:]
    assert out.returncode != 0
    assert "IndexError: bad batch on rank 1" in out.stderr
    assert "rank 0 raised after 0." in out.stderr, out.stderr[-3000:]
    assert "First failure (recorded by fs.fail_fast): rank 1 raised IndexError" in out.stderr
