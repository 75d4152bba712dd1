"""The device mesh: how the data-parallel ranks are laid out as (replicate, shard) axes.

[Note: one mesh shape for DDP, FSDP and HSDP]
Every mesh has both axes, `replicate` and `shard`; a strategy is only a choice of sizes:
FSDP is `Mesh(shard=N)` (replicate 1), DDP is `Mesh(replicate=N)` (shard 1), HSDP is
`Mesh(replicate=R, shard=S)`. The transforms never branch on a strategy name: a size-1 axis
simply has nothing to communicate. Underneath is a 2-D `DeviceMesh` named
("replicate", "shard"), built once per shape and reused, since creating process groups costs
a rendezvous on every rank.

This module only builds groups; every collective goes through `funcshard.comm._collectives`.

"""

from __future__ import annotations

import functools
import math
import numbers
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from funcshard.comm import _collective_checks as collective_checks
from funcshard.comm import _collectives as collectives
from funcshard.comm import _flight_recorder as flight_recorder
from funcshard.comm import _launch as launch
from funcshard.comm import _mesh_groups as mesh_groups
from funcshard.comm import _progress as progress
from funcshard.comm import _waits as waits

AXES = mesh_groups.AXES
DEFAULT_TIMEOUT = timedelta(minutes=10)  # NCCL's own default; gloo's is 30 minutes
MAX_TIMEOUT = timedelta(days=365)  # beyond it gloo's milliseconds overflow
# every group a traced step may read (the non-finite check gathers over `group`)
_RESOLVED_AT_INIT = ("shard_rank", "replicate_rank", "shard_group", "replicate_group", "group")
_PER_PROCESS = _RESOLVED_AT_INIT


@dataclass(frozen=True)
class Mesh:
    """A (replicate, shard) layout of the data-parallel ranks, on one device type.

    `Mesh(shard=N)` is FSDP over N ranks, `Mesh(replicate=N)` DDP, and
    `Mesh(replicate=R, shard=S)` HSDP. The product of the sizes must be the world size.
    `device=None` picks cuda when the default process group runs NCCL, else cpu.

    `timeout` bounds how long a collective waits for the other ranks: a
    `datetime.timedelta` or seconds as a number, positive and at most 365 days; by default
    10 minutes (NCCL's own default; torch's gloo default of 30 minutes does not apply), or
    the seconds in env FUNCSHARD_TIMEOUT. Past it the waiting ranks raise
    `failures.CollectiveError` naming the operation, the unit and the ranks. (On NCCL
    torch's watchdog aborts the process instead.) It is set on the mesh's own groups; the
    default group keeps the caller's settings (a mesh with the same timeout shares it, any
    other uses a copy of it). Waits long by nature have bounds of their own (see [Note:
    waits long by nature]).
    `check_collectives=True` (default: env FUNCSHARD_CHECK_COLLECTIVES=1 or
    TORCH_DISTRIBUTED_DEBUG=DETAIL) compares every collective across ranks before issuing
    it, so ranks that diverge raise at once, together; it costs one small all-gather per
    collective, so it is for debugging.
    """

    replicate: int = 1
    shard: int = 1
    device_type: str | None = None
    ranks: tuple[int, ...] = ()
    timeout: timedelta = field(default_factory=lambda: default_timeout())
    check_collectives: bool = field(default_factory=lambda: _debug_from_env())
    _device_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        where = f"Mesh(replicate={self.replicate}, shard={self.shard})"
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool):
                raise TypeError(f"{where}: {axis} must be an int, got {type(size).__name__}.")
            if size < 1:
                raise ValueError(f"{where}: {axis} must be at least 1, got {size}.")
        timeout = default_timeout() if self.timeout is None else self.timeout
        object.__setattr__(self, "timeout", checked_timeout(timeout, "funcshard.Mesh"))
        if self._device_mesh is None:
            self._build_device_mesh(where)
        self._resolve()

    def __getstate__(self) -> dict:
        """Pickled without its process groups, which belong to this process."""
        return {k: v for k, v in self.__dict__.items() if k not in _PER_PROCESS}

    def __setstate__(self, state: dict) -> None:
        """A copy (or a mesh read back in a process of the same job) resolves its groups at
        once, as a new mesh does."""
        self.__dict__.update(state)
        if self.__dict__.get("timeout") is None:  # pickled before meshes had a default
            self.__dict__["timeout"] = default_timeout()
        if dist.is_available() and dist.is_initialized():
            self._resolve_here()

    def _resolve_here(self) -> None:
        """Resolve the groups of a mesh read back from a pickle, refusing one whose process
        groups this process does not have (a state pickled in another job or world)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        found = None
        if rank in self.ranks and max(self.ranks) < world:
            try:
                self._resolve()
                found = {axis: getattr(self, f"{axis}_group") for axis in AXES}
            except RuntimeError as e:
                detail = f"here: {e}"
            else:
                grid = self.device_mesh.mesh
                row, col = (grid == rank).nonzero()[0].tolist()
                expected = {"shard": grid[row].tolist(), "replicate": grid[:, col].tolist()}
                wrong = [
                    f"its {axis} group is over ranks {dist.get_process_group_ranks(group)} here, "
                    f"not {expected[axis]}"
                    for axis, group in found.items()
                    if dist.get_process_group_ranks(group) != expected[axis]
                ]
                if not wrong:
                    return
                detail = "; ".join(wrong)
        else:
            detail = f"this world has {world} ranks and this is rank {rank}"
        raise ValueError(
            f"funcshard.Mesh(replicate={self.replicate}, shard={self.shard}): a mesh whose "
            f"process groups exist in this world, got one read back from a pickle made in "
            f"another (over ranks {list(self.ranks)}; {detail}). Process groups belong to the "
            f"job that made them: build the state again in this job (funcshard.shard or "
            f"funcshard.replicate), and carry values across jobs and world sizes with "
            f"funcshard.checkpoint.save and load(path, like=...)."
        )

    def _resolve(self) -> None:
        # Resolved now, not on first use: a step that dynamo traces reads them from the
        # instance (it would otherwise trace into cached_property's lock and break the graph).
        for name in _RESOLVED_AT_INIT:
            getattr(self, name)

    def _build_device_mesh(self, where: str) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{where}: torch.distributed is not initialized. Use Mesh.from_env() (under "
                f"torchrun: every rank; plain python: one process), or call "
                f"torch.distributed.init_process_group(...) first (funcshard.testing.run does "
                f"this for tests)."
            )
        world = dist.get_world_size()
        if self.replicate * self.shard != world:
            raise ValueError(
                f"{where}: the mesh has {self.replicate * self.shard} ranks but the world has "
                f"{world}. Choose sizes whose product is {world}, e.g. Mesh(shard={world}) for "
                f"FSDP or Mesh(replicate={world}) for DDP."
            )
        device_type = self.device_type or _default_device_type()
        flight_recorder.switch_on(str(dist.get_backend()))  # before this mesh's groups
        object.__setattr__(self, "device_type", device_type)
        object.__setattr__(self, "ranks", tuple(range(world)))
        object.__setattr__(
            self,
            "_device_mesh",
            mesh_groups.world_mesh(
                device_type, (self.replicate, world // self.replicate), AXES, self._options
            ),
        )

    @classmethod
    def from_env(
        cls,
        device_type: str | None = None,
        timeout: timedelta | float | None = None,
        *,
        shard: int | None = None,
    ) -> Mesh:
        """Shard over every rank that torchrun started, initializing torch.distributed if needed.

        `shard` sizes the shard axis and the replicate axis takes the rest: None (the
        default) shards over every rank (FSDP), `shard=1` replicates on every rank (DDP:
        `fs.replicate`'s mesh), `shard=8` on 16 ranks is HSDP 2x8. It must divide the world
        size (ValueError, the same on every rank, otherwise).

        Run without a launcher (`python train.py`: none of RANK, WORLD_SIZE, LOCAL_RANK,
        MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID set), it makes a world of one process
        and returns its mesh of size 1, so the same script runs alone and under torchrun
        (see [Note: from_env without a launcher] in funcshard/comm/_launch.py). With some
        of them set and others missing it raises RuntimeError naming the missing ones.

        Picks cuda + NCCL (one GPU per local rank) when the process sees a GPU, else cpu + gloo.
        `timeout` is the mesh's (see `Mesh`; None: 10 minutes or FUNCSHARD_TIMEOUT); when
        this call initializes torch.distributed, the default group and its rendezvous get it
        too.
        """
        where = "funcshard.Mesh.from_env"
        timeout = default_timeout() if timeout is None else checked_timeout(timeout, where)
        if not dist.is_initialized():
            alone = launch.launched_alone(os.environ)
            use_cuda = device_type != "cpu" and torch.cuda.is_available()
            backend = "nccl" if use_cuda and dist.is_nccl_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            if alone:
                launch.init_alone(backend, timeout)
            else:
                launch.init_from_env(backend, timeout)
        world = dist.get_world_size()
        size = world if shard is None else shard
        if not isinstance(size, int) or isinstance(size, bool) or size < 1 or world % size:
            raise ValueError(
                f"{where}: shard must be a positive int dividing the world size {world} (or "
                f"None: shard over every rank), got {shard!r}. shard=1 replicates (DDP); "
                f"shard=S on R*S ranks is HSDP with R replicas."
            )
        return cls(replicate=world // size, shard=size, device_type=device_type, timeout=timeout)

    @classmethod
    def from_device_mesh(
        cls,
        device_mesh: DeviceMesh,
        timeout: timedelta | float | None = None,
        check_collectives: bool | None = None,
    ) -> Mesh:
        """Wrap a DeviceMesh: 2-D as (replicate, shard); 1-D as shard, or replicate if so named.

        The mesh's `timeout` (see `Mesh`; None: 10 minutes or FUNCSHARD_TIMEOUT) is set on
        its process groups, which are the caller's too; a dimension spanning every rank is
        the default group, which gets a copy of its own unless it has that timeout already.
        """
        where = "funcshard.Mesh.from_device_mesh"
        timeout = default_timeout() if timeout is None else checked_timeout(timeout, where)
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(
                f"{where}: device_mesh must be a torch.distributed DeviceMesh, got "
                f"{type(device_mesh).__name__}. Build one with init_device_mesh(...), or use "
                f"Mesh(shard=N)."
            )
        shape = tuple(device_mesh.mesh.shape)
        names = device_mesh.mesh_dim_names or ()
        if len(shape) == 2:
            replicate, shard = shape
        elif len(shape) == 1:
            replicate, shard = (shape[0], 1) if names == ("replicate",) else (1, shape[0])
        else:
            raise ValueError(
                f"Mesh.from_device_mesh: expected a 1-D or 2-D DeviceMesh, got shape {shape}. "
                f"Flatten the data-parallel dimensions into (replicate, shard) first."
            )
        if len(shape) == 1 or names != AXES:  # see [Note: a mesh over part of the world]
            device_mesh = mesh_groups.rewrapped(device_mesh, replicate, shard)
        return cls(
            replicate=replicate,
            shard=shard,
            device_type=device_mesh.device_type,
            ranks=tuple(device_mesh.mesh.flatten().tolist()),
            timeout=timeout,
            **({} if check_collectives is None else {"check_collectives": check_collectives}),
            _device_mesh=device_mesh,
        )

    @property
    def device_mesh(self) -> DeviceMesh:
        """The underlying 2-D ("replicate", "shard") DeviceMesh."""
        assert self._device_mesh is not None  # set by __post_init__ or from_device_mesh
        return self._device_mesh

    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        return self.replicate * self.shard

    @property
    def shard_size(self) -> int:
        """Number of ranks a parameter is sharded over."""
        return self.shard

    @property
    def replicate_size(self) -> int:
        """Number of replicas of each shard."""
        return self.replicate

    @property
    def rank(self) -> int:
        """This rank's index in the mesh, 0 to `size - 1` (replicas outer, shards inner):
        which part of the global batch it reads, as DDP scripts use `dist.get_rank()`."""
        return self.replicate_rank * self.shard + self.shard_rank

    @functools.cached_property
    def shard_rank(self) -> int:
        """This rank's index along the shard axis: which slice of each parameter it holds."""
        return self.device_mesh.get_local_rank("shard")

    @functools.cached_property
    def replicate_rank(self) -> int:
        """This rank's index along the replicate axis."""
        return self.device_mesh.get_local_rank("replicate")

    @functools.cached_property
    def shard_group(self) -> ProcessGroup:
        """The process group of the ranks that hold the other shards of this rank's params."""
        return self._configured(self.device_mesh.get_group("shard"))

    @functools.cached_property
    def replicate_group(self) -> ProcessGroup:
        """The process group of the ranks that hold the same shard as this rank."""
        return self._configured(self.device_mesh.get_group("replicate"))

    def post_forward_group(self, k: int) -> ProcessGroup:
        """The group of k consecutive shard ranks a unit is resharded over after forward
        (`reshard_after_forward=k`); built once per k, on every rank together."""
        if self.shard_size % k:
            raise ValueError(f"Mesh: {k} does not divide the shard size {self.shard_size}.")
        if self.size != dist.get_world_size():  # see [Note: a mesh over part of the world]
            row = self.device_mesh.mesh[self.replicate_rank].tolist()
            mine = tuple(row[self.shard_rank // k * k :][:k])
            return self._configured(mesh_groups.local_group(self.device_type, mine))
        shape = (self.replicate, self.shard // k, k)
        names = ("replicate", "shard_outer", "shard_inner")
        inner = mesh_groups.world_mesh(self.device_type or "cpu", shape, names, self._options)
        return self._configured(inner.get_group("shard_inner"))

    @functools.cached_property
    def group(self) -> ProcessGroup:
        """The process group of every rank in the mesh (for whole-mesh checks)."""
        if self.size == dist.get_world_size():
            assert dist.group.WORLD is not None  # the default group, which get_world_size needs
            return self._configured(dist.group.WORLD)
        if self.replicate == 1 or self.shard == 1:  # one axis: its group is the mesh's
            return self.shard_group if self.replicate == 1 else self.replicate_group
        # see [Note: a mesh over part of the world]
        return self._configured(mesh_groups.local_group(self.device_type, self.ranks))

    @property
    def _options(self) -> tuple[timedelta, bool]:
        """The settings that make this mesh's groups its own (part of the cache keys)."""
        return (self.timeout, self.check_collectives)

    def _configured(self, group: ProcessGroup) -> ProcessGroup:
        """Apply this mesh's timeout and collective checks to one of its groups. A device
        mesh hands out the default group itself for a dimension spanning every rank: that
        one is shared with every other mesh and the caller, whose settings it keeps, so a
        mesh with settings of its own gets a copy of it (made once per settings, by all
        ranks together). A mesh without checks whose timeout is the default group's own
        (under torchrun through `from_env`, or in funcshard.testing's pool) shares it."""
        if group == dist.group.WORLD:
            same = _timeout_of(group, self.device_type) == self.timeout
            if same and not self.check_collectives:
                return group
            group = mesh_groups.own_world(self._options)
        _set_pg_timeout(self.timeout, group)
        if self.check_collectives:
            collective_checks.check_group(group)
        return group

    @property
    def device(self) -> torch.device:
        """The device that compute and communication of this rank run on."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type or "cpu")


def check_mesh(value: object, where: str, argument: str = "mesh") -> None:
    """Raise TypeError, naming `argument`, unless `value` is a Mesh (before any collective)."""
    if isinstance(value, Mesh):
        return
    if isinstance(value, DeviceMesh):
        fix = "Wrap a DeviceMesh with funcshard.Mesh.from_device_mesh(device_mesh)."
    else:
        fix = "Make one with funcshard.Mesh(shard=N), Mesh(replicate=N) or Mesh.from_env()."
    got = f"the class {value.__name__}" if isinstance(value, type) else type(value).__name__
    raise TypeError(f"{where}: {argument} must be a funcshard.Mesh, got {got}. {fix}")


def default_timeout() -> timedelta:
    """A mesh's timeout when none is given: env FUNCSHARD_TIMEOUT (seconds), else 10 minutes."""
    text = os.environ.get("FUNCSHARD_TIMEOUT")
    if text is None or not text.strip():
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(
            f"FUNCSHARD_TIMEOUT: seconds as a number, got {text!r}. Set it to e.g. 600 (10 "
            f"minutes), or unset it for the default."
        ) from None
    return checked_timeout(seconds, "FUNCSHARD_TIMEOUT", "the timeout")


def checked_timeout(value: object, where: str, argument: str = "timeout") -> timedelta:
    """`value` as a timedelta: a timedelta, or seconds as an int or float; positive (at
    least a millisecond, gloo's unit) and at most 365 days. Checked before any collective."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(
            f"{where}: {argument} must be a datetime.timedelta or seconds as a number, got "
            f"{value!r}. Pass e.g. timedelta(minutes=10), or 600."
        )
    if not (math.isfinite(seconds) and 0.001 <= seconds <= MAX_TIMEOUT.total_seconds()):
        raise ValueError(
            f"{where}: {argument} must be positive (at least 1 ms) and at most 365 days, got "
            f"{value!r} ({seconds:g} s). Pass the longest wait a collective may take, e.g. "
            f"timedelta(minutes=10), or 600."
        )
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def _timeout_of(group: ProcessGroup, device_type: str | None) -> timedelta | None:
    """A group's current collective timeout on a device type (None if its backend does not
    say)."""
    try:
        return group._get_backend(torch.device(device_type or "cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _debug_from_env() -> bool:
    """Checks are on with FUNCSHARD_CHECK_COLLECTIVES=1, or torch's own
    TORCH_DISTRIBUTED_DEBUG=DETAIL, which checks torch's collectives the same way."""
    return (
        os.environ.get("FUNCSHARD_CHECK_COLLECTIVES") == "1"
        or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    )


def _default_device_type() -> str:
    backend = str(dist.get_backend())
    return "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"


def shutdown(timeout: timedelta | float = timedelta(seconds=30)) -> None:
    """Leave torch.distributed cleanly: wait for every rank, then destroy the process groups.

    Returns or raises within `timeout` (a timedelta or seconds as a number): every rank
    waits for the others to reach `shutdown` through the process group's store, with
    `timeout` as its bound on every rank (see [Note: waits long by nature]); a rank that has
    not arrived by then (stuck in user code, in a collective the others left, or gone) is
    named in the `CollectiveError` raised, and the groups are left as they are.

    Destroying groups while another rank still talks to them aborts a gloo process at exit
    ("terminate called without an active exception", about one run in three with a
    DeviceMesh in torch 2.13); a barrier once every rank has arrived closes that race.
    """
    where = "funcshard.shutdown"
    timeout = checked_timeout(timeout, where)
    if not dist.is_initialized():
        return
    world = dist.get_world_size()
    progress.leaving("fs.shutdown()")  # a rank still communicating names this one as gone
    waits.every_rank_arrives(
        "shutdown",
        range(world),
        timeout,
        where,
        "A rank that does not arrive is still running: stuck in user code, waiting in a "
        "collective the others left (e.g. it has more batches), or it ended without "
        "fs.shutdown(). Give every rank the same way out of the loop, or a longer "
        "shutdown(timeout=...).",
    )
    assert dist.group.WORLD is not None  # the default group: initialized, as checked above
    collectives.barrier(dist.group.WORLD, timeout)
    mesh_groups.forget()
    collective_checks.forget_checked_groups()
    dist.destroy_process_group()
    progress.forget()  # a new process group publishes afresh
