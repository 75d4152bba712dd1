"""Mesh: sizes, groups and ranks on real gloo process groups, and its errors."""

import functools
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import funcshard as fs
from funcshard import testing
from funcshard.comm._launch import LAUNCHER_VARIABLES, launched_alone


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


@pytest.mark.quick
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


def test_from_env_with_some_launcher_variables_missing_names_them(monkeypatch):
    for var in LAUNCHER_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(
        RuntimeError, match=r"RANK, WORLD_SIZE, MASTER_ADDR not set, though MASTER_PORT is\. "
        r"Launch with `torchrun --nproc-per-node N"
    ):  # fmt: skip
        fs.Mesh.from_env()
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"MASTER_ADDR not set, though RANK, WORLD_SIZE, MAS"):
        launched_alone({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "1", "LOCAL_RANK": "0"})
    assert launched_alone({"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"})
    assert not launched_alone(dict.fromkeys(LAUNCHER_VARIABLES[:4], "0"))


def test_from_env_without_a_launcher_trains_as_one_process():
    """`python train.py` with no launcher variable set: Mesh.from_env() raised "RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"; now it is a world of one process, and
    one sharded step equals plain PyTorch's."""
    script = Path(__file__).parents[1] / "scripts" / "plain_python_step.py"
    keep = ("PATH", "HOME", "TMPDIR", "LANG")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "OK"


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


def _from_env_axes(rank: int) -> dict:
    out = {}
    for shard in (None, 1, 2):
        mesh = fs.Mesh.from_env(shard=shard)
        out[shard] = (mesh.replicate, mesh.shard, mesh.rank)
    try:
        fs.Mesh.from_env(shard=3)
    except ValueError as e:
        out["bad"] = str(e)
    return out


def test_from_env_takes_the_shard_axis_size_and_each_rank_knows_its_place():
    """`from_env(shard=1)` is DDP's mesh, the default FSDP's; `mesh.rank` is the rank's
    place in the mesh (a DDP script's `dist.get_rank()`); a size not dividing the world is
    refused on every rank alike."""
    results = testing.run(_from_env_axes, world_size=2)
    for rank, out in enumerate(results):
        assert out[None] == (1, 2, rank) and out[1] == (2, 1, rank) and out[2] == (1, 2, rank)
        assert "dividing the world size 2" in out["bad"] and "got 3" in out["bad"]
    assert results[0]["bad"] == results[1]["bad"]


def _settings_stay_with_their_mesh(rank: int) -> tuple[bool, bool, bool]:
    from funcshard.comm import _collective_checks as collective_checks

    checked = fs.Mesh(shard=2, check_collectives=True, timeout=timedelta(seconds=3))
    checked_group = checked.shard_group
    plain = fs.Mesh(shard=2)
    world = dist.group.WORLD
    return (
        checked_group.group_name in collective_checks._checked_groups,
        plain.shard_group.group_name in collective_checks._checked_groups,
        world.group_name in collective_checks._checked_groups,
    )


def test_a_mesh_with_checks_or_a_timeout_leaves_the_default_group_and_other_meshes_alone():
    """A device mesh dimension spanning every rank is the default group itself: configuring
    it would check (and time out) every later collective of every mesh in the process."""
    for own, plain, world in testing.run(_settings_stay_with_their_mesh, world_size=2):
        assert own and not plain and not world


def _timeout_of(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _default_timeout_and_groups(rank: int) -> dict:
    world = dist.group.WORLD
    fs.Mesh(shard=2), fs.Mesh(replicate=2)  # the pool's first default meshes, if these are
    groups = len(dist.distributed_c10d._world.pg_map)
    fsdp, ddp = fs.Mesh(shard=2), fs.Mesh(replicate=2)
    added = len(dist.distributed_c10d._world.pg_map) - groups
    seconds = fs.Mesh(shard=2, timeout=30)
    os.environ["FUNCSHARD_TIMEOUT"] = "45"
    try:
        from_env = fs.Mesh(shard=2)
    finally:
        del os.environ["FUNCSHARD_TIMEOUT"]
    return {
        "timeouts": (fsdp.timeout, ddp.timeout, seconds.timeout, from_env.timeout),
        "own group timeouts": (
            _timeout_of(fsdp.replicate_group),
            _timeout_of(ddp.shard_group),
            _timeout_of(seconds.shard_group),
        ),
        "share the default group": fsdp.shard_group == world and ddp.group == world,
        "groups added": added,
    }


def test_a_mesh_waits_at_most_ten_minutes_by_default_or_funcshard_timeout_seconds():
    """A mesh had no timeout (gloo's 30 minutes applied), and `Mesh(timeout=30)` failed in
    pybind ("incompatible function arguments"). The default mesh shares the pool's default
    group, whose timeout it is, and builds no group of its own per mesh."""
    ten = timedelta(minutes=10)
    for out in testing.run(_default_timeout_and_groups, world_size=2):
        assert out["timeouts"] == (ten, ten, timedelta(seconds=30), timedelta(seconds=45))
        assert out["own group timeouts"] == (ten, ten, timedelta(seconds=30))
        assert out["share the default group"] and out["groups added"] == 0


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: fs.Mesh(shard=2, timeout="30s"), TypeError, r"funcshard\.Mesh: timeout must "
         r"be a datetime\.timedelta or seconds as a number, got '30s'"),
        (lambda: fs.Mesh(timeout=-5), ValueError, r"funcshard\.Mesh: timeout must be positive"),
        (lambda: fs.Mesh(timeout=timedelta(0)), ValueError, r"timeout must be positive .*0 s"),
        (lambda: fs.Mesh(timeout=timedelta(days=10**6)), ValueError, "at most 365 days"),
        (lambda: fs.Mesh(timeout=float("nan")), ValueError, "timeout must be positive"),
        (lambda: fs.Mesh.from_env(timeout=True), TypeError,
         r"funcshard\.Mesh\.from_env: timeout must be a datetime\.timedelta"),
        (lambda: fs.Mesh.from_device_mesh(None, timeout=0), ValueError,
         r"funcshard\.Mesh\.from_device_mesh: timeout must be positive"),
        (lambda: fs.shutdown(timeout=[30]), TypeError, r"funcshard\.shutdown: timeout must be"),
        (lambda: fs.shutdown(timeout=-1.0), ValueError, r"funcshard\.shutdown: timeout must be"),
    ],
)  # fmt: skip
def test_a_bad_timeout_is_refused_naming_the_argument_before_any_communication(
    call, error, message
):
    """A negative or 10**6-day timeout reached gloo raw, and timedelta(0) was accepted."""
    with pytest.raises(error, match=message):
        call()


def test_a_bad_funcshard_timeout_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("FUNCSHARD_TIMEOUT", "ten minutes")
    with pytest.raises(ValueError, match=r"FUNCSHARD_TIMEOUT: seconds as a number, got 'ten"):
        fs.Mesh(shard=2)
    monkeypatch.setenv("FUNCSHARD_TIMEOUT", "0")
    with pytest.raises(ValueError, match=r"FUNCSHARD_TIMEOUT: the timeout must be positive"):
        fs.Mesh(shard=2)


def _shutdown_alone(rank: int) -> tuple[float, str]:
    if rank == 0:
        return 0.0, "rank 0 went on (it has more batches)"
    start = time.monotonic()
    try:
        fs.shutdown(timeout=1)
    except fs.CollectiveError as e:
        return time.monotonic() - start, str(e)
    return time.monotonic() - start, "returned"


def test_shutdown_raises_within_its_timeout_naming_the_rank_that_never_came():
    """Rank 1 left its loop and called shutdown while rank 0 went on: gloo's monitored
    barrier bounds only rank 0's wait, so rank 1 waited out the group's timeout (10 minutes
    here, 30 on a plain gloo group) without a word."""
    _, (waited, message) = testing.run(_shutdown_alone, world_size=2, timeout=20)
    assert waited < 4, waited
    assert message.startswith("funcshard.shutdown: every rank of [0, 1] within 1 s, got rank 0 "
                              "not there (rank 1 waited)"), message  # fmt: skip
    assert "Give every rank the same way out of the loop" in message


def _sub_mesh_step(kind: str, rank: int) -> dict:
    """One Muon + AdamW step of a GPT on a mesh over part of the world, each part its own
    (4 ranks: FSDP over {0, 1} and over {2, 3}, or HSDP 1x2 sliced out of a 3-D mesh), and
    the same step in one process on the part's whole batch."""
    from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

    if kind.startswith("1-D slice"):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "fsdp"))
        mesh = fs.Mesh.from_device_mesh(world["fsdp"])
    else:  # a (replicate, shard) slice of a mesh with a third axis
        world = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "replicate", "shard"))
        mesh = fs.Mesh.from_device_mesh(world["replicate", "shard"])
    part = rank // 2  # the two parts train on different data
    cfg = GPTConfig(n_layer=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    label = lambda fqn, p: "muon" if p.ndim == 2 and "blocks" in fqn else "adamw"  # noqa: E731
    # eps 1e-3: Adam's first step on a near-zero gradient divides rounding noise by itself
    groups = {"muon": fs.optim.muon(0.02), "adamw": fs.optim.adamw(3e-3, eps=1e-3)}
    opt = fs.optim.partition(groups, label)
    x, y = random_tokens(cfg, 4, seed=part)
    mine = x.chunk(2)[rank % 2], y.chunk(2)[rank % 2]

    def loss(params, x, y):
        logits = fs.call(model, params, x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    reshard = 1 if kind.endswith("resharded to 1") else True  # (a group of one rank per slice)
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    state = fs.shard(model, plan, mesh, reshard_after_forward=reshard)
    _, grads = fs.value_and_grad(loss)(state, *mine)
    state, _ = opt.step(grads, opt.init(state), state)
    alone = fs.extract(model)[0]
    _, one_grads = fs.value_and_grad(loss)(alone, x, y)
    alone, _ = opt.step(one_grads, opt.init(alone), alone)
    return {"mesh ranks": list(mesh.ranks), "sharded": dict(fs.unshard(state)), "alone": alone}


@pytest.mark.parametrize("kind", ["1-D slice", "1-D slice, resharded to 1", "2-D slice"])
def test_a_mesh_over_part_of_the_world_trains_as_one_process(kind):
    """Broke: wrapping a DeviceMesh over part of the world built new process groups, which
    is a collective of every rank of the world; each part built its own, so ranks hung in
    `Mesh.from_device_mesh` or met the other part's ranks in its groups (its whole-mesh
    group and `reshard_after_forward=k`'s groups likewise)."""
    out = testing.run(functools.partial(_sub_mesh_step, kind), world_size=4, timeout=120)
    assert [o["mesh ranks"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for o in out:  # within Muon's own bf16 noise, per parameter
        for fqn, want in o["alone"].items():
            error = ((o["sharded"][fqn] - want).norm() / want.norm()).item()
            assert error < 1e-2, f"{fqn}: {error:.2e}"
