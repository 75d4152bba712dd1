"""Replicate: functional DDP, as sharding over a mesh whose shard axis has size 1.

[Note: DDP is a mesh shape]
`replicate(model, Mesh(replicate=N))` is `shard` with two choices, not a second engine: the
plan's units are DDP's gradient buckets (`policy.buckets`), parameters packed in the reverse
order their gradients become ready; and the shard axis has size 1, so every "gather" returns
the local full parameters without communicating. In backward, when the last gradient of a
bucket is accumulated, the bucket's all-reduce over the replicate axis is issued at once,
overlapping the rest of backward (see [Note: per-unit gathering]). `comm_dtype` is the mixed
precision reduce dtype: gradients travel in it and come back in the parameter dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from funcshard.mesh import Mesh
from funcshard.plan import plan
from funcshard.policy import buckets
from funcshard.precision import MixedPrecision
from funcshard.state import ShardedState
from funcshard.transforms import shard


def replicate(
    model: nn.Module,
    mesh: Mesh,
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    comm_dtype: torch.dtype | None = None,
    ignored: Iterable[nn.Module | nn.Parameter | str] = (),
    seed: int = 0,
    reduce_ignored: bool = True,
) -> ShardedState:
    """Full parameters on every rank, gradients all-reduced in buckets (DDP).

    The result is a ShardedState usable wherever one is: `call`, `value_and_grad`, `optim`,
    `unshard` (which returns the parameters). Buffers are broadcast from the first rank.
    `ignored` parameters stay out of the buckets; `reduce_ignored`: see `funcshard.plan`.
    Communicates: what `shard` does (a fingerprint check and the buffers).
    """
    if mesh.shard_size != 1:
        raise ValueError(
            f"funcshard.replicate: the mesh must have shard=1 (every rank holds every "
            f"parameter), got {mesh}. Use funcshard.shard for a sharded mesh, or "
            f"Mesh(replicate={mesh.size})."
        )
    bucket_plan = plan(
        model,
        policy=buckets(bucket_mb, first_bucket_mb),
        ignored=ignored,
        reduce_ignored=reduce_ignored,
    )
    mp = MixedPrecision(reduce_dtype=comm_dtype) if comm_dtype is not None else None
    return shard(model, bucket_plan, mesh, mp=mp, reshard_after_forward=False, seed=seed)
