"""A task or a test that leaves process-wide state changed fails itself, not a later one
(funcshard/testing/process_state.py, suite_hygiene.py): the rank pool fails the task and
starts fresh ranks; the suite's plugin fails the test's teardown and puts the state back."""

import os

import pytest
import torch

import funcshard as fs
from funcshard.testing.process_state import ProcessStateChanged

pytest_plugins = ["pytester"]


def _leaves_float64(rank: int) -> None:
    torch.set_default_dtype(torch.float64)


def _sets_a_variable_then_raises(rank: int) -> None:
    if rank == 1:
        os.environ["FUNCSHARD_LEFT_BEHIND"] = "1"
        raise ValueError("the task's own error")


def _what_a_task_finds(rank: int) -> tuple[torch.dtype, str | None]:
    return torch.get_default_dtype(), os.environ.get("FUNCSHARD_LEFT_BEHIND")


def _restores_what_it_changes(rank: int) -> bool:
    with torch.no_grad():
        torch.set_default_dtype(torch.float64)
        torch.set_default_dtype(torch.float32)
    return torch.is_grad_enabled()


@pytest.mark.quick
def test_a_task_that_leaves_rank_state_changed_fails_and_the_next_call_gets_fresh_ranks():
    with pytest.raises(ProcessStateChanged, match=r"(?s)rank 0's task .*dtype: torch.float32, now"):
        fs.testing.run(_leaves_float64, world_size=2)
    assert fs.testing.run(_what_a_task_finds, world_size=2) == [(torch.float32, None)] * 2
    with pytest.raises(ProcessStateChanged) as raised:
        fs.testing.run(_sets_a_variable_then_raises, world_size=2)
    message = str(raised.value)
    assert "rank 1's task" in message and "FUNCSHARD_LEFT_BEHIND: unset, now '1'" in message
    assert "ValueError: the task's own error" in message
    assert fs.testing.run(_what_a_task_finds, world_size=2) == [(torch.float32, None)] * 2
    assert fs.testing.run(_restores_what_it_changes, world_size=2) == [True, True]


def test_variables_torch_writes_for_itself_are_no_change_but_others_are():
    """Inductor sets TORCHINDUCTOR_CACHE_DIR on its first compile in a process: the first
    inductor task of a pool worker must not fail for it (it did, when run alone)."""
    from funcshard.testing import process_state

    before = process_state.snapshot()
    env = before["environment"]
    after = {
        **before,
        "environment": {**env, "TORCHINDUCTOR_CACHE_DIR": "/tmp/x", "FUNCSHARD_LEFT": "1"},
    }
    assert process_state.changes(before, after) == [
        "environment variable FUNCSHARD_LEFT: unset, now '1'"
    ]


def test_a_test_that_leaves_the_process_or_a_shared_fixture_changed_fails_itself(pytester):
    pytester.makeconftest('pytest_plugins = ["funcshard.testing.suite_hygiene"]')
    pytester.makepyfile(
        """
        import os, pytest, torch

        @pytest.fixture(scope="module")
        def table():
            return {"rows": [1, 2]}

        def test_leaves_grad_off():
            torch.set_grad_enabled(False)

        def test_finds_grad_on():
            assert torch.is_grad_enabled()

        def test_monkeypatch_is_undone_in_time(monkeypatch):
            monkeypatch.setenv("FUNCSHARD_SET_FOR_A_TEST", "1")

        def test_mutates_the_shared_table(table):
            table["rows"].append(3)

        def test_reads_the_table(table):
            assert table["rows"] == [1, 2, 3]
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=4, failed=1, errors=1)
    out = result.stdout.str()
    assert "test_leaves_grad_off left process-wide state changed" in out
    assert "grad mode: True, now False" in out
    assert "changed the shared fixture(s) ['table']" in out
    assert torch.is_grad_enabled()
