"""`from_state_dict(..., from_rank=r)`: shard a full state dict that one rank alone holds,
as FSDP2's `set_model_state_dict(..., broadcast_from_rank0=True)` loads one.

[Note: a state dict broadcast unit by unit]
Loading a checkpoint on every rank multiplies host memory by the ranks of a node, so FSDP2
lets one rank read it and broadcast it. Here the holding rank first checks the dict against
its model and broadcasts its verdict (a message, or nothing), so a wrong dict raises the same
ValueError on every rank before any weight moves. Every rank then builds the state's
structure with zeros: a meta-built model through `shard(..., init="skip")`, which makes one
unit at a time and draws no random numbers; a model that already holds real values (and so
is whole on that rank anyway) with zeros in its place. Then each flat buffer travels as one
broadcast, in plan order, and each rank copies its slice into its zero shard and drops the
rest: beyond its shards a receiving rank holds one flat buffer at a time, never the model.
Replicated parameters and buffers follow, one broadcast each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from funcshard.comm import _collectives as collectives
from funcshard.comm import _process_groups as process_groups
from funcshard.comm._mesh import Mesh
from funcshard.core._module import feed_tied, reparametrized
from funcshard.core._plan import Plan
from funcshard.core._state import ShardedState
from funcshard.init._materialize import local_slice
from funcshard.step._sharding import shard


def from_rank(
    model: nn.Module,
    state_dict: Mapping[str, Tensor] | None,
    plan: Plan,
    mesh: Mesh,
    source: int,
    mismatch: Callable[[nn.Module, Mapping[str, Tensor]], str | None],
    **options: Any,
) -> ShardedState:
    """The state `shard` would make of `model` holding global rank `source`'s `state_dict`
    (the other ranks' is not read). `mismatch` says what is wrong with a dict, if anything.

    Communicates: an all-gather of the holder's verdict, what `shard` does, one broadcast
    per flat buffer, and one per replicated parameter and buffer."""
    if source not in mesh.ranks:
        raise ValueError(
            f"funcshard.from_state_dict: from_rank={source} is not a rank of this mesh (ranks "
            f"{list(mesh.ranks)}); pass the global rank that holds the state dict."
        )
    holder = process_groups.global_rank() == source
    problem = mismatch(model, state_dict or {}) if holder else None
    if holder and state_dict is None:
        problem = f"funcshard.from_state_dict: rank {source} (from_rank) passed no state dict."
    problem = _agreed(problem, mesh, source)
    if problem:
        raise ValueError(problem)
    state = _zeros_like_shards(model, plan, mesh, **options)
    layout = state.layout
    values = dict(state_dict or {})
    for i, flat in enumerate(layout.flats):
        if holder:
            full = torch.cat([values[f].detach().reshape(-1).to(flat.dtype) for f in flat.fqns])
        else:
            full = torch.empty(flat.numel, dtype=flat.dtype)
        full = collectives.broadcast(full.to(mesh.device), mesh.group, source)
        pieces = list(full.split(list(flat.numels)))
        state.shards[i].copy_(local_slice(pieces, flat, mesh.shard_rank))
    for fqn, tensor in (*state.replicated.items(), *state.buffers.items()):
        sent = values[fqn].detach().to(tensor) if holder else torch.empty_like(tensor)
        tensor.copy_(collectives.broadcast(sent, mesh.group, source))
    return state


def _zeros_like_shards(model: nn.Module, plan: Plan, mesh: Mesh, **options: Any) -> ShardedState:
    """A state of `model` whose every value is zero (see the Note)."""
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return shard(model, plan, mesh, **{**options, "init": "skip"})
    zeros = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    zeros.update({n: torch.zeros_like(b) for n, b in model.named_buffers()})
    with reparametrized(model, feed_tied(model, zeros)):
        return shard(model, plan, mesh, **options)


def _agreed(problem: str | None, mesh: Mesh, source: int) -> str:
    """`source`'s `problem` (or ""), on every rank of the mesh."""
    reports = collectives.all_gather_object(problem, mesh.group)
    return reports[process_groups.group_ranks(mesh.group).index(source)] or ""
