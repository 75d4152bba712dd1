"""A collective call made on one rank only (an evaluation forward, a checkpoint save, a full
state dict under `if rank == 0:`) raises funcshard's error on every rank within the mesh's
timeout, naming the other rank and the call: no signal, no hang, no bare gloo error. Also,
on the same torchrun launch, `Mesh.from_env()` under torchrun (test_mesh.py's subject)."""

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

TIMEOUT = 2  # seconds: the mesh's


def _loss(model, state, x, y):
    return F.cross_entropy(fs.call(model, state, x).flatten(0, 1), y.flatten())


def on_rank_0_only(case: str, directory: str, rank: int, timeout: float = TIMEOUT) -> tuple:
    """Train 3 steps, rank 0 making `case`'s call alone after each; returns the error's
    type and message, and the seconds from the first step to it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    mesh = fs.Mesh(shard=2, timeout=timedelta(seconds=timeout))
    state = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), mesh)
    x, y = random_tokens(model.cfg, 2, seed=rank)
    grad_fn = fs.value_and_grad(functools.partial(_loss, model))
    started = time.perf_counter()
    try:
        for step in range(3):
            grad_fn(state, x, y)
            if rank == 0:
                if case == "forward":
                    with torch.no_grad():
                        _loss(model, state, x, y)
                elif case == "save":
                    fs.checkpoint.save(directory, state, step=step)
                else:
                    fs.full_state_dict(state)
    except Exception as e:
        return f"{type(e).__name__}: {e}", time.perf_counter() - started
    return "no error", time.perf_counter() - started


def every_case(directory: str, rank: int) -> dict[str, tuple[str, float]]:
    """`on_rank_0_only` for each case, one after the other: each on a mesh of a timeout of
    its own, hence process groups of its own (a mesh with its own settings gets its own copy
    of the default group), so one case's broken groups leave the next alone."""
    return {
        case: on_rank_0_only(case, directory, rank, TIMEOUT + i / 100)
        for i, case in enumerate(CALLS)
    }


CALLS = {
    "forward": None,
    "save": "funcshard.checkpoint.save",
    "state_dict": "funcshard.full_state_dict",
}


def _check(rank: int, message: str, seconds: float, case: str) -> None:
    assert message.startswith(f"CollectiveError: rank {rank}: "), message
    assert seconds < 3 * TIMEOUT + 20, seconds  # (its last steps' waits, then the reports)
    assert f"\nrank {1 - rank}: " in message, message  # where the other is, or that it left
    if CALLS[case]:  # rank 0 says it was inside the call; rank 1 reads it in rank 0's record
        inside = "This rank was inside" if rank == 0 else "inside"
        assert f"{inside} {CALLS[case]}" in message, message


def test_a_call_made_on_rank_0_only_raises_on_both_ranks_naming_it():
    run = functools.partial(every_case, tempfile.mkdtemp())
    for rank, cases in enumerate(testing.run(run, fresh=True, timeout=120)):
        for case, (message, seconds) in cases.items():
            _check(rank, message, seconds, case)


SCRIPT = Path(__file__).parents[1] / "scripts" / "torchrun_one_rank_only.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


@pytest.fixture(scope="module")
def two_ranks_under_torchrun(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One `torchrun --standalone --nproc-per-node=2` launch of
    tests/scripts/torchrun_one_rank_only.py, and the folder it wrote: each rank prints its
    `Mesh.from_env()` and an all-reduce's sum, then makes this module's calls on rank 0
    only, writing rank<r>.json. One launch for the two tests that read it, in one module:
    torchrun's start and its ranks' imports are most of either test's time (as a session
    fixture shared with test_mesh.py, xdist ran it once per worker that got either file)."""
    out_dir = tmp_path_factory.mktemp("torchrun_two_ranks")
    done = subprocess.run(
        [*TORCHRUN, str(SCRIPT), str(out_dir)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return done, out_dir


def test_from_env_under_torchrun_shards_over_all_ranks(two_ranks_under_torchrun):
    """The launch's script prints these lines first."""
    out, _ = two_ranks_under_torchrun
    assert out.returncode == 0, out.stderr
    assert "rank 0: shard 0/2 cpu sum 3" in out.stdout
    assert "rank 1: shard 1/2 cpu sum 3" in out.stdout


def test_under_torchrun_each_call_on_rank_0_only_raises_on_both_ranks(two_ranks_under_torchrun):
    done, out_dir = two_ranks_under_torchrun
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "SIG" not in out, out[-3000:]  # (torchrun names signals)
    for rank in (0, 1):
        cases = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert list(cases) == list(CALLS), cases
        for case, (message, seconds) in cases.items():
            _check(rank, message, seconds, case)


def _different_all_reduces_of_one_size(rank: int) -> tuple[str, bool]:
    """Rank 0 all-reduces one tensor, rank 1 another of the same size: gloo pairs them
    without a word. The step's end compares the ranks' trails and refuses the update."""
    from funcshard.comm import _collectives as collectives

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    mesh = fs.Mesh(shard=2)
    state = fs.shard(model, fs.plan(model), mesh)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    opt = fs.optim.sgd(0.1)
    opt_state = opt.init(state)
    before = fs.unshard(state)
    collectives.all_reduce(torch.ones(5), mesh.group, what=f"metric of rank {rank}").wait()
    try:
        _, grads = fs.value_and_grad(lambda s: fs.call(model, s, x).square().mean())(state)
        opt.step(grads, opt_state, state)
    except fs.CollectiveError as e:
        after = fs.unshard(state)
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return "no error", False


def test_ranks_whose_collectives_differ_only_in_what_they_carry_are_refused_at_the_step_end():
    for rank, (message, intact) in enumerate(testing.run(_different_all_reduces_of_one_size)):
        assert message.startswith(f"rank {rank}: the ranks issued different collectives"), message
        assert re.search(r"ranks \[0\]: (\d+) collectives, checksum \w+; ranks \[1\]: \1 ", message)
        assert "no update was applied" in message and intact


def _a_metric_over_some_ranks(rank: int) -> tuple[str, int]:
    """Ranks 0 and 1 of 3 all-reduce a metric of their own between two steps: a correct
    program, whose collectives over another group the mesh's trail leaves out."""
    import torch.distributed as dist

    from funcshard.comm import _collectives as collectives

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    state = fs.shard(model, fs.plan(model), fs.Mesh(shard=3))
    pair = dist.new_group([0, 1])
    opt = fs.optim.sgd(0.1)
    opt_state = opt.init(state)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        _, grads = fs.value_and_grad(lambda s: fs.call(model, s, x).square().mean())(state)
        state, opt_state = opt.step(grads, opt_state, state)
        if rank < 2:
            collectives.all_reduce(torch.ones(3), pair, what="pair metric").wait()
    return "no error", int(opt_state.step)


def test_a_collective_over_some_ranks_only_is_not_a_difference_in_the_mesh():
    assert testing.run(_a_metric_over_some_ranks, world_size=3) == [("no error", 2)] * 3
