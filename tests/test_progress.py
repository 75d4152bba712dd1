"""A rank whose collective times out names the ranks that are behind and where they are
(funcshard/progress.py, [Note: naming the rank that is behind])."""

import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import funcshard as fs
from funcshard import collectives, progress, testing

TIMEOUT = timedelta(seconds=3)


def _rank1_stays_in_user_code(rank: int) -> None:
    """Both ranks all-reduce once; then rank 1 sleeps in its own code past the timeout
    while rank 0 logs a metric alone."""
    mesh = fs.Mesh(shard=2, timeout=TIMEOUT)
    fs.pmean(torch.ones(1), mesh)
    if rank == 1:
        time.sleep(2 * TIMEOUT.total_seconds() + 2 * progress.INTERVAL)
        return
    fs.pmean(torch.ones(1), mesh)  # rank 0 only: nobody joins it


@pytest.mark.timeout(60)
def test_a_rank_sleeping_in_user_code_is_named_with_its_last_collective():
    start = time.monotonic()
    with pytest.raises(fs.CollectiveError) as caught:
        testing.run(_rank1_stays_in_user_code, world_size=2, fresh=True, timeout=40)
    message = str(caught.value)
    assert message.startswith("rank 0: all_reduce"), message
    assert "rank 1: last collective #1, all_reduce" in message, message
    assert "behind this rank" in message and "not in any funcshard collective" in message
    assert time.monotonic() - start < TIMEOUT.total_seconds() + 20


def _rank1_shuts_down(rank: int) -> None:
    """Rank 1 runs out of data after one step and shuts down; rank 0 goes on."""
    mesh = fs.Mesh(shard=2, timeout=TIMEOUT)
    fs.pmean(torch.ones(1), mesh)
    if rank == 1:
        with pytest.raises(fs.CollectiveError, match="rank 0"):  # rank 0 never arrives
            fs.shutdown(TIMEOUT * 2)
        return
    collectives.all_reduce(torch.ones(1), mesh.shard_group, "sum", what="a metric").wait()


@pytest.mark.timeout(60)
def test_a_rank_that_left_is_named_as_gone():
    with pytest.raises(fs.CollectiveError) as caught:
        testing.run(_rank1_shuts_down, world_size=2, fresh=True, timeout=40)
    message = str(caught.value)
    assert "rank 1: left (fs.shutdown())" in message, message


def _rank1_waits_elsewhere(rank: int) -> None:
    """The ranks part: rank 1 waits in an all-gather that rank 0 never issues."""
    mesh = fs.Mesh(shard=2, timeout=TIMEOUT)
    fs.pmean(torch.ones(1), mesh)
    collectives.all_gather(torch.ones(4), mesh.shard_group, what="blocks.0").wait()
    if rank == 1:
        time.sleep(progress.INTERVAL)  # rank 0 enters its all-reduce first
        with pytest.raises(fs.CollectiveError):
            collectives.all_gather(torch.ones(4), mesh.shard_group, what="blocks.3").wait()
        return
    collectives.all_reduce(torch.ones(1), mesh.shard_group, "sum", what="a metric").wait()


@pytest.mark.timeout(60)
def test_a_rank_waiting_in_another_collective_is_named_with_it():
    with pytest.raises(fs.CollectiveError) as caught:
        testing.run(_rank1_waits_elsewhere, world_size=2, fresh=True, timeout=40)
    message = str(caught.value)
    assert "rank 1: last collective #3, all_gather of unit 'blocks.3'" in message, message
    assert "waiting in all_gather of unit 'blocks.3'" in message, message


@pytest.mark.timeout(120)
def test_under_torchrun_a_rank_in_user_code_is_named_within_the_timeout():
    script = Path(__file__).parent / "scripts" / "torchrun_behind.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=100, env=env)
    assert out.returncode != 0
    err = out.stderr
    assert "rank 0: all_reduce" in err and "did not complete" in err, err[-3000:]
    assert re.search(
        r"rank 1: last collective #1, all_reduce .* behind this rank; not in any "
        r"funcshard collective since \d s ago",
        err,
    ), err[-3000:]
