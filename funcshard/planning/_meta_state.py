"""The state and gradients the optimizer sees in a dry run: real records of meta shards.

[Note: the optimizer on a meta state]
The estimate's optimizer phase (`funcshard.planning._dryrun.optimizer_phase`) runs the
optimizer's own `init`, `update` and `apply_updates` on meta tensors and counts what they
allocate. It used to pass a dict of the flat shards, `{"0": shard, ...}`. An optimizer
that reads the parameters' names and shapes then did other work than it does on a state:
a `partition` labelled every 1-D shard as one group (its views' packing went uncounted:
a real step's peak was 10-20% above the estimate), a Muon group under `whole_params` got
AdamW's two moments instead of one momentum. So the dry run passes what a step passes: a
`ShardedState` and `ShardedGrads` of the same meta shards, on a layout whose mesh is made
of `MetaGroup`s (see [Note: collectives on a meta group] in funcshard/comm/_meta_groups.py):
the same sizes and this process as rank 0 of each axis, so a collective allocates its
result and sends nothing. Every optimizer, a user's own included, is counted by what it
does; nothing here knows one optimizer from another. The figure is rank 0's: owners of
`whole_params` differ by rank by at most a parameter's share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from funcshard.comm._mesh import Mesh, default_timeout
from funcshard.comm._meta_groups import MetaGroup
from funcshard.core._layout import Layout
from funcshard.core._precision import MixedPrecision
from funcshard.core._state import ShardedGrads, ShardedState


def meta_mesh(replicate: int, shard: int) -> Mesh:
    """A `Mesh` of `replicate` x `shard` ranks on the meta device, whose groups are
    MetaGroups and whose rank 0 this process is; built without torch.distributed."""
    mesh = object.__new__(Mesh)
    fields = {
        "replicate": replicate, "shard": shard, "device_type": "meta",
        "ranks": tuple(range(replicate * shard)), "timeout": default_timeout(),
        "check_collectives": False, "_device_mesh": None,
        # the values Mesh resolves when it is built (its cached properties)
        "shard_rank": 0, "replicate_rank": 0, "shard_group": MetaGroup(shard),
        "replicate_group": MetaGroup(replicate), "group": MetaGroup(replicate * shard),
    }  # fmt: skip
    for name, value in fields.items():
        object.__setattr__(mesh, name, value)
    return mesh


def meta_state(
    layout: Layout,
    sizes: tuple[int, int],
    shards: Sequence[Tensor],
    replicated: dict[str, Tensor],
    mp: MixedPrecision | None = None,
) -> ShardedState:
    """A ShardedState of these meta shards and replicated parameters on a meta mesh of
    `sizes` (replicate, shard)."""
    on_mesh = dataclasses.replace(layout, mesh=meta_mesh(*sizes))
    return ShardedState(tuple(shards), dict(replicated), {}, on_mesh, mp)


def plan_state(layout: Layout, sizes: tuple[int, int]) -> ShardedState:
    """A meta state for the estimate by arithmetic: the flat shards (the plan does not say
    the replicated parameters' shapes: they are left out, as before)."""
    without = dataclasses.replace(layout, replicated=(), replicated_frozen=())
    shards = [torch.empty(f.shard_numel, dtype=f.dtype, device="meta") for f in layout.flats]
    return meta_state(without, sizes, shards, {})


def trained(state: ShardedState) -> list[tuple[int, Tensor]]:
    """The leaves that get a gradient, with their index among `state.leaves()`."""
    layout = state.layout
    frozen = [f.frozen for f in layout.flats]
    frozen += [f in layout.replicated_frozen for f in layout.replicated]
    return [(i, t) for i, t in enumerate(state.leaves()) if not frozen[i]]


def grads_like(state: ShardedState, values: Sequence[Tensor | None] | None = None) -> ShardedGrads:
    """ShardedGrads for `state`: `values` lined up with `trained(state)` (default: new
    tensors like the leaves), None for frozen leaves."""
    leaves: list[Tensor | None] = [None] * len(state.leaves())
    chosen = trained(state)
    if values is None:
        values = [torch.empty_like(t) for _, t in chosen]
    for (i, _), v in zip(chosen, values, strict=True):
        leaves[i] = v
    n = len(state.shards)
    replicated = dict(zip(state.layout.replicated, leaves[n:], strict=True))
    return ShardedGrads(tuple(leaves[:n]), state.layout, replicated)
