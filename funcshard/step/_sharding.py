"""Sharding a model: `shard` slices a module's parameters into a ShardedState over a mesh,
after checking that every rank holds the same model, plan, seed and values.

The model is never written. See [Note: flat buffers] in funcshard/core/_layout.py for the layout
the state holds.
"""

from __future__ import annotations

import dataclasses
import numbers

import torch
from torch import Tensor, nn

from funcshard.comm import _collectives as collectives
from funcshard.comm import _process_groups as process_groups
from funcshard.comm._mesh import Mesh, check_mesh
from funcshard.core._layout import Layout, layout_of
from funcshard.core._module import check_module
from funcshard.core._plan import Plan
from funcshard.core._precision import MixedPrecision
from funcshard.core._state import ShardedState
from funcshard.core._tree import format_names
from funcshard.init._materialize import Init, check_init, local_slice, materialize
from funcshard.init._replay import check_deferred, is_deferred, materialize_deferred
from funcshard.step import _zero_start as zero_start


def shard(
    model: nn.Module,
    plan: Plan,
    mesh: Mesh,
    mp: MixedPrecision | None = None,
    reshard_after_forward: bool | int = True,
    offload: bool = False,
    seed: int | None = None,
    init: Init = None,
) -> ShardedState:
    """Shard `model`'s parameters over `mesh` as `plan` groups them; the model is not changed.

    A model on the meta device is initialized straight into local shards under `seed` (see
    [Note: initializing from the meta device]): by each module's `reset_parameters()`, or by
    `init(module)` for every module when given (a transformers model's
    `init=model._init_weights`), or by one call on the whole model with
    `init=fs.whole_model(fn, **kwargs)` (torchtitan's `fs.whole_model(model.init_weights)`;
    it holds the whole model once on each rank while it runs). `init="skip"` (or
    `fs.skip(fn)`) draws no random numbers: parameters and persistent buffers start at zero,
    for a state whose values a checkpoint load gives next (`funcshard.checkpoint.load(path,
    like=(state, opt_state))`, `funcshard.checkpoint.load_hf`), while non-persistent buffers,
    which no checkpoint holds, are computed by `reset_buffers()` or by `fn` (a transformers
    model: `init=fs.skip(model._init_weights)`). `seed` is 0 when not given.
    A model built under `fs.deferred_init()` is materialized by replaying its constructor
    instead, one tensor at a time, bitwise its CPU construction; `seed` and `init` do not
    apply to it.
    `reshard_after_forward` is True, False or an int k that divides the shard size.
    `offload=True` keeps shards (and so gradients and optimizer state) in CPU memory, pinned
    on a GPU mesh: each unit's shards are copied in ahead of use, and the optimizer steps on
    the CPU, as FSDP2's CPU offload does. On a CPU mesh that is where they are anyway.

    Communicates: one all-gather of a plan fingerprint over the mesh (every rank raises,
    naming the first differing parameter, if the ranks disagree), then a broadcast of each
    buffer from the mesh's first rank.
    """
    return shard_as(
        "funcshard.shard", model, plan, mesh, mp, reshard_after_forward, offload, seed, init
    )


def shard_as(
    where: str,
    model: nn.Module,
    plan: Plan,
    mesh: Mesh,
    mp: MixedPrecision | None,
    reshard_after_forward: bool | int,
    offload: bool,
    seed: int | None,
    init: Init,
) -> ShardedState:
    """`shard`, with errors that name `where`, the public call that asked for it (`shard`
    or `replicate`), so their advice fits the call the user made."""
    check_module(model, where)
    if not isinstance(plan, Plan):
        raise TypeError(
            f"{where}: plan must be a funcshard.Plan, got {_described(plan)}. The arguments are "
            f"shard(model, plan, mesh, ...): make the plan with funcshard.plan(model, "
            f"policy=...)."
        )
    check_mesh(mesh, where)
    deferred = is_deferred(model)
    if deferred:
        _check_no_seed_or_init(seed, init, where)
        check_deferred(model, where)
    seed = 0 if seed is None else seed
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise TypeError(
            f"{where}: seed must be an int, the same on every rank, got {_described(seed)}."
        )
    _check_reshard_after_forward(reshard_after_forward, mesh)
    init = check_init(init, where)
    if mp is not None and not isinstance(mp, MixedPrecision):
        raise TypeError(f"{where}: mp must be a MixedPrecision or None, got {mp!r}.")
    laid_out = layout_of(plan, mesh)  # (refuses an owned unit over its bound: no collective yet)
    _check_same_model_everywhere(model, plan, mesh, where, seed)
    layout = dataclasses.replace(
        laid_out,
        state_dict_keys=tuple(model.state_dict(keep_vars=True)),
        aliases=tuple(_aliases(model).items()),
    )
    params = dict(model.named_parameters())
    on_meta = any(p.is_meta for p in params.values()) or any(b.is_meta for b in model.buffers())
    if deferred:
        shards, replicated, buffers = materialize_deferred(
            model, layout, mesh.shard_rank, mesh.device, where
        )
    elif on_meta:
        shards, replicated, buffers = materialize(
            model, layout, mesh.shard_rank, seed, mesh.device, init, where
        )
    else:
        _check_same_values_everywhere(params, layout, mesh, where)
        where = torch.device("cpu") if offload else mesh.device  # offload: never whole on a GPU
        shards = [
            local_slice([params[f].to(where) for f in flat.fqns], flat, mesh.shard_rank)
            for flat in layout.flats
        ]
        replicated = {f: params[f].detach().to(mesh.device, copy=True) for f in layout.replicated}
        buffers = {n: b.detach().to(mesh.device, copy=True) for n, b in model.named_buffers()}
    buffers = {
        name: collectives.broadcast(b, mesh.group, src_rank=mesh.ranks[0])
        for name, b in buffers.items()
    }
    if offload:
        shards = [_to_host(s, pin=mesh.device.type == "cuda") for s in shards]
    state = ShardedState(
        shards=tuple(shards),
        replicated=replicated,
        buffers=buffers,
        layout=layout,
        mp=mp,
        reshard_after_forward=reshard_after_forward,
        offload=offload,
    )
    zero_start.started(state)  # see [Note: parameters stuck at zero]
    return state


def _check_no_seed_or_init(seed: int | None, init: Init, where: str) -> None:
    """A deferred model's values are its constructor's: refuse a seed or init for it."""
    given = [f"{n}={v!r:.40}" for n, v in (("seed", seed), ("init", init)) if v is not None]
    if given:
        raise ValueError(
            f"{where}: {', '.join(given)} does not apply to a model built under "
            f"fs.deferred_init(): its values are its constructor's, replayed from the random "
            f"state the block began with. Seed before the block (torch.manual_seed) and drop "
            f"{' and '.join(n.split('=')[0] + '=' for n in given)}."
        )


def _to_host(shard: Tensor, pin: bool) -> Tensor:
    """An offloaded shard: in CPU memory, pinned (`pin`) for a GPU to copy it in
    asynchronously (each all-gather copies it in on the all-gather stream)."""
    host = shard.detach().to("cpu")
    return host.pin_memory() if pin else host


def _aliases(model: nn.Module) -> dict[str, str]:
    """Second names of tied parameters -> their first FQN."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(p), name)
        if owner != name:
            aliases[name] = owner
    return aliases


def _check_reshard_after_forward(value: bool | int, mesh: Mesh) -> None:
    if isinstance(value, bool):
        return
    if not isinstance(value, int):
        raise TypeError(
            f"funcshard.shard: reshard_after_forward must be True, False or an int, "
            f"got {type(value).__name__}."
        )
    if value < 1 or mesh.shard_size % value:
        divisors = [k for k in range(1, mesh.shard_size + 1) if mesh.shard_size % k == 0]
        raise ValueError(
            f"funcshard.shard: reshard_after_forward={value} must divide the shard size "
            f"{mesh.shard_size}; choose one of {divisors}, or True/False."
        )


def _model_problems(model: nn.Module, plan: Plan) -> str:
    """What is wrong with this rank's model against the plan, or "" (checked before any
    collective, reported on every rank by `_check_same_model_everywhere`)."""
    params = dict(model.named_parameters())
    planned = set(plan.fqns) | set(plan.ignored)
    missing = [f for f in planned if f not in params]
    extra = [f for f in params if f not in planned]
    if missing or extra:
        return (
            f"the plan does not describe this model (plan has {format_names(missing)} that "
            f"the model lacks; the model has {format_names(extra)} that the plan lacks). "
            f"Plan the same model you shard: funcshard.plan(model, ...)."
        )
    for unit in plan.units:
        for fqn, shape, dtype in zip(unit.fqns, unit.shapes, unit.param_dtypes, strict=True):
            p = params[fqn]
            if tuple(p.shape) != shape or p.dtype != dtype:
                return (
                    f"{fqn!r} is {tuple(p.shape)} {p.dtype} in the model but {shape} {dtype} "
                    f"in the plan. Plan the model after changing it."
                )
    sharded = set(plan.fqns)  # ignored (replicated) parameters may be of any dtype
    not_float = [
        f
        for f, p in params.items()
        if f in sharded and not (p.is_floating_point() or p.is_complex())
    ]
    if not_float:
        return (
            f"parameters {format_names(not_float)} are not floating point "
            f"({params[not_float[0]].dtype}); only floating-point parameters can be sharded "
            f"and trained. Register them as buffers, or pass them in `ignored`."
        )
    return ""


def _check_same_model_everywhere(
    model: nn.Module, plan: Plan, mesh: Mesh, where: str, seed: int = 0
) -> None:
    """Raise on every rank if any rank's model, plan or seed differs (one small all-gather)."""
    problem = _model_problems(model, plan)
    fingerprint = int(plan.fingerprint()[:15], 16)
    local = [fingerprint, int(bool(problem)), int(seed) & _INT63]
    gathered = collectives.all_gather_ints(local, mesh.group)
    if all(row == [gathered[0][0], 0, gathered[0][2]] for row in gathered):
        return
    seeds = [row[2] for row in gathered]
    if not any(row[1] for row in gathered) and all(row[0] == gathered[0][0] for row in gathered):
        raise ValueError(
            f"{where}: seed must be the same on every rank (it initializes one model, the "
            f"same on any world size), got {_per_rank(seeds, mesh)}. Pass one seed everywhere; "
            f"for randomness of each rank's own (dropout, data order) use "
            f"funcshard.rank_seed(seed, mesh) or funcshard.manual_seed(seed, mesh, step)."
        )
    described = [
        (f, s, str(d))
        for u in plan.units
        for f, s, d in zip(u.fqns, u.shapes, u.param_dtypes, strict=True)
    ]
    reports = collectives.all_gather_object((problem, described), mesh.group)
    for rank, (text, _) in enumerate(reports):
        if text:
            raise ValueError(f"{where}: on rank {rank}: {text}")
    raise ValueError(f"{where}: ranks disagree on the model: {_first_difference(reports)}")


_INT63 = (1 << 63) - 1  # a seed as an int64 for the all-gather (torch takes seeds < 2**64)


def _per_rank(values: list[int], mesh: Mesh) -> str:
    ranks = process_groups.group_ranks(mesh.group)
    return ", ".join(f"{v} on rank {r}" for r, v in zip(ranks, values, strict=True))


def _described(value: object) -> str:
    if isinstance(value, type):
        return f"the class {value.__name__}"
    return f"{type(value).__name__} {value!r:.60}"


def _checksum(tensor: Tensor) -> tuple[int, int]:
    """An exact fingerprint of a tensor's bits: their sum and a position-weighted sum.

    Integer sums wrap around, so the result does not depend on summation order.
    """
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(ints).long()
    weights = torch.arange(bits.numel(), device=bits.device) % 65521 + 1
    return int(bits.sum()), int((bits * weights).sum())


def _check_same_values_everywhere(
    params: dict[str, Tensor], layout: Layout, mesh: Mesh, where: str
) -> None:
    """Raise on every rank, naming the first parameter whose values differ across ranks.

    Slicing models that hold different values would silently stitch a state from several
    models; DDP broadcasts rank 0's parameters for this reason. Checked with one all-gather
    of exact checksums.
    """
    fqns = [*layout.fqns, *layout.replicated]
    local = [x for f in fqns for x in _checksum(params[f])]
    gathered = collectives.all_gather_ints(local, mesh.group)
    for rank, row in enumerate(gathered[1:], start=1):
        if row != gathered[0]:
            first = next(i for i in range(len(row)) if row[i] != gathered[0][i]) // 2
            raise ValueError(
                f"{where}: {fqns[first]!r} holds different values on rank 0 and rank "
                f"{rank}. Seed every rank alike before building the model "
                f"(torch.manual_seed), or build it on the meta device and let "
                f"{where.removeprefix('funcshard.')} initialize it."
            )


def _first_difference(reports: list[tuple[str, list[tuple[str, tuple, str]]]]) -> str:
    """Name the first parameter whose shape or dtype differs from rank 0's, and the fix."""
    reference = reports[0][1]
    for rank, (_, described) in enumerate(reports[1:], start=1):
        for (fqn, shape, dtype), (other_fqn, other_shape, other_dtype) in zip(
            reference, described, strict=False
        ):
            if (fqn, shape, dtype) != (other_fqn, other_shape, other_dtype):
                return (
                    f"{fqn!r} is {shape} {dtype} on rank 0 but {other_fqn!r} is {other_shape} "
                    f"{other_dtype} on rank {rank}. Build the same model (config, dtypes, plan "
                    f"policy) on every rank."
                )
        if len(described) != len(reference):
            return (
                f"rank 0 plans {len(reference)} parameters but rank {rank} plans "
                f"{len(described)}. Build the same model on every rank."
            )
    return "the plans group the same parameters differently. Use the same policy on every rank."
