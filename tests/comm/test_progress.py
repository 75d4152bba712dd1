"""A rank whose collective times out names the ranks that are behind and where they are
(funcshard/comm/_progress.py, [Note: naming the rank that is behind])."""

import os
import re
import signal
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
from funcshard.comm import _progress as progress
from funcshard.comm import _waits as waits

TIMEOUT = timedelta(seconds=3)


def _rank1_in_user_code_rank2_shut_down(rank: int) -> None:
    """All three ranks all-reduce once; then rank 1 sleeps in its own code past the timeout
    and rank 2 runs out of data and shuts down, while rank 0 logs a metric alone."""
    mesh = fs.Mesh(shard=3, timeout=TIMEOUT)
    fs.pmean(torch.ones(1), mesh)
    if rank == 1:
        time.sleep(2 * TIMEOUT.total_seconds() + 2 * progress.INTERVAL)
        return
    if rank == 2:
        with pytest.raises(fs.CollectiveError, match="rank 0"):  # rank 0 never arrives
            fs.shutdown(TIMEOUT * 2)
        return
    fs.pmean(torch.ones(1), mesh)  # rank 0 only: nobody joins it


def _rank0_error(task, world_size: int = 2) -> str:
    """The CollectiveError rank 0 raised running `task` on fresh ranks, in words."""
    with pytest.raises(fs.CollectiveError) as caught:
        testing.run(task, world_size=world_size, fresh=True, timeout=40)
    return str(caught.value)


@pytest.mark.timeout(60)
def test_a_rank_sleeping_in_user_code_or_gone_is_named_with_its_last_collective():
    """One call of 3 fresh ranks for what were two of 2 (a rank sleeping; a rank that left)."""
    start = time.monotonic()
    message = _rank0_error(_rank1_in_user_code_rank2_shut_down, world_size=3)
    assert message.startswith("rank 0: all_reduce"), message
    sleeping = next(line for line in message.splitlines() if line.startswith("rank 1: "))
    assert sleeping.startswith("rank 1: last collective #1, all_reduce"), message
    assert "behind this rank" in sleeping and "not in any funcshard collective" in sleeping
    assert "rank 2: left (fs.shutdown())" in message, message
    assert time.monotonic() - start < TIMEOUT.total_seconds() + 20


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
    message = _rank0_error(_rank1_waits_elsewhere)
    assert "rank 1: last collective #3, all_gather of unit 'blocks.3'" in message, message
    assert "waiting in all_gather of unit 'blocks.3'" in message, message


@pytest.mark.timeout(120)
def test_under_torchrun_a_rank_behind_is_named_within_the_timeout():
    """Rank 1 in its own code and rank 2 shut down, while rank 0 logs a metric alone: one
    3-rank launch names both (it was a 2-rank launch for each)."""
    script = Path(__file__).parents[1] / "scripts" / "torchrun_behind.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    out = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=100, env=env)
    assert out.returncode != 0
    err = out.stderr
    assert "rank 0: all_reduce" in err and "did not complete" in err, err[-3000:]
    for rank, where in (
        (1, r"behind this rank; not in any funcshard collective since \d s ago"),
        (2, r"left \(fs\.shutdown\(\)\) \d s ago"),
    ):
        line = rf"rank {rank}: (last collective #1, all_reduce .*)?{where}"
        assert re.search(line, err), err[-3000:]
    assert time.monotonic() - start < 60


def _rank1_catches_and_carries_on(rank: int) -> dict:
    """Rank 1's forward raises in its second block in the first step; it catches the error
    and tries the next step, as a loop that skips bad batches would."""
    from funcshard.testing.models import GPT, Block, GPTConfig

    # rank 0 waits past the time rank 1 looks for it in the store (waits.SETTLE)
    mesh = fs.Mesh(shard=2, timeout=TIMEOUT + waits.SETTLE)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3))
    state = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), mesh)

    def bad_batch(module, args):
        if rank == 1:
            raise ValueError("bad batch on rank 1")

    hook = model.blocks[1].register_forward_pre_hook(bad_batch)
    x = torch.randint(61, (2, 16), generator=torch.Generator().manual_seed(rank))
    step = fs.value_and_grad(lambda s: fs.call(model, s, x).square().mean())
    errors = []
    for _ in range(2 if rank == 1 else 1):
        try:
            step(state)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
        hook.remove()
    return {"errors": errors}


@pytest.mark.timeout(60)
def test_a_rank_that_catches_a_step_error_and_carries_on_raises_instead_of_aborting():
    """Broke: rank 1's next step issued its first all-gather against rank 0's gathers of the
    interrupted step, and gloo aborted the process on the mismatched shapes (SIGABRT)."""
    first, second = testing.run(_rank1_catches_and_carries_on, world_size=2, fresh=True)
    assert second["errors"][0] == "ValueError: bad batch on rank 1"
    refused = second["errors"][1]
    assert refused.startswith(
        "CollectiveError: rank 1: all_gather of the root unit was not "
        "issued: this rank left a step mid-way."
    ), refused
    assert "funcshard.call raised ValueError: bad batch on rank 1" in refused
    (timed_out,) = first["errors"]
    assert "rank 1: last collective" in timed_out and "then it left that step" in timed_out


def test_nccl_meshes_switch_torchs_flight_recorder_on_unless_the_user_set_it():
    """On NCCL the watchdog aborts without a Python exception: torch's flight recorder is
    what reports the hang ([Note: a timeout on NCCL]); gloo needs nothing."""
    from funcshard.comm import _flight_recorder as flight_recorder

    env: dict[str, str] = {}
    assert flight_recorder.switch_on("gloo", env) == {} and env == {}
    assert flight_recorder.switch_on("nccl", env) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    mine = {"TORCH_FR_BUFFER_SIZE": "50", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert flight_recorder.switch_on("cpu:gloo,cuda:nccl", mine) == {}
    assert mine == {"TORCH_FR_BUFFER_SIZE": "50", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


def test_a_process_stopped_or_gone_is_named_as_such_not_by_its_lagging_record():
    """A rank stopped (SIGSTOP) or killed writes no more, so its record may lag its last
    collectives: the report says what became of its process instead (same host)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"pid": child.pid, "host": progress._HOST}
        assert progress._process_state(record) is None  # running: its record speaks for it
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert progress._process_state(record) == "is stopped (SIGSTOP, or a debugger)"
    finally:
        child.kill()
        child.wait()
    assert progress._process_state(record) == "has exited (killed by a signal?)"
    assert progress._process_state({**record, "host": "elsewhere"}) is None
