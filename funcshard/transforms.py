"""The pure transforms between a model, its full parameters and its sharded state.

`shard` builds a ShardedState from a module, `unshard` gathers full parameters, `reshard`
goes back, and `reduce` turns every rank's full gradients into sharded mean gradients. None
of them writes its inputs. See [Note: flat buffers] for the layout they share.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from funcshard import collectives, gather
from funcshard.comm import Comm, check_carry
from funcshard.layout import FlatLayout, Layout, layout_of, param_views
from funcshard.materialize import Init, check_init, local_slice, materialize
from funcshard.mesh import Mesh, check_mesh
from funcshard.module import check_module, feed_tied, reparametrized
from funcshard.plan import Plan
from funcshard.precision import MixedPrecision, reduce_dtype
from funcshard.state import LocalGrads, ShardedGrads, ShardedState, ensure_live
from funcshard.tree import format_names


def shard(
    model: nn.Module,
    plan: Plan,
    mesh: Mesh,
    mp: MixedPrecision | None = None,
    reshard_after_forward: bool | int = True,
    offload: bool = False,
    seed: int = 0,
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
    model: `init=fs.skip(model._init_weights)`).
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
    seed: int,
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
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise TypeError(
            f"{where}: seed must be an int, the same on every rank, got {_described(seed)}."
        )
    _check_reshard_after_forward(reshard_after_forward, mesh)
    init = check_init(init, where)
    if mp is not None and not isinstance(mp, MixedPrecision):
        raise TypeError(f"{where}: mp must be a MixedPrecision or None, got {mp!r}.")
    _check_same_model_everywhere(model, plan, mesh, where, seed)
    layout = dataclasses.replace(
        layout_of(plan, mesh),
        state_dict_keys=tuple(model.state_dict(keep_vars=True)),
        aliases=tuple(_aliases(model).items()),
    )
    params = dict(model.named_parameters())
    on_meta = any(p.is_meta for p in params.values()) or any(b.is_meta for b in model.buffers())
    if on_meta:
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
    return ShardedState(
        shards=tuple(shards),
        replicated=replicated,
        buffers=buffers,
        layout=layout,
        mp=mp,
        reshard_after_forward=reshard_after_forward,
        offload=offload,
    )


def _to_host(shard: Tensor, pin: bool) -> Tensor:
    """An offloaded shard: in CPU memory, pinned (`pin`) for a GPU to copy it in
    asynchronously (each all-gather copies it in on the all-gather stream)."""
    host = shard.detach().to("cpu")
    return host.pin_memory() if pin else host


def unshard(
    state: ShardedState, units: Sequence[str] | None = None, comm: Comm | None = None
) -> dict[str, Tensor]:
    """Gather full parameters (all of them, or those of `units`) in their original dtypes;
    with `comm`, through its gather: the parameters a call with that comm computes with.

    The dict lists them in the model's `named_parameters()` order, replicated ones included,
    as `extract(model)` does, so the two compare as pytrees without reordering.

    Communicates: one all-gather over the shard axis per flat buffer (none when the shard axis
    has size 1, where the result shares memory with the state). Law: inverts `shard`.
    """
    return unshard_async(state, units, comm).wait()


@dataclass(frozen=True)
class UnshardHandle:
    """All-gathers in flight; `wait()` returns the full parameters by FQN, in `fqns` order."""

    pending: tuple[tuple[FlatLayout, collectives.Pending], ...]
    replicated: dict[str, Tensor]
    fqns: tuple[str, ...]  # the model's `named_parameters()` order (see `_model_order`)

    def wait(self) -> dict[str, Tensor]:
        full = {}
        for flat, pending in self.pending:
            full.update(zip(flat.fqns, param_views(pending.wait(), flat), strict=True))
        full.update(self.replicated)
        return {f: full[f] for f in self.fqns}


def unshard_async(
    state: ShardedState, units: Sequence[str] | None = None, comm: Comm | None = None
) -> UnshardHandle:
    """Start `unshard`: issue every all-gather now and return a handle to wait on (a
    `comm`'s gather runs now, to its end)."""
    ensure_live(state, "unshard")
    layout = state.layout
    if isinstance(units, str):
        units = (units,)
    indices = layout.flats_of(None if units is None else tuple(units))
    group = layout.mesh.shard_group
    device = layout.mesh.device
    pending = tuple(
        (
            layout.flats[i],
            collectives.all_gather(state.shards[i].to(device), group, what=layout.flats[i].unit)
            if comm is None
            else gather.issue_gather(
                state.shards[i], gather.GatherSpec(layout.flats[i], layout.mesh, None, comm=comm)
            ),
        )
        for i in indices
    )
    replicated = {f: t.clone() for f, t in state.replicated.items()} if units is None else {}
    gathered = [f for i in indices for f in layout.flats[i].fqns]
    return UnshardHandle(pending, replicated, _model_order(layout, [*gathered, *replicated]))


def _model_order(layout: Layout, fqns: Sequence[str]) -> tuple[str, ...]:
    """`fqns` in the model's `named_parameters()` order, which `extract` and a plain model use.

    Units are laid out in plan (post-)order, so the flat buffers alone would list a child's
    parameters before its parent's, and torch's pytrees tell dicts apart by key order.
    `state_dict()` visits modules and parameters in the order `named_parameters()` does; names
    it does not list (a module with state_dict hooks of its own) follow in the order given.
    """
    wanted = set(fqns)
    ordered = [k for k in layout.state_dict_keys if k in wanted]
    listed = set(ordered)
    return (*ordered, *(f for f in fqns if f not in listed))


def reshard(state: ShardedState, full: Mapping[str, Tensor]) -> ShardedState:
    """A new state holding `full` (FQN -> full tensor, as `unshard` returns) in `state`'s layout.

    Communicates: nothing (each rank slices its own part). Law: `reshard(s, unshard(s))`
    equals `s`.
    """
    layout = state.layout
    _check_full(full, layout, state)
    shards = tuple(
        local_slice([full[f] for f in flat.fqns], flat, layout.mesh.shard_rank).to(s.device)
        for flat, s in zip(layout.flats, state.shards, strict=True)
    )
    replicated = {f: full[f].detach().clone() for f in layout.replicated}
    return state.replace(shards=shards, replicated=replicated)


def reduce(
    state: ShardedState,
    full_grads: Mapping[str, Tensor | None] | LocalGrads,
    divide_factor: float | None = None,
    all_reduce: bool = True,
    comm: Comm | None = None,
    carry: object = None,
) -> ShardedGrads | tuple[ShardedGrads, tuple]:
    """Reduce every rank's full gradients into this rank's shard of their mean.

    Gradients are reduced in the mixed-precision reduce dtype and returned in each parameter's
    dtype. A missing or None gradient counts as zero; frozen units are not reduced.
    Replicated (ignored) parameters come back whole, all-reduced over every rank (or this
    rank's own, with `plan(..., reduce_ignored=False)`). `divide_factor` replaces the mean's
    divisor (sum, then divide). On an HSDP mesh `all_reduce=False` skips the all-reduce
    across replicas, for accumulating first. `comm`'s reduce, if any, replaces the
    reduce-scatter over the shard axis; `carry` is its state, and then the result is
    `(grads, new_carry)` (see [Note: communication as user functions]).

    Communicates: one reduce-scatter over the shard axis per trainable flat buffer, then one
    all-reduce over the replicate axis; one all-reduce per dtype of the replicated
    parameters. Law: equals the ranks' mean full gradient, sliced.
    """
    layout = state.layout
    if isinstance(full_grads, LocalGrads):
        full_grads = full_grads.grads
    _check_grads(full_grads, layout)
    mesh = layout.mesh
    op = "avg" if divide_factor is None else "sum"
    if comm is not None and not isinstance(comm, Comm):
        raise TypeError(f"funcshard.reduce: comm must be a funcshard.Comm, got {comm!r}.")
    if carry is not None or (comm is not None and comm.reduce is not None):
        return _reduce_with(state, full_grads, divide_factor, all_reduce, comm, carry)
    scattered: list[collectives.Pending | None] = []
    for flat in layout.flats:
        if flat.frozen:
            scattered.append(None)
            continue
        dtype = reduce_dtype(state.mp, flat)
        grads = [None if f in flat.frozen_fqns else full_grads.get(f) for f in flat.fqns]
        padded = _padded_flat(grads, flat, dtype, mesh.device)
        scattered.append(collectives.reduce_scatter(padded, mesh.shard_group, op, what=flat.unit))
    replicated_reduce = [
        None
        if p is None or not all_reduce
        else collectives.all_reduce(p.wait(), mesh.replicate_group, op, what=flat.unit)
        for flat, p in zip(layout.flats, scattered, strict=True)
    ]
    shards = []
    for flat, p, r in zip(layout.flats, scattered, replicated_reduce, strict=True):
        if p is None:
            shards.append(None)
            continue
        grad = (r or p).wait()
        if divide_factor is not None:
            grad = grad / divide_factor
        shards.append(grad.to(flat.dtype))
    replicated = reduce_replicated(state, full_grads, op, all_reduce, divide_factor)
    return ShardedGrads(shards=tuple(shards), layout=layout, replicated=replicated)


def _reduce_with(
    state: ShardedState,
    full_grads: Mapping[str, Tensor | None],
    divide_factor: float | None,
    all_reduce: bool,
    comm: Comm | None,
    carry: object,
) -> ShardedGrads | tuple[ShardedGrads, tuple]:
    """`reduce` through a user's reduce, one buffer after the other (it runs synchronously)."""
    if not isinstance(comm, Comm) or (carry is not None and comm.reduce is None):
        raise ValueError(
            f"funcshard.reduce: carry is the state of a Comm's reduce; pass "
            f"comm=funcshard.Comm(reduce=...) with it, got comm={comm!r}."
        )
    layout, mesh = state.layout, state.layout.mesh
    carries = check_carry(carry, state, "reduce") if carry is not None else None
    op = "avg" if divide_factor is None else "sum"
    shards, new_carry = [], []
    for i, flat in enumerate(layout.flats):
        c = carries[i] if carries is not None else None
        if flat.frozen:
            shards.append(None)
            new_carry.append(c)
            continue
        dtype = reduce_dtype(state.mp, flat)
        grads = [None if f in flat.frozen_fqns else full_grads.get(f) for f in flat.fqns]
        padded = _padded_flat(grads, flat, dtype, mesh.device)
        spec = gather.GatherSpec(flat, mesh, state.mp, comm=comm)
        grad, c = gather.reduce_whole(padded, spec, c, all_reduce, op)
        if divide_factor is not None:
            grad = grad / divide_factor
        shards.append(grad.to(flat.dtype))
        new_carry.append(c)
    replicated = reduce_replicated(state, full_grads, op, all_reduce, divide_factor)
    grads = ShardedGrads(shards=tuple(shards), layout=layout, replicated=replicated)
    return grads if carries is None else (grads, tuple(new_carry))


def reduce_replicated(
    state: ShardedState,
    grads: Mapping[str, Tensor | None],
    op: str = "avg",
    all_reduce: bool = True,
    divide_factor: float | None = None,
) -> dict[str, Tensor | None]:
    """The replicated parameters' gradients, reduced as DDP does: by `op` over every rank of
    the mesh (over the shard axis only without `all_reduce`), one all-reduce per dtype, or
    left as this rank's own when the plan said `reduce_ignored=False`. A missing gradient of
    a trainable one is zero; frozen ones get None."""
    layout = state.layout
    out: dict[str, Tensor | None] = dict.fromkeys(layout.replicated)
    local = {f: grads.get(f) for f in layout.replicated_trainable}
    local = {f: torch.zeros_like(state.replicated[f]) if g is None else g for f, g in local.items()}
    if not local or not layout.reduce_replicated:
        return {**out, **local}
    mesh = layout.mesh
    group = mesh.group if all_reduce else mesh.shard_group
    by_dtype: dict[torch.dtype, list[str]] = {}
    for f, g in local.items():
        by_dtype.setdefault(g.dtype, []).append(f)
    for fqns in by_dtype.values():
        packed = torch.cat([local[f].detach().reshape(-1).to(mesh.device) for f in fqns])
        total = collectives.all_reduce(packed, group, op, what="<replicated parameters>").wait()
        if divide_factor is not None:
            total = total / divide_factor
        pieces = total.split([local[f].numel() for f in fqns])
        out.update({f: p.view_as(local[f]) for f, p in zip(fqns, pieces, strict=True)})
    return out


def full_state_dict(state: ShardedState) -> dict[str, Tensor] | None:
    """A `model.state_dict()`-compatible dict of CPU tensors on the mesh's first rank (None
    elsewhere): tied weights under every name, persistent buffers only.

    Communicates: one all-gather per flat buffer, one unit at a time, so no rank holds more
    than one unit beyond its shards while gathering.
    """
    layout = state.layout
    first = collectives.group_rank(layout.mesh.group) == 0
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
    model: nn.Module, state_dict: Mapping[str, Tensor], plan: Plan, mesh: Mesh, **options: object
) -> ShardedState:
    """Shard a plain `model.state_dict()` (from PyTorch, DDP, FSDP2's full state dict, or
    `full_state_dict`) as `shard` would shard a model holding those values.

    Communicates: what `shard` does.
    """
    expected = model.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    wrong = [
        f"{k} {tuple(state_dict[k].shape)} {state_dict[k].dtype} (model: "
        f"{tuple(v.shape)} {v.dtype})"
        for k, v in expected.items()
        if k in state_dict and (state_dict[k].shape != v.shape or state_dict[k].dtype != v.dtype)
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"funcshard.from_state_dict: the state dict does not match "
            f"{type(model).__name__}: missing {format_names(missing) or 'none'}; unexpected "
            f"{format_names(unexpected) or 'none'}; differing {format_names(wrong) or 'none'}."
        )
    firsts = {name for name, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    fed = feed_tied(model, {k: v for k, v in state_dict.items() if k in firsts})
    with reparametrized(model, fed):
        return shard(model, plan, mesh, **options)


def _aliases(model: nn.Module) -> dict[str, str]:
    """Second names of tied parameters -> their first FQN."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(p), name)
        if owner != name:
            aliases[name] = owner
    return aliases


def _padded_flat(
    grads: list[Tensor | None], flat: FlatLayout, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Concatenate gradients (zeros where None) and zero padding: (padded_numel,)."""
    pieces = [
        torch.zeros(n, dtype=dtype, device=device) if g is None else g.reshape(-1).to(device, dtype)
        for g, n in zip(grads, flat.numels, strict=True)
    ]
    pieces.append(torch.zeros(flat.padded_numel - flat.numel, dtype=dtype, device=device))
    return torch.cat(pieces)


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
    ranks = collectives.group_ranks(mesh.group)
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


def _check_full(full: Mapping[str, Tensor], layout: Layout, state: ShardedState) -> None:
    expected = set(layout.fqns) | set(layout.replicated)
    missing = [f for f in (*layout.fqns, *layout.replicated) if f not in full]
    unexpected = [f for f in full if f not in expected]
    if missing or unexpected:
        raise ValueError(
            f"funcshard.reshard: the full parameters do not match the state: missing "
            f"{format_names(missing) or 'none'}; unexpected {format_names(unexpected) or 'none'}. "
            f"Pass every parameter, keyed as funcshard.unshard returns them."
        )
    expected_of = {f: (tuple(t.shape), t.dtype) for f, t in state.replicated.items()}
    for flat in layout.flats:
        expected_of.update(
            {f: (s, flat.dtype) for f, s in zip(flat.fqns, flat.shapes, strict=True)}
        )
    for fqn, (shape, dtype) in expected_of.items():
        t = full[fqn]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"funcshard.reshard: {fqn!r} must be {shape} {dtype}, got "
                f"{tuple(t.shape)} {t.dtype}."
            )


def _check_grads(grads: Mapping[str, Tensor | None], layout: Layout) -> None:
    shapes = {f: s for flat in layout.flats for f, s in zip(flat.fqns, flat.shapes, strict=True)}
    unexpected = [f for f in grads if f not in shapes and f not in layout.replicated]
    if unexpected:
        raise ValueError(
            f"funcshard.reduce: gradients for {format_names(unexpected)}, which are not "
            f"parameters of this state. Key gradients by the FQNs of funcshard.unshard."
        )
    for fqn, g in grads.items():
        if g is not None and fqn in shapes and tuple(g.shape) != shapes[fqn]:
            raise ValueError(
                f"funcshard.reduce: the gradient of {fqn!r} must have shape {shapes[fqn]}, "
                f"got {tuple(g.shape)}."
            )
