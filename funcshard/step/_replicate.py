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

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from funcshard.comm._mesh import Mesh, check_mesh
from funcshard.core._module import check_module
from funcshard.core._plan import plan
from funcshard.core._policy import buckets
from funcshard.core._precision import MixedPrecision
from funcshard.core._state import ShardedState
from funcshard.init._materialize import Init
from funcshard.step._sharding import shard_as


def replicate(
    model: nn.Module,
    mesh: Mesh,
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    comm_dtype: torch.dtype | None = None,
    ignored: Iterable[nn.Module | nn.Parameter | str] = (),
    seed: int | None = None,
    reduce_ignored: bool = True,
    init: Init = None,
    mp: MixedPrecision | None = None,
) -> ShardedState:
    """Full parameters on every rank, gradients all-reduced in buckets (DDP).

    The result is a ShardedState usable wherever one is: `call`, `value_and_grad`, `optim`,
    `unshard` (which returns the parameters). Buffers are broadcast from the first rank.
    `ignored` parameters stay out of the buckets; `reduce_ignored`: see `funcshard.plan`.
    `init` and `seed` mean what they mean for `funcshard.shard`: a meta-device model is
    initialized under `seed` by its modules' `reset_parameters()`, or by `init` (a
    transformers model: `init=model._init_weights`), to the values `shard` gives it on any
    mesh; a model built under `fs.deferred_init()` is its constructor's replay. `mp` is
    `shard`'s mixed precision: the forward runs in `mp.param_dtype`, and
    gradients are all-reduced in `mp.reduce_dtype`, which is what `comm_dtype` sets (give
    one of the two).
    Communicates: what `shard` does (a fingerprint check and the buffers).
    """
    where = "funcshard.replicate"
    check_module(model, where)
    check_mesh(mesh, where)
    if mesh.shard_size != 1:
        raise ValueError(
            f"{where}: the mesh must have shard=1 (every rank holds every "
            f"parameter), got {mesh}. Use funcshard.shard for a sharded mesh, or "
            f"Mesh(replicate={mesh.size})."
        )
    mp = _with_comm_dtype(mp, comm_dtype)
    bucket_plan = plan(
        model,
        policy=buckets(bucket_mb, first_bucket_mb),
        ignored=ignored,
        reduce_ignored=reduce_ignored,
    )
    return shard_as(where, model, bucket_plan, mesh, mp, False, False, seed, init)


def _with_comm_dtype(
    mp: MixedPrecision | None, comm_dtype: torch.dtype | None
) -> MixedPrecision | None:
    """`mp` with `comm_dtype` as its reduce dtype: the two name one setting."""
    if comm_dtype is None:
        return mp
    if mp is None:
        return MixedPrecision(reduce_dtype=comm_dtype)
    if not isinstance(mp, MixedPrecision):
        raise TypeError(f"funcshard.replicate: mp must be a MixedPrecision or None, got {mp!r}.")
    if mp.reduce_dtype is not None:
        raise ValueError(
            f"funcshard.replicate: comm_dtype={comm_dtype} and mp.reduce_dtype="
            f"{mp.reduce_dtype} both set the dtype gradients are all-reduced in. Give one: "
            f"mp=MixedPrecision(..., reduce_dtype=...) or comm_dtype=..."
        )
    return dataclasses.replace(mp, reduce_dtype=comm_dtype)
