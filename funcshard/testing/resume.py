"""The checkpoint law of `fs.testing.check`: saved at one world size, loaded at another.

[Note: the checkpoint law, apart from parity]
The run at world size W saves a checkpoint before its last step, and hands the parent what
it saved (full parameters, buffers and optimizer moments, unsharded) with the loss the next
step must have on the micro-batches of W' ranks (a forward at W of each of them). On W'
ranks, `resume` then continues twice: from the checkpoint it loads, and from the saved
values handed over in memory (resharded for W'). The checkpoint law is exact: what was
loaded equals what was saved, bitwise, and the two continuations are bitwise the same (the
same numbers through the same W' program). Whether W' ranks compute what W ranks computed
(the first loss, and the parameters after continuing, against the uninterrupted run, within
1e-6) is then a question of parity, not of checkpoints, and the parent judges it as parity:
a forward that depends on the rank fails there, not here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from funcshard.comm import _collectives as collectives
from funcshard.core import _groups as groups
from funcshard.core._state import ShardedState
from funcshard.io import _checkpoint as checkpoint
from funcshard.optim._owned import Owned
from funcshard.optim._partition import PartitionState
from funcshard.step._metrics import pmean
from funcshard.step._unsharding import reshard, unshard
from funcshard.testing.harness import (
    Case,
    Config,
    Step,
    bitwise,
    build,
    call,
    global_batch,
    local_batch,
    make_step,
    mesh_of,
    optimizer,
    phase,
    split,
    user_setup,
)


def save(
    case: Case,
    config: Config,
    model: nn.Module,
    state: ShardedState,
    opt_state: Any,
    at: int,
    path: str,
    rank: int,
) -> dict[str, Any]:
    """Save before step `at`; return what was saved (unsharded: the parameters and optimizer
    moments on rank 0, every rank's buffers) and the loss step `at` must have on the
    micro-batches of `config.resume_world` ranks."""
    checkpoint.save(path, state, opt_state, step=at)
    inputs, targets = global_batch(case, config, at)
    parts = config.resume_world * config.micro_batches  # every micro-batch it will run
    with torch.no_grad():  # every rank runs every micro-batch: calls communicate
        losses = [
            case.loss_fn(call(model, state, split(inputs, i, parts)), split(targets, i, parts))
            for i in range(parts)
        ]
    params, moments = _clone(unshard(state)), unsharded_moments(state, opt_state)
    return {
        **({"params": params, "moments": moments} if rank == 0 else {}),
        "buffers": _clone(state.buffers),  # every rank's: they may differ (BatchNorm)
        "next_loss": sum(loss.double().item() for loss in losses) / parts,
    }


def resume(case: Case, config: Config, path: str, saved: dict[str, Any], rank: int) -> dict:
    """On `config.resume_world` ranks (DDP as DDP, the rest as FSDP): load the checkpoint,
    compare it with `saved` (rank 0's `save` result, with `buffers` a list of every rank's),
    continue from both and compare the continuations (see [Note: the checkpoint law, apart
    from parity]). Buffers such as BatchNorm's running statistics differ across ranks, and a
    checkpoint keeps one rank's: the loaded ones must be one rank's, bitwise."""
    with user_setup(case), phase("checkpoint"):
        world = config.resume_world
        axes = (world, 1) if config.ddp else (1, world)
        config = dataclasses.replace(
            config, replicate=axes[0], shard=axes[1], reshard_after_forward=True
        )
        model, state, _ = build(case, config, mesh_of(config))
        opt = optimizer(case, config)
        fresh = opt.init(state)
        loaded, loaded_opt, at, _ = checkpoint.load(path, like=(state, fresh))
        buffers = _one_of(saved["buffers"], loaded.buffers)
        saved = {**saved, "buffers": buffers}
        problems = _differences("loaded", _unsharded(loaded, loaded_opt), saved)
        direct = reshard(state, saved["params"]).replace(buffers=buffers)
        direct_opt = _with_moments(direct, fresh, saved["moments"])
        step = make_step(case, config, model, opt)  # one compiled step for both
        ours = _continue(case, config, step, loaded, loaded_opt, at)
        theirs = _continue(case, config, step, direct, direct_opt, at)
        problems += _differences("continued", ours, theirs)
        return {
            "problems": problems,
            "step": at,
            "losses": theirs["losses"],
            "final": theirs["params"] if rank == 0 else None,
        }


def _one_of(candidates: list[dict[str, Tensor]], buffers: dict[str, Tensor]) -> dict:
    """The first of `candidates` bitwise equal to `buffers`, else the first."""
    for candidate in candidates:
        if candidate.keys() == buffers.keys() and all(
            bitwise(v, buffers[k]) for k, v in candidate.items()
        ):
            return candidate
    return candidates[0]


def _continue(
    case: Case, config: Config, step: Step, state: ShardedState, opt_state: Any, at: int
) -> dict[str, Any]:
    """Train from step `at` to the end with `step`; the losses, and the state unsharded."""
    losses = []
    for s in range(at, case.steps):
        inputs, targets = local_batch(case, config, s, state.layout.mesh)
        loss, state, opt_state = step(state, opt_state, inputs, targets)
        losses.append(pmean(loss, state.layout.mesh))
    return {"losses": [loss.item() for loss in losses], **_unsharded(state, opt_state)}


def _unsharded(state: ShardedState, opt_state: Any) -> dict[str, Any]:
    """Parameters, buffers and optimizer moments, unsharded (communicates)."""
    return {
        "params": _clone(unshard(state)),
        "buffers": _clone(state.buffers),
        "moments": unsharded_moments(state, opt_state),
    }


def _clone(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


class PerFlat(NamedTuple):
    """An optimizer field with one moment per flat buffer, unsharded: which buffers had one
    and the values by FQN (a named type: a field that is itself a tuple, such as an empty
    state's `()`, is compared as it is)."""

    present: tuple[bool, ...]
    values: dict[str, Tensor]


def unsharded_moments(state: ShardedState, opt_state: Any) -> dict[str, Any]:
    """The optimizer state's fields by dotted path (into nested states: a chain's, a
    partition's): those laid out like the shards (one per flat buffer: momentum, Adam's
    moments) unsharded by FQN with which buffers had one; the others (the step count) as they
    are; a `whole_params` state (Owned, each key on its owner) merged from every rank.
    Communicates: as `fs.unshard` does, per such field, and one object all-gather per Owned."""
    out: dict[str, Any] = {}
    _unshard_fields(state, _named(opt_state, state), "", out)
    return out


def _fields(record: Any) -> list[tuple[str, Any]]:
    """A state record's parts by name: a dataclass's fields, a dict's items, a tuple's
    entries (for a tuple or list not laid out like the shards); [] for a leaf."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return [(f.name, getattr(record, f.name)) for f in dataclasses.fields(record)]
    if isinstance(record, dict):
        return list(record.items())
    if isinstance(record, tuple | list):
        return [(str(i), v) for i, v in enumerate(record)]
    return []


def _like_shards(value: Any, state: ShardedState, parts: tuple | None = None) -> bool:
    """Whether `value` is one moment per leaf: per flat shard, or inside a partition group
    of sharded params per leaf of the group's view (`parts`)."""
    return (
        isinstance(value, tuple | list)
        and len(value) == (len(state.shards) if parts is None else len(parts))
        and all(v is None or isinstance(v, Tensor) for v in value)
        and any(isinstance(v, Tensor) for v in value)
    )


def _groups(value: Any) -> tuple | None:
    """A partition's groups over sharded params ((name, parts) pairs), else None."""
    if isinstance(value, PartitionState) and value.groups:
        return value.groups
    return None


def _as_shards(state: ShardedState, value: Any, parts: tuple | None) -> tuple:
    """Moments per flat shard (None where absent): a group's packed leaves spread back over
    their flat shards with zeros elsewhere, as `partition` spreads a group's updates;
    replicated parameters' moments left out."""
    if parts is None:
        return tuple(value)
    spread: list[Tensor | None] = [None] * len(state.leaves())
    view = groups.GroupView(tuple(value), state.layout, parts)
    groups.scatter(view, view, spread, None)
    return tuple(spread[: len(state.shards)])


def _unshard_fields(
    state: ShardedState,
    record: Any,
    prefix: str,
    out: dict,
    sharded: bool = True,
    parts: tuple | None = None,
) -> None:
    """Fill `out` with `record`'s fields by path (`sharded=False` inside an Owned, whose
    tensors are whole parameters' and must not be taken for shards; `parts` inside a
    partition group, whose per-leaf moments line up with the group's view)."""
    for name, value in _fields(record):
        path = f"{prefix}{name}"
        if isinstance(value, Owned):
            _unshard_fields(state, _every_key(state, value), f"{path}.", out, sharded=False)
        elif (value_groups := _groups(value)) is not None:
            for group, group_parts in value_groups:
                inner = {group: value.states[group]}
                _unshard_fields(state, inner, f"{path}.states.", out, sharded, group_parts)
        elif sharded and _like_shards(value, state, parts):
            _replicated_moments(state, value, parts, path, out)
            shards = _as_shards(state, value, parts)
            present = tuple(v is not None for v in shards)
            filled = tuple(
                v if v is not None else torch.zeros_like(s)
                for v, s in zip(shards, state.shards, strict=True)
            )
            out[path] = PerFlat(present, _clone(unshard(state.replace(shards=filled))))
        elif _fields(value):
            _unshard_fields(state, value, f"{path}.", out, sharded, parts)
        else:
            out[path] = value.detach().clone() if isinstance(value, Tensor) else value


def _replicated_moments(state, value, parts, path: str, out: dict) -> None:
    """A group's moments of replicated parameters, whole, by FQN."""
    n = len(state.shards)
    for part, v in zip(parts or (), value, strict=False):
        if part.source >= n and v is not None:
            out[f"{path}/{part.fqns[0]}"] = v.detach().clone()


def _every_key(state: ShardedState, owned: Owned) -> dict[str, Any]:
    """Every rank's keys of an Owned state in one dict (replicas hold the same values)."""
    merged: dict[str, Any] = {}
    for states in collectives.all_gather_object(owned.states, state.layout.mesh.group):
        merged.update(states)
    return dict(sorted(merged.items()))


def _with_moments(state: ShardedState, opt_state: Any, moments: dict[str, Any]) -> Any:
    """`opt_state` with the fields of `unsharded_moments` resharded into `state`'s layout
    (an Owned's keys: this rank's in `opt_state`, from the saved values)."""
    named = _named(opt_state, state)
    rebuilt = _rebuilt(state, named, moments, "")
    return rebuilt["state"] if named is not opt_state else rebuilt


def _named(opt_state: Any, state: ShardedState) -> Any:
    """A state that is itself an Owned, a partition's of sharded params or one moment per
    shard, as a record with one field, `state`; any other as it is."""
    bare = (
        isinstance(opt_state, Owned)
        or _groups(opt_state) is not None
        or _like_shards(opt_state, state)
    )
    return {"state": opt_state} if bare else opt_state


def _rebuilt(
    state: ShardedState,
    record: Any,
    moments: dict[str, Any],
    prefix: str,
    sharded: bool = True,
    parts: tuple | None = None,
) -> Any:
    changes: dict[str, Any] = {}
    for name, value in _fields(record):
        path = f"{prefix}{name}"
        if isinstance(value, Owned):
            changes[name] = Owned(_rebuilt(state, value.states, moments, f"{path}.", False))
        elif (value_groups := _groups(value)) is not None:
            states = {
                group: _rebuilt(
                    state,
                    {group: value.states[group]},
                    moments,
                    f"{path}.states.",
                    sharded,
                    group_parts,
                )[group]
                for group, group_parts in value_groups
            }
            changes[name] = dataclasses.replace(value, states=states)
        elif sharded and _like_shards(value, state, parts):
            present, full = moments[path]
            shards = reshard(state, full).shards
            moments_again = [s if p else None for s, p in zip(shards, present, strict=True)]
            changes[name] = type(value)(_as_group(state, moments_again, parts, moments, path))
        elif _fields(value):
            changes[name] = _rebuilt(state, value, moments, f"{path}.", sharded, parts)
        else:
            changes[name] = moments[path]
    if isinstance(record, dict):
        return {**record, **changes}
    if isinstance(record, tuple | list):
        values = [changes[str(i)] for i in range(len(record))]
        return type(record)(*values) if hasattr(record, "_fields") else type(record)(values)
    return dataclasses.replace(record, **changes)


def _as_group(state, shards: list, parts: tuple | None, moments: dict, path: str) -> list:
    """Moments per flat shard as a group's per-leaf moments (packed where the group's leaf
    is), its replicated parameters' from `moments` by FQN; as they are outside a group."""
    if parts is None:
        return shards
    n, rank = len(state.shards), state.layout.mesh.shard_rank
    out = []
    for part in parts:
        if part.source >= n:
            out.append(moments[f"{path}/{part.fqns[0]}"])
        elif part.packed:
            out.append(groups._packed(shards[part.source], state.layout, rank, part))
        else:
            out.append(shards[part.source])
    return out


def _differences(what: str, ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Where two unsharded snapshots differ bitwise, in words."""
    problems = [
        f"{what} step {i} loss {a!r}, from memory {b!r}"
        for i, (a, b) in enumerate(
            zip(ours.get("losses", ()), theirs.get("losses", ()), strict=True)
        )
        if a != b
    ]
    for kind in ("params", "buffers"):
        problems += [
            f"{what} {kind[:-1]} {k} differs"
            for k, v in theirs[kind].items()
            if k not in ours[kind] or not bitwise(ours[kind][k], v)
        ]
    for name, value in theirs["moments"].items():
        mine = ours["moments"].get(name)
        if isinstance(value, PerFlat):
            if not isinstance(mine, PerFlat) or mine.present != value.present:
                problems.append(f"{what} optimizer {name}: other buffers hold one")
                continue
            problems += [
                f"{what} optimizer {name} of {k} differs"
                for k, v in value.values.items()
                if not bitwise(mine.values[k], v)
            ]
        elif isinstance(value, Tensor) and not bitwise(mine, value):
            problems.append(f"{what} optimizer {name} {mine!r}, saved {value!r}")
    return problems
