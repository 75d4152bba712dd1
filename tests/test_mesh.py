"""Mesh: sizes, groups and ranks on real gloo process groups, and its errors."""

import functools
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import funcshard as fs
from funcshard import testing


def _describe(kwargs: dict, rank: int) -> tuple:
    mesh = fs.Mesh(**kwargs)
    return (
        mesh.replicate_rank,
        mesh.shard_rank,
        dist.get_process_group_ranks(mesh.shard_group),
        dist.get_process_group_ranks(mesh.replicate_group),
        str(mesh.device),
        hash(mesh) == hash(fs.Mesh(**kwargs)),
    )


def test_fsdp_mesh_shards_over_every_rank():
    out = testing.run(functools.partial(_describe, {"shard": 2}), world_size=2)
    assert out == [(0, 0, [0, 1], [0], "cpu", True), (0, 1, [0, 1], [1], "cpu", True)]


def test_ddp_mesh_replicates_over_every_rank():
    out = testing.run(functools.partial(_describe, {"replicate": 2}), world_size=2)
    assert [o[:4] for o in out] == [(0, 0, [0], [0, 1]), (1, 0, [1], [0, 1])]


def test_hsdp_mesh_shards_within_rows_and_replicates_across_them():
    out = testing.run(functools.partial(_describe, {"replicate": 2, "shard": 2}), world_size=4)
    assert [o[:4] for o in out] == [
        (0, 0, [0, 1], [0, 2]),
        (0, 1, [0, 1], [1, 3]),
        (1, 0, [2, 3], [0, 2]),
        (1, 1, [2, 3], [1, 3]),
    ]


def _mismatched_mesh(rank: int) -> None:
    fs.Mesh(shard=3)


def test_a_mesh_that_does_not_fit_the_world_fails_on_every_rank():
    with pytest.raises(ValueError, match=r"the mesh has 3 ranks but the world has 2") as info:
        testing.run(_mismatched_mesh, world_size=2)
    assert "ranks [1] raised too" in str(info.value.__cause__)


def _from_device_mesh(rank: int) -> tuple:
    flat = fs.Mesh.from_device_mesh(init_device_mesh("cpu", (4,)))
    grid = fs.Mesh.from_device_mesh(
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    )
    ddp = fs.Mesh.from_device_mesh(init_device_mesh("cpu", (4,), mesh_dim_names=("replicate",)))
    return (
        (flat.replicate, flat.shard, flat.shard_rank),
        (grid.replicate, grid.shard, grid.shard_rank, grid.replicate_rank),
        (ddp.replicate, ddp.shard, ddp.replicate_rank),
        grid == fs.Mesh(replicate=2, shard=2),
    )


def test_from_device_mesh_reads_one_or_two_axes():
    out = testing.run(_from_device_mesh, world_size=4)
    assert [o[0] for o in out] == [(1, 4, r) for r in range(4)]
    assert [o[1] for o in out] == [(2, 2, r % 2, r // 2) for r in range(4)]
    assert [o[2] for o in out] == [(4, 1, r) for r in range(4)]
    assert all(o[3] for o in out)


def test_mesh_needs_an_initialized_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        fs.Mesh(shard=2)


def test_from_env_outside_torchrun_says_how_to_launch(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node N"):
        fs.Mesh.from_env()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"shard": 0}, ValueError, "shard must be at least 1, got 0"),
        ({"replicate": 2.0}, TypeError, "replicate must be an int, got float"),
    ],
)
def test_bad_sizes_are_rejected_before_any_communication(kwargs, error, message):
    with pytest.raises(error, match=message):
        fs.Mesh(**kwargs)


def test_from_env_under_torchrun_shards_over_all_ranks():
    script = Path(__file__).parent / "scripts" / "torchrun_mesh.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "rank 0: shard 0/2 cpu sum 3" in out.stdout
    assert "rank 1: shard 1/2 cpu sum 3" in out.stdout


def _settings_stay_with_their_mesh(rank: int) -> tuple[bool, bool, bool]:
    from funcshard import collectives

    checked = fs.Mesh(shard=2, check_collectives=True, timeout=timedelta(seconds=3))
    checked_group = checked.shard_group
    plain = fs.Mesh(shard=2)
    world = dist.group.WORLD
    return (
        checked_group.group_name in collectives._checked_groups,
        plain.shard_group.group_name in collectives._checked_groups,
        world.group_name in collectives._checked_groups,
    )


def test_a_mesh_with_checks_or_a_timeout_leaves_the_default_group_and_other_meshes_alone():
    """A device mesh dimension spanning every rank is the default group itself: configuring
    it would check (and time out) every later collective of every mesh in the process."""
    for own, plain, world in testing.run(_settings_stay_with_their_mesh, world_size=2):
        assert own and not plain and not world
