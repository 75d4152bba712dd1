"""Reductions across the data-parallel ranks, for metrics and logging: JAX's psum and pmean
over a mesh's ranks, and the global gradient norm.

A rank's loss is the loss of its own batch; what a log should show is the mean over every
data-parallel rank. `pmean(tree, mesh)` is that, for every tensor of a pytree in one
collective (the leaves are packed into one float64 buffer and unpacked in their dtypes).
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


def psum(tree: Any, mesh: Mesh) -> Any:
    """Each tensor (or number) of `tree` summed over every rank of `mesh`, the same result on
    every rank, as tensors. Communicates: one all-reduce over the mesh."""
    return _reduced(tree, mesh, mean=False)


def pmean(tree: Any, mesh: Mesh) -> Any:
    """Each tensor (or number) of `tree` averaged over every rank of `mesh`, the same result
    on every rank, as tensors. Communicates: one all-reduce over the mesh."""
    return _reduced(tree, mesh, mean=True)


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


def _reduced(tree: Any, mesh: Mesh, mean: bool) -> Any:
    leaves, spec = optree.tree_flatten(tree)
    if not all(isinstance(x, Tensor | int | float | bool) for x in leaves):
        bad = next(type(x).__name__ for x in leaves if not isinstance(x, Tensor | int | float))
        raise TypeError(
            f"funcshard.{'pmean' if mean else 'psum'}: leaves must be tensors or numbers, got "
            f"a {bad}. Pass the metrics as tensors (e.g. loss.detach())."
        )
    tensors = [torch.as_tensor(x, device=mesh.device) for x in leaves]
    if not tensors:
        return tree
    packed = torch.cat([t.detach().to(mesh.device, torch.float64).reshape(-1) for t in tensors])
    total = collectives.all_reduce(packed, mesh.group, "sum", what="<metrics>").wait()
    if mean:
        total = total / mesh.size
    out, at = [], 0
    for t in tensors:
        piece = total[at : at + t.numel()].reshape(t.shape)
        at += t.numel()
        out.append(piece.to(t.dtype if t.is_floating_point() else torch.float64))
    return optree.tree_unflatten(spec, out)
