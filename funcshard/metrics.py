"""Reductions across the data-parallel ranks, for metrics and logging: JAX's psum and pmean
over a mesh's ranks, and the global gradient norm.

A rank's loss is the loss of its own batch; what a log should show is the mean over every
data-parallel rank. `pmean(tree, mesh)` is that, for every tensor of a pytree (numbers and
integer tensors are packed into one float64 buffer, floating-point tensors into one buffer
per dtype, each reduced in one collective and unpacked in their dtypes). `axis=` reduces
over one mesh axis only: `pmean(delta, mesh, axis="replicate")` averages what the replicas
of each shard hold (a parameter delta in local SGD / DiLoCo, see examples/diloco.py), and
works on ShardedState and ShardedGrads as on any pytree of tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor

from funcshard import collectives
from funcshard.mesh import Mesh
from funcshard.state import ShardedGrads, ensure_live


def psum(tree: Any, mesh: Mesh, axis: str | None = None) -> Any:
    """Each tensor (or number) of `tree` summed over every rank of `mesh` (or of one mesh
    `axis`, "shard" or "replicate"), the same result on each of those ranks, as tensors.
    Communicates: one all-reduce over the mesh (or axis) per floating dtype, one more for
    numbers and integers."""
    return _reduced(tree, mesh, mean=False, axis=axis)


def pmean(tree: Any, mesh: Mesh, axis: str | None = None) -> Any:
    """Each tensor (or number) of `tree` averaged over every rank of `mesh` (or of one mesh
    `axis`, "shard" or "replicate"), the same result on each of those ranks, as tensors.
    Communicates: one all-reduce over the mesh (or axis) per floating dtype, one more for
    numbers and integers."""
    return _reduced(tree, mesh, mean=True, axis=axis)


def global_norm(grads: ShardedGrads | Mapping[str, Tensor | None]) -> Tensor:
    """The L2 norm of the whole gradient, a 0-d float32 tensor: `clip_grad_norm_`'s total
    norm. Of ShardedGrads: every parameter of every rank's shard counted once, the same on
    every rank (one all-reduce of one number over the shard axis; replicas hold the same
    shards). Of a dict of gradients: this process's, no communication."""
    if not isinstance(grads, ShardedGrads):
        return _sum_of_squares(grads.values(), None).sqrt()
    ensure_live(grads, "global_norm")
    device = grads.layout.mesh.device
    squares = collectives.all_reduce(
        _sum_of_squares(grads.shards, device),
        grads.layout.mesh.shard_group,
        "sum",
        what="<global grad norm>",
    ).wait()
    # replicated (ignored) parameters' gradients are whole on every rank: counted once
    return (squares + _sum_of_squares(grads.replicated.values(), device)).sqrt()


def _sum_of_squares(grads: Iterable[Tensor | None], device: torch.device | None) -> Tensor:
    present = [g for g in grads if g is not None]
    if not present:
        return torch.zeros((), device=device)
    return torch.stack([g.float().square().sum() for g in present]).sum()


def _reduced(tree: Any, mesh: Mesh, mean: bool, axis: str | None) -> Any:
    where = f"funcshard.{'pmean' if mean else 'psum'}"
    if axis not in (None, "shard", "replicate"):
        raise ValueError(f"{where}: axis must be None, 'shard' or 'replicate', got {axis!r}.")
    leaves, spec = optree.tree_flatten(tree)
    if not all(isinstance(x, Tensor | int | float | bool) for x in leaves):
        bad = next(type(x).__name__ for x in leaves if not isinstance(x, Tensor | int | float))
        raise TypeError(
            f"{where}: leaves must be tensors or numbers, got a {bad}. Pass the metrics as "
            f"tensors (e.g. loss.detach())."
        )
    tensors = [torch.as_tensor(x, device=mesh.device) for x in leaves]
    if not tensors:
        return tree
    group, size = {
        None: (mesh.group, mesh.size),
        "shard": (mesh.shard_group, mesh.shard_size),
        "replicate": (mesh.replicate_group, mesh.replicate_size),
    }[axis]
    # one buffer per floating dtype, reduced in it; numbers and integers in float64
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype if t.is_floating_point() else torch.float64, []).append(i)
    out: list[Tensor | None] = [None] * len(tensors)
    for dtype, indices in by_dtype.items():
        packed = torch.cat(
            [tensors[i].detach().to(mesh.device, dtype).reshape(-1) for i in indices]
        )
        total = collectives.all_reduce(packed, group, "sum", what="<metrics>").wait()
        if mean:
            total = total / size
        at = 0
        for i in indices:
            t = tensors[i]
            out[i] = total[at : at + t.numel()].reshape(t.shape)
            at += t.numel()
    return optree.tree_unflatten(spec, out)
