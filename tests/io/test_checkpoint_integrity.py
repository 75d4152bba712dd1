"""A corrupted checkpoint is never loaded silently (see [Note: checkpoint integrity])."""

import functools
import json
import os
import shutil
import warnings

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.cli import _main as cli
from funcshard.io import _checkpoint as checkpoint
from funcshard.io import _checkpoint_latest as checkpoint_latest
from funcshard.io import _integrity as integrity


def _setup(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    opt = fs.optim.adamw(1e-3)
    return state, opt.init(state)


def _save_twice(path: str, rank: int) -> None:
    state, opt_state = _setup(0)
    checkpoint.save(path, state, opt_state, step=1)
    state, opt_state = _setup(1)
    checkpoint.save(path, state, opt_state, step=2)


def _load(path: str, rank: int, verify: bool = True) -> dict:
    """Load into a fresh state; report the error, whether the state passed in changed, and
    whether what loaded equals what was saved."""
    state, opt_state = _setup(2)
    before = [s.clone() for s in state.shards]
    error, same_as_saved = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded, _, step, _ = checkpoint.load(path, like=(state, opt_state), verify=verify)
            saved = _setup(1)[0] if step == 2 else _setup(0)[0]
            same_as_saved = all(
                torch.equal(a, b) for a, b in zip(loaded.shards, saved.shards, strict=True)
            )
        except fs.CheckpointCorrupted as e:
            error, step = str(e), None
    untouched = all(torch.equal(a, b) for a, b in zip(before, state.shards, strict=True))
    return {"error": error, "step": step, "untouched": untouched, "same": same_as_saved,
            "warnings": [str(w.message) for w in caught]}  # fmt: skip


def _latest_dir(path) -> str:
    return os.path.join(path, open(os.path.join(path, checkpoint.LATEST)).read().strip())


def _biggest_chunk(directory: str) -> dict:
    with open(os.path.join(directory, integrity.CHECKSUMS)) as f:
        return max(json.load(f)["chunks"], key=lambda c: c["length"])


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def _corrupt(directory: str, how: str) -> tuple[str, str | None]:
    """Damage the checkpoint one way; return the file it names and the tensor (if any)."""
    chunk = _biggest_chunk(directory)
    file = os.path.join(directory, chunk["file"])
    if how == "bit in tensor data":
        _flip(file, chunk["start"] + chunk["length"] // 2)
        return chunk["file"], chunk["fqn"]
    if how == "bit in framing":
        _flip(file, chunk["start"] + 8)  # inside the serialized record's header
        return chunk["file"], chunk["fqn"]
    if how == "bit in metadata":
        metadata = os.path.join(directory, integrity.DCP_METADATA)
        _flip(metadata, os.path.getsize(metadata) // 2)
        return integrity.DCP_METADATA, None
    if how == "truncated file":
        os.truncate(file, os.path.getsize(file) // 2)
        return chunk["file"], None
    os.remove(file)  # a file missing
    return chunk["file"], None


DAMAGE = ["bit in tensor data", "bit in framing", "bit in metadata", "truncated file", "missing"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt") / "run")
    testing.run(functools.partial(_save_twice, path), world_size=2, timeout=120)
    return path


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_checkpoint_raises_on_every_rank_naming_file_and_tensor(saved, tmp_path, how):
    path = str(tmp_path / "run")
    shutil.copytree(saved, path)
    latest = _latest_dir(path)
    file, fqn = _corrupt(latest, how)
    results = testing.run(functools.partial(_load, path), world_size=2, timeout=60)
    for rank, r in enumerate(results):
        assert r["error"] is not None, (rank, how)  # never loaded silently
        assert file in r["error"], (rank, r["error"])
        if fqn is not None:
            assert repr(fqn) in r["error"], (rank, r["error"])
        assert "Load the previous checkpoint instead" in r["error"] and "step-1-" in r["error"]
        assert "weights_only" not in r["error"]
        assert r["untouched"], rank
    report = integrity.verify(latest)  # offline, no process group
    assert not report.ok and any(file in p for p in report.problems), report
    assert any("CORRUPTED" in line for line in report.lines) or how == "missing", report.lines


def test_without_verification_a_flipped_bit_loads_silently_wrong_which_is_what_checksums_stop(
    saved, tmp_path
):
    path = str(tmp_path / "run")
    shutil.copytree(saved, path)
    _corrupt(_latest_dir(path), "bit in tensor data")
    results = testing.run(functools.partial(_load, path, verify=False), world_size=2)
    assert all(r["error"] is None and r["step"] == 2 for r in results)
    assert not all(r["same"] for r in results)  # some rank holds a wrong weight, silently


def test_an_intact_checkpoint_verifies_and_loads_and_the_previous_one_by_its_directory(saved):
    report = integrity.verify(_latest_dir(saved))
    assert report.ok, report.problems
    assert any(line.endswith("chunks, ok") for line in report.lines)
    first = sorted(d for d in os.listdir(saved) if d.startswith("step-1-"))[0]
    previous = os.path.join(saved, first)
    results = testing.run(functools.partial(_load, previous), world_size=2, timeout=60)
    assert [r["step"] for r in results] == [1, 1] and not results[0]["error"]
    assert all(r["same"] for r in results)


def test_the_cli_verifies_a_checkpoint_offline(saved, tmp_path, capsys):
    assert cli.main(["checkpoint", "verify", saved]) == 0
    out = capsys.readouterr().out
    assert "chunks, ok" in out and "verified" in out
    path = str(tmp_path / "run")
    shutil.copytree(saved, path)
    _corrupt(_latest_dir(path), "bit in tensor data")
    assert cli.main(["checkpoint", "verify", path]) == 1
    assert "CORRUPTED" in capsys.readouterr().out
    assert cli.main(["checkpoint", "verify", str(tmp_path / "nothing")]) == 2
    assert "funcshard.checkpoint.verify: no complete checkpoint" in capsys.readouterr().err


def test_a_checkpoint_saved_before_checksums_loads_with_a_warning(saved, tmp_path):
    path = str(tmp_path / "run")
    shutil.copytree(saved, path)
    latest = _latest_dir(path)
    os.remove(os.path.join(latest, integrity.CHECKSUMS))
    with open(os.path.join(latest, checkpoint_latest.META), "w") as f:  # as older saves wrote it
        json.dump({"step": 2, "extra": None}, f)
    results = testing.run(functools.partial(_load, path), world_size=2, timeout=60)
    for r in results:
        assert r["error"] is None and r["step"] == 2 and r["same"]
        assert any("saved without checksums" in w for w in r["warnings"]), r["warnings"]
    assert not checkpoint.verify(path).verified


def test_a_checksums_file_lost_from_a_checksummed_save_is_an_error_not_a_warning(saved, tmp_path):
    path = str(tmp_path / "run")
    shutil.copytree(saved, path)
    os.remove(os.path.join(_latest_dir(path), integrity.CHECKSUMS))
    for r in testing.run(functools.partial(_load, path), world_size=2, timeout=60):
        assert f"{integrity.CHECKSUMS}: missing" in r["error"], r
    assert not checkpoint.verify(path).ok


def _save_unchecked(path: str, rank: int) -> None:
    state, opt_state = _setup(1)
    checkpoint.save(path, state, opt_state, step=2, checksums=False)


def test_a_save_without_checksums_loads_with_a_warning_that_says_so(tmp_path):
    path = str(tmp_path / "run")
    testing.run(functools.partial(_save_unchecked, path), world_size=2)
    for r in testing.run(functools.partial(_load, path), world_size=2, timeout=60):
        assert r["error"] is None and r["same"]
        assert any("save(checksums=False)" in w for w in r["warnings"]), r["warnings"]


def _saves_keeping(path: str, keep: int, steps: list[int], rank: int) -> list[str]:
    state, opt_state = _setup(0)
    for step in steps:
        checkpoint.save(path, state, opt_state, step=step, keep=keep)
    return sorted(os.listdir(path))


def _saved_names(path: str, rank: int) -> list[str]:
    state, opt_state = _setup(0)
    return [os.path.basename(checkpoint.save(path, state, opt_state, keep=1)) for _ in range(4)]


def test_saves_with_keep_never_reuse_the_name_latest_points_to(tmp_path):
    """Retention shrinks the directory, so names cannot come from a count of its entries:
    the next save would overwrite the checkpoint LATEST names."""
    path = str(tmp_path / "run")
    names = testing.run(functools.partial(_saved_names, path), world_size=2)[0]
    assert len(set(names)) == 4, names
    visible = [n for n in os.listdir(path) if not n.startswith(".")]  # .funcshard: writers
    assert sorted(visible) == sorted([checkpoint.LATEST, names[-1]])
    assert integrity.verify(_latest_dir(path)).ok


def _dies_while_saving(path: str, rank: int) -> None:
    """Rank 1 dies after DCP wrote its files, before the checksums and the commit."""
    state, opt_state = _setup(0)
    real = checkpoint.dcp.dcp_save

    def dcp_save_then_die(state_dict, directory, *rest):
        real(state_dict, directory, *rest)
        if rank == 1:
            os._exit(9)

    checkpoint.dcp.dcp_save = dcp_save_then_die
    checkpoint.save(path, state, opt_state, step=9, keep=1)


def test_keep_deletes_older_checkpoints_but_never_the_last_complete_one(tmp_path):
    path = str(tmp_path / "run")
    os.makedirs(os.path.join(path, "saved_model-1"))  # the user's, not a checkpoint
    open(os.path.join(path, "saved_model-1", "weights.bin"), "w").close()
    os.makedirs(os.path.join(path, "save-0"))  # named like one, holding something else
    open(os.path.join(path, "save-0", "notes.txt"), "w").close()
    names = testing.run(functools.partial(_saves_keeping, path, 2, [1, 2, 3]), world_size=2)[0]
    assert [n.split("-")[1] for n in names if n.startswith("step-")] == ["2", "3"]
    with pytest.raises((testing.RankDied, TimeoutError)):
        testing.run(functools.partial(_dies_while_saving, path), world_size=2, fresh=True)
    latest = _latest_dir(path)
    assert os.path.basename(latest).startswith("step-3-")  # the dead save never committed
    assert integrity.verify(latest).ok
    assert any(n.startswith("step-2-") for n in os.listdir(path))  # nothing deleted either
    names = testing.run(functools.partial(_saves_keeping, path, 1, [10]), world_size=2)[0]
    assert [n for n in names if n.startswith("step-")] == [n for n in names if "step-10-" in n]
    assert {"saved_model-1", "save-0"} <= set(names)  # never deleted
