"""`funcshard demo`, briefly: it trains, checks itself against one process, and reports.

Its resume from a checkpoint is tests/recipes/test_recovery.py's: a run killed mid-way, then
resumed, whose output is checked for what a resumed run prints. Those two runs are
`python -m funcshard demo` processes; the runs here are the same command in this process
(`cli.main`, as the console script calls it), on the test's rank pool: an interpreter and a
pool start fewer each, the same training, parity replay and report."""

import pytest

from funcshard.cli import _main as cli


@pytest.mark.parametrize(("mode", "dropout"), [("fsdp", "0.2"), ("replicate", "0")])
def test_the_demo_trains_and_passes_its_own_parity_check(mode, dropout, capsys):
    """With dropout, the one-process replay draws each rank's masks from its own stream."""
    argv = ["demo", "--steps", "6", "--mode", mode, "--plot", "", "--dropout", dropout]
    code = cli.main(argv)
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    assert "parity with one unsharded process   passed" in out
    assert "unigram baseline" in out and "sample: 'def " in out
