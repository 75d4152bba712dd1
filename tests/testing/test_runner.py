"""The worker pool behind funcshard.testing.run: results, errors, hangs, deaths, reuse."""

import functools
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from funcshard import testing


def _sum_of_ranks(rank: int) -> tuple[int, float]:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, t.item()


def _pid(rank: int) -> int:
    return os.getpid()


def _raise_on(bad_rank: int, rank: int) -> int:
    if rank == bad_rank:
        raise ValueError(f"bad input on rank {rank}")
    return rank


def _rank1_waits_in_barrier(rank: int) -> None:
    if rank == 1:
        dist.barrier()


def _rank1_exits(rank: int) -> None:
    if rank == 1:
        os._exit(7)


def _tensor_roundtrip(scale: float, rank: int) -> torch.Tensor:
    return torch.arange(4.0) * scale + rank


@pytest.mark.quick
def test_run_returns_results_in_rank_order_after_a_real_collective():
    assert testing.run(_sum_of_ranks, world_size=2) == [(0, 3.0), (1, 3.0)]
    assert testing.run(_sum_of_ranks, world_size=3) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def test_run_passes_bound_arguments_and_returns_tensors_by_value():
    out = testing.run(functools.partial(_tensor_roundtrip, 2.0), world_size=2)
    assert torch.equal(out[1], torch.arange(4.0) * 2.0 + 1)


def test_pool_is_reused_across_calls_and_the_second_call_is_fast():
    first = testing.run(_pid, world_size=2)
    start = time.perf_counter()
    second = testing.run(_pid, world_size=2)
    assert time.perf_counter() - start < 0.3
    assert first == second and len(set(first)) == 2 and os.getpid() not in first


def test_a_rank_exception_is_reraised_with_its_type_rank_and_traceback():
    pids = testing.run(_pid, world_size=2)
    with pytest.raises(ValueError, match="bad input on rank 1") as info:
        testing.run(functools.partial(_raise_on, 1), world_size=2)
    cause = str(info.value.__cause__)
    assert "raised on rank 1 of 2" in cause and "_raise_on" in cause
    assert testing.run(_pid, world_size=2) == pids  # the pool survived


def test_a_hang_fails_within_the_timeout_naming_the_rank_and_where_it_waited():
    testing.run(_pid, world_size=2)  # ranks started: the 1 s timeout is the barrier's alone
    start = time.perf_counter()
    with pytest.raises(TimeoutError) as info:
        testing.run(_rank1_waits_in_barrier, world_size=2, timeout=1)
    assert time.perf_counter() - start < 10
    message = str(info.value)
    assert "ranks [1] did not finish within 1 s (finished: [0])" in message
    assert "--- rank 1 (last funcshard collective issued: none yet) was waiting in" in message
    assert "barrier" in message
    assert testing.run(_sum_of_ranks, world_size=2) == [(0, 3.0), (1, 3.0)]  # fresh pool


def test_a_dead_rank_is_reported_with_its_exit_code_and_never_waited_on():
    start = time.perf_counter()
    with pytest.raises(testing.RankDied, match="rank 1 died with exit code 7"):
        testing.run(_rank1_exits, world_size=2, timeout=60)
    assert time.perf_counter() - start < 10
    assert testing.run(_sum_of_ranks, world_size=2) == [(0, 3.0), (1, 3.0)]


def test_an_unpicklable_function_is_a_clear_type_error():
    with pytest.raises(TypeError, match="lambdas and nested functions do not pickle"):
        testing.run(lambda rank: rank, world_size=2)


def test_every_rank_runs_single_threaded():
    assert testing.run(_num_threads, world_size=2) == [1, 1]


def _num_threads(rank: int) -> int:
    return torch.get_num_threads()


def _rank0_raises_rank1_waits(rank: int) -> None:
    if rank == 0:
        raise KeyError("the real problem")
    dist.barrier()


def test_a_timeout_keeps_the_exception_that_caused_it():
    testing.run(_pid, world_size=2)  # ranks started: the 1 s timeout is the task's alone
    with pytest.raises(TimeoutError, match=r"Ranks \[0\] raised first") as info:
        testing.run(_rank0_raises_rank1_waits, world_size=2, timeout=1)
    cause = info.value.__cause__
    assert isinstance(cause, KeyError) and "the real problem" in str(cause)


def test_a_timeout_while_ranks_start_is_still_a_timeout_and_leaves_no_pool():
    with pytest.raises(TimeoutError, match="did not finish"):  # no other test uses 5 ranks
        testing.run(_pid, world_size=5, timeout=0.01)
    assert testing.run(_num_threads, world_size=5) == [1] * 5


def _rank1_skips_the_reduce(rank: int) -> None:
    """A sharded step in which rank 1 skips every unit's reduce-scatter (reduce=False), then
    waits elsewhere: rank 0 hangs in the reduce-scatter of the last unit."""

    import funcshard as fs
    from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    state = fs.shard(model, plan, fs.Mesh(shard=2), reshard_after_forward=False)
    x, y = random_tokens(model.cfg, 2, seed=rank)

    def loss(state, x, y):
        logits = fs.call(model, state, x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    fs.value_and_grad(loss, reduce=rank == 0)(state, x, y)
    time.sleep(600)


@pytest.mark.timeout(10)
def test_a_hang_in_a_step_is_reported_by_the_runner_before_pytest_timeout():
    """The runner's timeout (120 s asked) is capped below the test's pytest-timeout (10 s), so
    its report, with each rank's stack and last collective, is what fails the test. (The
    ranks wait the cap out: the shorter the pytest-timeout, the cheaper the test; 5 s are left
    after the runner's margin, for fresh ranks to start and reach the hang.)"""
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        testing.run(_rank1_skips_the_reduce, world_size=2, timeout=120, fresh=True)
    report = str(info.value)
    assert time.monotonic() - start < 10
    assert "ranks [0, 1] did not finish" in report
    assert "rank 0 (last funcshard collective issued: #" in report
    assert "reduce_scatter of unit 'blocks.1'" in report  # rank 0 waits in it
    assert "rank 1 (last funcshard collective issued: #" in report
    assert "all_gather of unit 'blocks.1'" in report  # rank 1's last: forward's gather
    assert "in _finish_last" in report  # rank 0's stack: the reduce it waits for
    assert "in _rank1_skips_the_reduce" in report  # rank 1's: where it sleeps


def _rank1_raises_before_rank0s_all_reduce(rank: int) -> float:
    import funcshard as fs
    from funcshard.comm import _collectives as collectives

    mesh = fs.Mesh(shard=2)
    if rank == 1:
        return [][rank]  # IndexError, before the collective rank 0 is about to enter
    return collectives.all_reduce(torch.ones(1), mesh.shard_group, op="sum").wait().item()


@pytest.mark.timeout(30)
def test_a_rank_that_raises_is_reported_within_seconds_while_another_waits_for_it():
    """Rank 0 waits in an all-reduce that rank 1, which raised, never enters: the report used
    to come only after the whole timeout (every hypothesis shrink step of such a bug paid
    it); now rank 1's exception comes back within seconds and the pool is recycled."""
    before = testing.run(_pid, world_size=2)
    start = time.monotonic()
    with pytest.raises(IndexError, match="list index out of range") as info:
        testing.run(_rank1_raises_before_rank0s_all_reduce, world_size=2, timeout=120)
    assert time.monotonic() - start < 10
    assert "raised on rank 1 of 2" in str(info.value.__cause__)
    assert "return [][rank]" in str(info.value.__cause__)  # rank 1's remote traceback
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "ranks [0] had not finished" in notes
    assert "rank 0 (last funcshard collective issued: #1, all_reduce over ranks [0, 1]" in notes
    after = testing.run(_pid, world_size=2)
    assert set(after).isdisjoint(before)  # a fresh pool
    assert testing.run(_sum_of_ranks, world_size=2) == [(0, 3.0), (1, 3.0)]


_UNGUARDED_SCRIPT = """
import funcshard as fs

def ident(rank):
    return rank

print(fs.testing.run(ident, world_size=2))
"""


def test_a_script_without_a_main_guard_is_told_so(tmp_path):
    """Workers re-run the main script to start; one that calls testing.run unguarded, or is
    read from stdin, gets that diagnosis, not a collective-abort guess."""
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED_SCRIPT)
    from_file = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert from_file.returncode != 0
    assert "could not start" in from_file.stderr
    assert 'if __name__ == "__main__":' in from_file.stderr.splitlines()[-1]
    from_stdin = subprocess.run(
        [sys.executable, "-"],
        input=_UNGUARDED_SCRIPT,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert "'<stdin>', not a file" in from_stdin.stderr.splitlines()[-1]


_CRASHING_ONCE = """
import os

from funcshard import testing

FLAG = os.path.join(os.path.dirname(__file__), "crashed")


def crash_once(rank):
    if rank == 1 and not os.path.exists(FLAG):
        open(FLAG, "w").close()
        os.abort()  # as glibc does when it finds the heap corrupt
    return rank


def always_wrong(rank):
    return rank


def test_crashes_once():
    assert testing.run(crash_once, world_size=2) == [0, 1]


def test_wrong_answer():
    assert testing.run(always_wrong, world_size=2) == [0, 0]
"""


@pytest.mark.timeout(120)
def test_a_test_whose_rank_died_of_a_signal_reruns_once_on_fresh_ranks_a_wrong_answer_never(
    tmp_path,
):
    """The suite's pytest settings (pyproject.toml) rerun a test once when a rank died of a
    signal (gloo's own heap corruption, scripts/gloo_heap_repro.py), and only then: a test
    that fails on its assertion fails at once, and the rerun is reported."""
    (tmp_path / "test_crash.py").write_text(_CRASHING_ONCE)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            os.path.join(root, "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
    )
    summary = done.stdout.strip().splitlines()[-1]
    assert "1 failed, 1 passed, 1 rerun" in summary, done.stdout[-3000:]
    assert "RERUN test_crash.py::test_crashes_once" in done.stdout
    assert "FAILED test_crash.py::test_wrong_answer" in done.stdout
