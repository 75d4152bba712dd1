"""The process groups under meshes, each made once per shape and settings and kept: those
of a mesh over the whole world by every rank together, those of a mesh over part of it by
its own ranks alone.

[Note: a mesh over part of the world]
Making a process group the usual way (`new_group`, `init_device_mesh`) is a collective of
every rank of the world, which must ask for the same groups in the same order. A mesh over
part of the world (a slice of a larger DeviceMesh, `mesh["fsdp"]`) is wrapped by each part
on its own, so its groups must not be made that way: each part would ask for different ones,
and ranks hung, or met the other part's ranks in a group of the same name. So such a mesh
keeps the slice's own groups (`rewrapped`), and any group it needs besides (a 1-D slice's
other axis, its whole-mesh group, `reshard_after_forward=k`'s groups) is made by its members
alone (`local_group`).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("replicate", "shard")

_WORLD_MESHES: dict[tuple[object, ...], DeviceMesh] = {}
_REWRAPPED: dict[tuple[object, ...], DeviceMesh] = {}
_LOCAL: dict[tuple[object, ...], ProcessGroup] = {}
_OWN_WORLDS: dict[tuple[object, ...], ProcessGroup] = {}  # copies of the default group


def world_mesh(
    device_type: str, shape: tuple[int, ...], names: tuple[str, ...], options: tuple
) -> DeviceMesh:
    """A DeviceMesh over the whole world, made once per shape, names and settings, by every
    rank in step; meshes with their own timeout or checks get their own groups."""
    key = (dist.group.WORLD, device_type, shape, names, options)
    if key not in _WORLD_MESHES:
        _WORLD_MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _WORLD_MESHES[key]


def own_world(options: tuple[timedelta, bool]) -> ProcessGroup:
    """A copy of the default group for a mesh with settings of its own, made once per
    settings by every rank."""
    key = (dist.group.WORLD, options)
    if key not in _OWN_WORLDS:
        _OWN_WORLDS[key] = dist.new_group(ranks=list(range(dist.get_world_size())))
    return _OWN_WORLDS[key]


def rewrapped(device_mesh: DeviceMesh, replicate: int, shard: int) -> DeviceMesh:
    """`device_mesh` as a ("replicate", "shard") DeviceMesh over its own process groups; a
    1-D one's other axis is a group of this rank alone (see [Note: a mesh over part of the
    world])."""
    ranks = tuple(device_mesh.mesh.flatten().tolist())
    key = (dist.group.WORLD, device_mesh.device_type, ranks, replicate, shard)
    if key not in _REWRAPPED:
        if device_mesh.ndim == 2:
            groups = [device_mesh.get_group(0), device_mesh.get_group(1)]
        else:
            alone = local_group(device_mesh.device_type, (dist.get_rank(),))
            own = device_mesh.get_group(0)
            groups = [own, alone] if shard == 1 else [alone, own]
        _REWRAPPED[key] = DeviceMesh.from_group(
            groups,
            device_mesh.device_type,
            mesh=device_mesh.mesh.reshape(replicate, shard),
            mesh_dim_names=AXES,
        )
    return _REWRAPPED[key]


def local_group(device_type: str | None, ranks: tuple[int, ...]) -> ProcessGroup:
    """The group of `ranks`, made by them alone, once (see [Note: a mesh over part of the
    world])."""
    key = (dist.group.WORLD, device_type, ranks)
    if key not in _LOCAL:
        _LOCAL[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _LOCAL[key]


def forget() -> None:
    """Drop every kept group and mesh (the process groups are being destroyed)."""
    for kept in (_WORLD_MESHES, _REWRAPPED, _LOCAL, _OWN_WORLDS):
        kept.clear()
