"""`whole_params`: an optimizer written for one process's whole parameters, right on shards.

A transform written as for one process (`update({fqn: grad}, state, {fqn: param})` over
whole tensors: Muon's orthogonalization, LARS's trust ratio, Shampoo's preconditioners) is
wrong on flat shards, whose leaves mix parameters and split them across ranks. Wrapped in
`whole_params`, each trained parameter is made whole on one owner rank of the mesh,
the transform runs there, and the update goes back to the shards (see [Note: whole
parameters on their owners] in funcshard/optim/_owners.py); its state is `Owned`, held by the
owner only (see [Note: owned state] in funcshard/optim/_owned.py).

The transform is called once per parameter, with one-entry dicts: each parameter's state
is then its own, which is what lets a checkpoint hand it to another owner at another world
size, and what makes the transform's math the same on one rank and on many.

[Note: a dict's entries without a gradient]
On a ShardedState the trained parameters are known from the layout: `init` plans the
unfrozen ones, and an update's gradient leaves are None exactly for the frozen ones, so
both plan the same parameters and the owners (balanced over them) agree. A dict has no
layout: `init` plans every entry, and an update plans those with a gradient. An entry
with a None gradient (requires_grad=False: LoRA's frozen base; or unused this step) keeps
its state and does not move, as in every funcshard optimizer on a dict. One process
computes every entry, so no owner moves with it. Its state is carried over as it is; an
entry with a gradient and no state is still refused.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor

from funcshard.comm import _process_groups as process_groups
from funcshard.core._groups import GroupView, packed_numel
from funcshard.core._state import ShardedGrads, ShardedState
from funcshard.core._tree import format_names
from funcshard.optim import _owners as owners
from funcshard.optim._base import Optimizer
from funcshard.optim._leaves import leaves
from funcshard.optim._owned import Owned
from funcshard.optim._params import _like


def whole_params(transform: Optimizer, chunk_numel: int = 1 << 22) -> Optimizer:
    """An optimizer on any params (a ShardedState of FSDP, HSDP or DDP; a dict) from
    `transform`, an optimizer written for one process over `{fqn: whole tensor}` dicts.

    Each trained parameter is computed once in the whole mesh, on its owner rank, where the
    transform's state for it lives (`Owned`). The transform sees one parameter at a time:
    it must not reduce across parameters (a global norm, a clip by it); do that outside,
    e.g. `chain(clip_by_global_norm(1.0), whole_params(t))`. Inside `partition`, it sees
    its group's parameters only. Communicates per update: an uneven all-to-all of gradient
    and parameter pieces to the owners and one of the updates back to every replica, per
    dtype and chunk, over the mesh; `init` sends the parameters to their owners once.
    Called with `donate=True` (`opt.step`), it passes that on: the transform may overwrite
    the whole gradients it is given and its own state, as `muon` does its momentum.

    `chunk_numel`: the parameters are exchanged and computed in consecutive chunks of about
    this many elements (the whole group's; a larger parameter alone), so a rank holds one
    chunk's whole gradients, values and updates at a time: a lower memory peak for a few
    more collectives. The default, 4M elements, is 16 MiB of fp32 gradients per chunk.
    """
    if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1:
        raise ValueError(
            f"funcshard.optim.whole_params: chunk_numel must be an int >= 1, got "
            f"{chunk_numel!r}."
        )
    if not isinstance(transform, Optimizer):
        raise TypeError(
            f"funcshard.optim.whole_params: transform must be a funcshard.optim.Optimizer "
            f"(init, update) written for one process's {{fqn: tensor}} dicts, got "
            f"{type(transform).__name__}."
        )

    def init(params: Any) -> Owned:
        plan, group = _plan(params, None)
        (values,) = owners.to_owners(plan, [leaves(params)], group)
        return Owned({f: transform.init({f: values[f]}) for f in plan.owned_fqns})

    def update(grads: Any, state: Owned, params: Any, donate: bool = False) -> tuple[Any, Owned]:
        grad_leaves, param_leaves, like = _read(grads, params)
        plan, group = _plan(params, tuple(g is not None for g in grad_leaves), like is not None)
        idle = _idle(state, params, grads)
        _check_owned(state, plan, idle)
        like = grad_leaves if like is None else like
        new_states = dict(idle)
        back: list[Tensor | None] | None = None
        for chunk in owners.chunks(plan, chunk_numel):
            grads_of, values = owners.to_owners(chunk, [grad_leaves, param_leaves], group)
            updates = {}
            for fqn in chunk.owned_fqns:
                delta, new_states[fqn] = transform.update(
                    {fqn: grads_of[fqn]}, state.states[fqn], {fqn: values[fqn]}, donate=donate
                )
                updates[fqn] = _only(delta, fqn, grads_of[fqn])
            del grads_of, values  # before the updates' exchange: not held beside its buffers
            back = owners.from_owners(chunk, updates, like, group, back)
        assert back is not None  # chunks() cuts a plan into at least one
        # donated: the transform may have written into the gradients (see [Note: donation])
        ordered = {f: new_states[f] for f in state.states}  # as init made them
        return _like(grads, back, donate), Owned(ordered)

    return Optimizer(init, update)


def _read(grads: Any, params: Any) -> tuple[list, list, list | None]:
    """The gradient and parameter leaves `to_owners` reads, and what `from_owners` makes its
    leaves like when that is not the gradient leaves. A partition group's views (see
    funcshard/core/_groups.py) are read from their source leaves, unpacked: packing them would
    copy every piece once more before `to_owners` copies it into its send buffer."""
    views = isinstance(grads, GroupView) and isinstance(params, GroupView)
    if views and grads.source is not None and params.source is not None:
        parts = grads.parts
        return (
            [grads.source[p.source] for p in parts],
            [params.source[p.source] for p in parts],
            [_packed_like(grads, p) for p in parts],
        )
    return leaves(grads), leaves(params), None


def _packed_like(view: GroupView, part: Any) -> owners.Like | None:
    """The shape, dtype and device of a group view's leaf, without packing it."""
    assert view.source is not None
    leaf = view.source[part.source]
    if leaf is None or not part.packed:
        return leaf
    return owners.Like((packed_numel(view.layout, part),), leaf.dtype, leaf.device)


def _only(delta: Any, fqn: str, grad: Tensor) -> Tensor:
    """The one update a transform returned for `fqn` (None: no move)."""
    if not isinstance(delta, dict) or set(delta) != {fqn}:
        raise TypeError(
            f"funcshard.optim.whole_params: the transform's update must return a dict "
            f"{{fqn: update}} for the one parameter it was given ({fqn}), got "
            f"{type(delta).__name__}. Write it with funcshard.tree_map over the grads dict."
        )
    u = delta[fqn]
    return grad.new_zeros(grad.shape) if u is None else u


def _idle(state: Any, params: Any, grads: Any) -> dict[str, Any]:
    """A dict's entries with no gradient this step and their states, kept as they are (see
    [Note: a dict's entries without a gradient]); {} for any other params."""
    if not (isinstance(params, dict) and isinstance(grads, dict) and isinstance(state, Owned)):
        return {}
    return {f: s for f, s in state.states.items() if f in params and grads.get(f) is None}


def _check_owned(state: Any, plan: owners.Plan, idle: dict[str, Any]) -> None:
    if not isinstance(state, Owned):
        raise TypeError(
            f"funcshard.optim.whole_params: opt_state must be what its init returned (Owned), "
            f"got {type(state).__name__}."
        )
    expected = set(plan.owned_fqns)
    held = set(state.states) - set(idle)
    if held != expected:
        missing = sorted(expected - held)
        extra = sorted(held - expected)
        raise ValueError(
            f"funcshard.optim.whole_params: this rank's optimizer state holds other "
            f"parameters than it owns here (missing {format_names(missing) or 'none'}, not "
            f"owned here {format_names(extra) or 'none'}). Build the state with init on these "
            f"params and this mesh, or load a checkpoint into one "
            f"(funcshard.checkpoint.load(path, like=(state, opt.init(state))))."
        )


def _plan(
    params: Any, live: tuple[bool, ...] | None, unpacked: bool = False
) -> tuple[owners.Plan, Any]:
    """The owners of `params`' trained parameters (those whose gradient leaf is present,
    given `live`; else those not frozen) and the mesh group they are exchanged over.
    `unpacked`: a group view's leaves are read from its source (see `_read`)."""
    if isinstance(params, GroupView):
        group, rank = _mesh_group(params.layout.mesh)
        return _group_plan(params.layout, params.parts, rank, live, unpacked), group
    if isinstance(params, ShardedState | ShardedGrads):
        group, rank = _mesh_group(params.layout.mesh)
        return _sharded_plan(params.layout, rank, live), group
    if isinstance(params, dict):
        names = tuple(params)
        on = live if live is not None else (True,) * len(names)
        chosen = tuple(f for f, keep in zip(names, on, strict=True) if keep)
        at = {f: i for i, f in enumerate(names)}
        return owners.plan([], [(at[f], f) for f in chosen], 1, 0), None
    raise TypeError(
        f"funcshard.optim.whole_params: params must be a ShardedState or a dict of tensors, "
        f"got {type(params).__name__}."
    )


def _mesh_group(mesh: Any) -> tuple[Any, int]:
    """The mesh's group and this rank's index in it, `replica * shard + shard rank` (the
    numbering owners.Plan uses; a mesh's group is built replica-major)."""
    rank = mesh.replicate_rank * mesh.shard_size + mesh.shard_rank
    if mesh.size > 1 and process_groups.group_rank(mesh.group) != rank:
        raise RuntimeError(
            f"funcshard.optim.whole_params: rank {process_groups.global_rank()} is rank "
            f"{process_groups.group_rank(mesh.group)} of its mesh's group but replica "
            f"{mesh.replicate_rank}, shard {mesh.shard_rank} of the mesh; build the mesh with "
            f"funcshard.Mesh (replica-major ranks)."
        )
    return mesh.group, rank


@functools.lru_cache(maxsize=64)
def _sharded_plan(layout: Any, rank: int, live: tuple[bool, ...] | None) -> owners.Plan:
    n = len(layout.flats)
    flats = [
        (i, flat, tuple(f for f in flat.fqns if f not in flat.frozen_fqns), None)
        for i, flat in enumerate(layout.flats)
        if (not flat.frozen if live is None else live[i])
    ]
    wholes = [
        (n + j, f)
        for j, f in enumerate(layout.replicated)
        if (f not in layout.replicated_frozen if live is None else live[n + j])
    ]
    return owners.plan(flats, wholes, layout.mesh.size, rank, layout.mesh.shard_size)


@functools.lru_cache(maxsize=64)
def _group_plan(
    layout: Any, parts: tuple, rank: int, live: tuple[bool, ...] | None, unpacked: bool = False
) -> owners.Plan:
    """The owners of a `partition` group's parameters (see funcshard/core/_groups.py); its parts
    hold trained parameters only."""
    n = len(layout.flats)
    flats, wholes = [], []
    for j, part in enumerate(parts):
        if live is not None and not live[j]:
            continue
        if part.source >= n:
            wholes.append((j, part.fqns[0]))
        else:
            packed = part.fqns if part.packed else None
            flats.append((j, layout.flats[part.source], part.fqns, packed))
    return owners.plan(flats, wholes, layout.mesh.size, rank, layout.mesh.shard_size, unpacked)
