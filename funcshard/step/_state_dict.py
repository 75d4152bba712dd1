"""Plain `model.state_dict()`s in and out of a sharded state: `full_state_dict` gathers
one on the mesh's first rank, `from_state_dict` shards one, to trade weights with PyTorch,
DDP and FSDP2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from funcshard.comm import _failures as failures
from funcshard.comm import _process_groups as process_groups
from funcshard.comm._mesh import Mesh
from funcshard.core._module import feed_tied, reparametrized
from funcshard.core._plan import Plan
from funcshard.core._state import ShardedState
from funcshard.core._tree import format_names
from funcshard.step import _broadcast_load as broadcast_load
from funcshard.step._sharding import shard
from funcshard.step._unsharding import unshard


def full_state_dict(state: ShardedState) -> dict[str, Tensor] | None:
    """A `model.state_dict()`-compatible dict of CPU tensors on the mesh's first rank (None
    elsewhere): tied weights under every name, persistent buffers only.

    Communicates: one all-gather per flat buffer, one unit at a time, so no rank holds more
    than one unit beyond its shards while gathering. So every rank of the mesh calls it, at
    the same point of the program (not under `if rank == 0:`): a rank that calls it alone
    raises a CollectiveError naming this call within the mesh's timeout, as do the ranks it
    left waiting.
    """
    with failures.every_rank_calls("funcshard.full_state_dict", list(state.layout.mesh.ranks)):
        return _full_state_dict(state)


def _full_state_dict(state: ShardedState) -> dict[str, Tensor] | None:
    layout = state.layout
    first = process_groups.group_rank(layout.mesh.group) == 0
    params: dict[str, Tensor] = {}
    for unit in layout.units:
        gathered = unshard(state, units=[unit])
        if first:
            params.update({k: v.detach().to("cpu", copy=True) for k, v in gathered.items()})
    if not first:
        return None
    params.update({k: v.detach().to("cpu", copy=True) for k, v in state.replicated.items()})
    params.update({alias: params[owner] for alias, owner in layout.aliases})
    buffers = {k: v.detach().to("cpu", copy=True) for k, v in state.buffers.items()}
    everything = {**params, **buffers}
    keys = layout.state_dict_keys or tuple(everything)
    return {k: everything[k] for k in keys}


def from_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Tensor] | None,
    plan: Plan,
    mesh: Mesh,
    from_rank: int | None = None,
    **options: Any,
) -> ShardedState:
    """Shard a plain `model.state_dict()` (from PyTorch, DDP, FSDP2's full state dict, or
    `full_state_dict`) as `shard` would shard a model holding those values.

    With `from_rank=r`, only global rank r holds the dict (the others pass None): it is
    checked there, a mismatch raises on every rank, and it is broadcast one flat buffer at a
    time, so no other rank ever holds more than one unit of it beyond its shards (FSDP2's
    `broadcast_from_rank0`; see [Note: a state dict broadcast unit by unit]). Every rank of
    the mesh calls it.

    Communicates: what `shard` does; with `from_rank`, also one broadcast per flat buffer,
    replicated parameter and buffer, and one all-gather of the check's verdict.
    """
    if from_rank is not None:
        return broadcast_load.from_rank(
            model, state_dict, plan, mesh, from_rank, _mismatch, **options
        )
    if state_dict is None:
        raise ValueError(
            "funcshard.from_state_dict: state_dict is None; pass the dict on every rank, or "
            "from_rank=r with the dict on rank r alone."
        )
    problem = _mismatch(model, state_dict)
    if problem:
        raise ValueError(problem)
    firsts = {name for name, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    fed = feed_tied(model, {k: v for k, v in state_dict.items() if k in firsts})
    with reparametrized(model, fed):
        return shard(model, plan, mesh, **options)


def _mismatch(model: nn.Module, state_dict: Mapping[str, Tensor]) -> str | None:
    """What keeps `state_dict` from loading into `model` (missing, unexpected or differing
    keys), or None."""
    expected = model.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    wrong = [
        f"{k} {tuple(state_dict[k].shape)} {state_dict[k].dtype} (model: "
        f"{tuple(v.shape)} {v.dtype})"
        for k, v in expected.items()
        if k in state_dict and (state_dict[k].shape != v.shape or state_dict[k].dtype != v.dtype)
    ]
    if not (missing or unexpected or wrong):
        return None
    return (
        f"funcshard.from_state_dict: the state dict does not match "
        f"{type(model).__name__}: missing {format_names(missing) or 'none'}; unexpected "
        f"{format_names(unexpected) or 'none'}; differing {format_names(wrong) or 'none'}."
    )
