"""Checkpoints give back exactly what each rank saved, or refuse by name (issue 39)."""

import concurrent.futures
import contextlib
import functools
import json
import os
import re
import time
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.io import _checkpoint as checkpoint
from funcshard.optim._owned import Owned


def _model(seed: int = 0, zero_sized: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    if zero_sized:
        model[0].register_parameter("empty", nn.Parameter(torch.empty(0, 4)))
    return model


def _state(mesh, seed: int = 0, zero_sized: bool = False):
    model = _model(seed, zero_sized)
    plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
    return fs.shard(model, plan, mesh)


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Hyper(NamedTuple):
    step: int
    scale: float
    warm: bool
    per_rank: float


class HyperPlus(NamedTuple):  # a like with a number the checkpoint never held
    step: int
    scale: float
    warm: bool
    per_rank: float
    momentum: float


def _opt_state(state, rank: int, like: bool = False):
    """AdamW's state plus what differs across ranks: a counter, residuals, a number."""
    base = fs.optim.adamw(1e-3).init(state)
    if like:
        return {"adam": base, "count": torch.tensor(0.0), "residual": [torch.zeros(5)] * 3,
                "hyper": Hyper(0, 1.0, False, 0.0)}  # fmt: skip
    return {
        "adam": base,
        "count": torch.tensor(10.0 + rank),
        "residual": [_randn(5, seed=10 * rank + i) for i in range(3)],
        "hyper": Hyper(7, 0.0078125, True, 0.5 + rank),
    }


def _save_per_rank(path: str, rank: int) -> dict:
    state = _state(fs.Mesh(shard=2))
    opt_state = _opt_state(state, rank)
    checkpoint.save(path, state, opt_state, step=3, extra={"position": 100 + rank})
    _, loaded, step, extra = checkpoint.load(path, like=(state, _opt_state(state, rank, True)))
    wider = {**_opt_state(state, rank, True), "hyper": HyperPlus(0, 1.0, False, 0.0, 0.9)}
    try:
        checkpoint.load(path, like=(state, wider))
        missing_number = None
    except ValueError as e:
        missing_number = str(e)
    return {"saved": opt_state, "loaded": loaded, "extra": extra, "step": step,
            "missing_number": missing_number}  # fmt: skip


def _load_elsewhere(path: str, per_rank, rank: int):
    state = _state(fs.Mesh(shard=3))
    like = _opt_state(state, rank, like=True)
    try:
        _, loaded, _, extra = checkpoint.load(path, like=(state, like), per_rank=per_rank)
    except ValueError as e:
        return str(e)
    return {"loaded": loaded, "extra": extra}


@pytest.fixture(scope="module")
def per_rank_saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("per_rank") / "ckpt")
    return path, testing.run(functools.partial(_save_per_rank, path), world_size=2)


def test_tensors_that_differ_across_ranks_come_back_to_each_rank_bitwise(per_rank_saved):
    """Before: rank 0 saved 10.0 and rank 1 saved 11.0; both loaded 11.0 (residuals mixed)."""
    _, results = per_rank_saved
    for r in results:
        assert torch.equal(r["loaded"]["count"], r["saved"]["count"])
        for got, want in zip(r["loaded"]["residual"], r["saved"]["residual"], strict=True):
            assert torch.equal(got, want)


def test_python_numbers_in_the_optimizer_state_round_trip(per_rank_saved):
    """Before: numbers were never written; 7 came back as 0 and 0.0078 as 1.0."""
    _, results = per_rank_saved
    for rank, r in enumerate(results):
        assert r["loaded"]["hyper"] == Hyper(7, 0.0078125, True, 0.5 + rank)
        assert type(r["loaded"]["hyper"].step) is int and r["step"] == 3


def test_a_number_the_checkpoint_never_held_is_refused_by_name(per_rank_saved):
    """Before: like's 0.9 stayed, silently, as if it had been loaded."""
    _, results = per_rank_saved
    for r in results:
        assert r["missing_number"] is not None and "momentum" in r["missing_number"]
        assert "missing" in r["missing_number"]


def test_extra_that_differs_across_ranks_comes_back_to_each_rank(per_rank_saved):
    _, results = per_rank_saved
    assert [r["extra"] for r in results] == [{"position": 100}, {"position": 101}]


def test_per_rank_values_are_refused_by_name_on_another_world_size(per_rank_saved):
    path, results = per_rank_saved
    errors = testing.run(functools.partial(_load_elsewhere, path, "refuse"), world_size=3)
    for error in errors:
        assert "optim/['count']" in error and "optim/['residual'][0]" in error, error
        assert "replicate=1, shard=2" in error and "per_rank='like'" in error
    kept = testing.run(functools.partial(_load_elsewhere, path, "like"), world_size=3)
    assert all(torch.equal(k["loaded"]["count"], torch.tensor(0.0)) for k in kept)
    assert all(k["extra"] is None for k in kept)
    ones = testing.run(functools.partial(_load_elsewhere, path, 1), world_size=3)
    for k in ones:
        assert torch.equal(k["loaded"]["count"], results[1]["saved"]["count"])
        assert k["loaded"]["hyper"].per_rank == 1.5 and k["extra"] == {"position": 101}


def _hsdp_diverged(path: str, rank: int) -> dict:
    mesh = fs.Mesh(replicate=2, shard=2)
    state = _state(mesh)
    bump = 1.0 + mesh.replicate_rank  # DiLoCo's replicas between outer steps
    state = state.replace(shards=tuple(s * bump for s in state.shards))
    checkpoint.save(path, state)
    loaded, _, _, _ = checkpoint.load(path, like=(_state(mesh, seed=5), None))
    same = all(torch.equal(a, b) for a, b in zip(loaded.shards, state.shards, strict=True))
    return {"same": same}


def _fsdp_load(path: str, rank: int) -> str:
    try:
        checkpoint.load(path, like=(_state(fs.Mesh(shard=2)), None))
    except ValueError as e:
        return str(e)
    return "loaded"


def test_hsdp_replicas_that_diverge_are_saved_per_replica_never_merged(tmp_path):
    path = str(tmp_path / "hsdp")
    assert all(r["same"] for r in testing.run(functools.partial(_hsdp_diverged, path), 4))
    for error in testing.run(functools.partial(_fsdp_load, path), world_size=2):
        assert "params/0.weight" in error and "differed across ranks" in error, error


def _owned_opt_state(state, world_rank: int, like: bool) -> dict:
    """Owned state: each parameter's state on rank (its index mod the shard size)."""
    mesh, layout = state.layout.mesh, state.layout
    fqns = sorted(f for flat in layout.flats for f in flat.fqns)
    states = {}
    for i, fqn in enumerate(fqns):
        if i % mesh.shard_size != mesh.shard_rank:
            continue
        numel = -(-layout.flats[0].numel // 2) if i == 0 else 3  # a flat's shard on 2 ranks
        value = torch.full((numel,), -1.0) if like else _randn(numel, seed=i)
        states[fqn] = (value, 0 if like else 100 + i)
    return {"moments": fs.optim.sgd(0.1).init(state), "owned": Owned(states=states)}


def _owned_round_trip(path: str, save: bool, world: int, rank: int) -> dict:
    state = _state(fs.Mesh(shard=world))
    if save:
        checkpoint.save(path, state, _owned_opt_state(state, rank, like=False))
    like = _owned_opt_state(state, rank, like=True)
    _, loaded, _, _ = checkpoint.load(path, like=(state, like))
    want = _owned_opt_state(state, rank, like=False)["owned"].states
    got = loaded["owned"].states
    same = list(got) == list(want) and all(
        torch.equal(got[k][0], want[k][0]) and got[k][1] == want[k][1] for k in want
    )
    return {"same": same, "keys": list(got)}


def test_owned_state_loads_on_whichever_rank_owns_each_key_at_any_world_size(tmp_path):
    path = str(tmp_path / "owned")
    saved = testing.run(functools.partial(_owned_round_trip, path, True, 2), world_size=2)
    for world in (3, 1):
        loaded = testing.run(functools.partial(_owned_round_trip, path, False, world), world)
        assert all(r["same"] for r in loaded) and sum(len(r["keys"]) for r in loaded) == 4
    assert all(r["same"] for r in saved)


def _zero_sized(path: str, rank: int) -> bool:
    state = _state(fs.Mesh(shard=2), zero_sized=True)
    opt_state = fs.optim.adamw(1e-3).init(state)
    checkpoint.save(path, state, opt_state)
    like = _state(fs.Mesh(shard=2), seed=3, zero_sized=True)
    loaded, _, _, _ = checkpoint.load(path, like=(like, fs.optim.adamw(1e-3).init(like)))
    return all(torch.equal(a, b) for a, b in zip(loaded.shards, state.shards, strict=True))


def test_a_model_with_a_zero_element_parameter_saves_and_loads(tmp_path):
    """Before: every save failed with torch's 'ShardedTensor have no local shards'."""
    assert all(testing.run(functools.partial(_zero_sized, str(tmp_path / "z")), world_size=2))


@pytest.fixture(scope="module")
def two_jobs():
    """Two separate 2-rank jobs (worlds of their own), run side by side with `_side_by_side`."""
    pools = [testing.pool.WorkerPool(2), testing.pool.WorkerPool(2)]
    yield pools
    for pool in pools:
        pool.quit()


def _side_by_side(pools, first, second, timeout: float = 100.0) -> list:
    """Run `first` on one job's ranks and `second` on the other's at the same time."""
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        futures = [
            threads.submit(p.run, f, timeout) for p, f in zip(pools, (first, second), strict=True)
        ]
        return [f.result() for f in futures]


def _in_step_with_the_other_job(path: str, job: int, step: int, rank: int) -> None:
    """Rank 0 of each job waits until the other job reached the same save too, so the two
    jobs' saves of each step overlap (rank 1 waits in the save's own barrier)."""
    if rank != 0:
        return
    open(f"{path}-job{job}-step{step}", "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(f"{path}-job{1 - job}-step{step}") and time.monotonic() < deadline:
        time.sleep(0.001)


def _job_saves(path: str, job: int, rank: int) -> dict:
    """Save 4 times into the shared `path`, each save beside the other job's; then load
    each save that returned."""
    state = _state(fs.Mesh(shard=2), seed=job)
    returned, conflicts = {}, []
    for step in range(4):
        _in_step_with_the_other_job(path, job, step, rank)
        values = state.replace(shards=tuple(s + step for s in state.shards))
        try:
            returned[step] = checkpoint.save(path, values, step=step, extra={"job": job})
        except checkpoint.CheckpointConflict as e:
            conflicts.append(str(e))
    return {"returned": returned, "conflicts": conflicts, "state": state}


def _job_loads(returned: dict, job: int, rank: int) -> list[str]:
    """The saves that do not hold this job's own values (mixed or overwritten)."""
    state = _state(fs.Mesh(shard=2), seed=job)
    mixed = []
    for step, directory in returned.items():
        loaded, _, at, extra = checkpoint.load(directory, like=(state, None))
        want = [s + step for s in state.shards]
        same = all(torch.equal(a, b) for a, b in zip(loaded.shards, want, strict=True))
        if at != step or extra != {"job": job} or not same:
            mixed.append(directory)
    return mixed


def test_two_jobs_saving_into_one_directory_never_overwrite_or_mix(tmp_path, two_jobs):
    """Before: both wrote step-0-0 and one of 8 checkpoints was lost in each trial."""
    path = str(tmp_path / "shared")
    saves = [functools.partial(_job_saves, path, job) for job in (0, 1)]
    results = [ranks[0] for ranks in _side_by_side(two_jobs, *saves)]
    for r in results:
        assert len(r["returned"]) + len(r["conflicts"]) == 4
        assert all("another writer" in c and "committed 'step-" in c for c in r["conflicts"])
    loads = [functools.partial(_job_loads, r["returned"], job) for job, r in enumerate(results)]
    assert _side_by_side(two_jobs, *loads) == [[[], []], [[], []]]  # none mixed
    names = [d for r in results for d in r["returned"].values()]
    assert len(set(names)) == len(names) and names  # no directory written twice
    assert _text(os.path.join(path, checkpoint.LATEST)) in {os.path.basename(d) for d in names}


def _writer(path: str, steps: range, rank: int, done: str | None = None) -> None:
    """Save `steps` into `path` keeping 1 (each save retires the one before); then, on rank
    0, create the file `done`."""
    state = _state(fs.Mesh(shard=2))
    for step in steps:
        values = state.replace(shards=tuple(s + step for s in state.shards))
        checkpoint.save(path, values, step=step, keep=1)
    if done is not None and rank == 0:
        open(done, "w").close()


def _reader(path: str, done: str, seconds: float, rank: int) -> dict:
    """Load `path` again and again until the writer is `done` (one load more after it), or
    `seconds` at most. Every rank stops on the same loop: rank 0 decides and broadcasts it
    (each rank timing itself once let one rank stop while the other waited in the next
    load's collective, until the call timed out)."""
    state = _state(fs.Mesh(shard=2))
    loads, wrong, errors, while_writing = 0, 0, [], 0
    deadline = time.monotonic() + seconds
    while True:
        writing = not os.path.exists(done)
        try:
            loaded, _, step, _ = checkpoint.load(path, like=(state, None))
        except checkpoint.CheckpointRetired as e:  # allowed: a funcshard error naming it
            errors.append(str(e))
        else:
            loads += 1
            while_writing += writing
            want = [s + step for s in state.shards]
            wrong += not all(torch.equal(a, b) for a, b in zip(loaded.shards, want, strict=True))
        stop = torch.tensor(float(not writing or time.monotonic() > deadline))
        dist.broadcast(stop, src=0)
        if stop.item():
            return {"loads": loads, "wrong": wrong, "errors": errors, "writing": while_writing}


def test_a_reader_beside_a_retiring_writer_never_hangs_nor_loads_wrong_state(tmp_path, two_jobs):
    """Before: a retrying reader hung with its ranks in different collectives; one without
    retry got a raw FileNotFoundError.

    The readers stop once the writer is done (they read for 15 s before, most of it a
    checkpoint no one retired any more); that they loaded while it was writing is asserted."""
    path = str(tmp_path / "live")
    two_jobs[0].run(functools.partial(_writer, path, range(1)), 60)
    done = str(tmp_path / "done")
    write = functools.partial(_writer, path, range(1, 40), done=done)
    _, readers = _side_by_side(two_jobs, write, functools.partial(_reader, path, done, 15.0))
    assert all(r["loads"] > 0 and r["wrong"] == 0 for r in readers), readers
    assert all(r["writing"] > 0 for r in readers), readers
    assert all("retired" in e for r in readers for e in r["errors"])


def _unclear(path: str, case: str, rank: int):
    mesh = fs.Mesh(shard=2)
    state = _state(mesh)
    opt_state = fs.optim.adamw(1e-3).init(state)
    try:
        if case == "steps":
            checkpoint.save(path, state, step=rank)
        elif case == "not a pair":
            checkpoint.save(path, state)
            checkpoint.load(path, like=state)
        elif case == "params alone":
            checkpoint.save(path, state, opt_state, step=4)
            loaded, _, _, _ = checkpoint.load(path, like=(_state(mesh, seed=9), None))
            return all(torch.equal(a, b) for a, b in zip(loaded.shards, state.shards, strict=True))
        elif case == "float64":
            checkpoint.save(path, state.replace(shards=tuple(s.double() for s in state.shards)))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                checkpoint.load(path, like=(state, None))
            return [str(w.message) for w in caught]
        elif case == "load":
            checkpoint.load(path, like=(state, None))
    except (ValueError, TypeError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _text(path: str, content: str | None = None) -> str:
    """Read a file, or write `content` to it."""
    with open(path, "r" if content is None else "w") as f:
        return f.read() if content is None else str(f.write(content))


def _run(path, case, world=2):
    return testing.run(functools.partial(_unclear, path, case), world_size=world)


def test_each_unclear_message_names_the_cause_and_the_fix(tmp_path):
    path = str(tmp_path / "c")
    for error in _run(path, "steps"):  # was: could not checksum ... No such file
        assert "step must be the same on every rank, got rank 0: 0, rank 1: 1" in error
    for error in _run(path, "not a pair"):  # was: cannot unpack
        assert "like must be a pair (state, opt_state)" in error and "like=(state, None)" in error
    assert all(_run(str(tmp_path / "p"), "params alone"))  # was: unexpected optim/...
    for caught in _run(str(tmp_path / "d"), "float64"):  # was: cast without a word
        assert len(caught) == 1 and "params/0.weight (float64 -> float32)" in caught[0]
    for content in ("", "garbage\n"):  # was: saved without checksums, then FileNotFoundError
        _text(os.path.join(path, checkpoint.LATEST), content)
        for error in _run(path, "load"):
            assert "not the name of a checkpoint" in error and "Load the previous" in error
            assert "save-0" in error  # the complete one there is, not "no earlier"
    latest = os.path.join(path, sorted(n for n in os.listdir(path) if n.startswith("save-"))[-1])
    _text(os.path.join(path, checkpoint.LATEST), os.path.basename(latest))
    sums = os.path.join(latest, checkpoint.integrity.CHECKSUMS)
    record = json.loads(_text(sums))
    record["chunks"][0]["crc32"] ^= 1  # was: reported as damaged tensor data
    _text(sums, json.dumps(record))
    for error in _run(path, "load"):
        assert "funcshard.checksums.json itself is damaged" in error, error


def _save_on_a_full_disk(path: str, rank: int) -> tuple[str, str, bool]:
    """Rank 1's filesystem is full (its writes raise ENOSPC): every rank raises
    CheckpointDiskFull, and the mesh's ranks stay in step (a later save succeeds)."""
    import errno
    from unittest import mock

    from torch.distributed.checkpoint import filesystem

    mesh = fs.Mesh(shard=2)
    state = _state(mesh)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    patched = mock.patch.object(filesystem, "_write_item", no_space) if rank == 1 else None
    try:
        with patched or contextlib.nullcontext():
            fs.checkpoint.save(path, state, step=1)
        caught = ("no error", "")
    except fs.checkpoint.CheckpointDiskFull as e:
        caught = (type(e).__name__, str(e))
    fs.checkpoint.save(path, state, step=2)
    return (*caught, fs.checkpoint.load(path, like=(state, None))[2])


def test_a_full_disk_on_one_rank_raises_on_every_rank_naming_the_directory(tmp_path):
    for kind, message, step in testing.run(functools.partial(_save_on_a_full_disk, str(tmp_path))):
        assert kind == "CheckpointDiskFull", message
        assert step == 2  # the full disk's save left nothing loadable, nor ranks out of step
        assert f"no space left writing '{tmp_path}" in message and "on ranks [1]" in message
        assert re.search(r"This rank writes [\d,]+ bytes there, and its filesystem has", message)
