"""Plan: which parameters communicate together, as a pure function of the module tree.

[Note: choosing units]
A unit is a group of parameters gathered, resharded and reduced together (an FSDP2
`fully_shard` call, a DDP bucket). Modules are visited once each, in post-order with siblings
in registration order, so a unit is always chosen below its parents and the first registered
subtree wins ties. A module reached under a second name is not visited again.

Each module's *leftover* is its own parameters plus its children's leftovers, less what a unit
has already taken. When the policy says "unit" (or the module is a keep_fp32 class), the
module's leftover becomes that unit. Groups of sibling modules become units of their own
(see [Note: units of several modules] in funcshard/core/_unit_groups.py). Hence a parameter
reachable from several places (tied weights) belongs to the first unit in post-order that
reaches it, and the root, visited last, owns whatever no other unit took. Each parameter is
listed under its first FQN in registration order, the key `funcshard.extract` gives it. The
model is only read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

from funcshard.core import _placement as placement_of
from funcshard.core import _unit_groups as unit_groups
from funcshard.core import _unit_methods as unit_methods
from funcshard.core import _unit_options as unit_options
from funcshard.core._ignored import resolve_ignored
from funcshard.core._module import check_module
from funcshard.core._policy import Buckets, Policy, module_classes
from funcshard.core._precision import MixedPrecision
from funcshard.core._tree import format_names, join_fqn
from funcshard.core._unit_options import UnitOptions


@dataclass(frozen=True)
class Unit:
    """One group of parameters that communicate together, owned by the module `name` (or,
    for a synthetic name in angle brackets, by the modules `modules`, or by none: buckets)."""

    name: str  # the module's FQN; "" is the root; `<...>` a group's or a bucket's
    fqns: tuple[str, ...]
    numel: int
    dtypes: tuple[torch.dtype, ...]  # the distinct dtypes, in order of first appearance
    keep_fp32: bool  # mixed precision off for this unit
    frozen: bool  # no parameter requires grad: never reduced
    shapes: tuple[tuple[int, ...], ...]  # one per FQN
    param_dtypes: tuple[torch.dtype, ...]  # one per FQN
    frozen_fqns: tuple[str, ...] = ()  # in a trainable unit (frozen="warn"|"split"): never updated
    frozen_apart: bool = False  # frozen="split": the frozen_fqns get flat buffers of their own
    modules: tuple[str, ...] = ()  # the modules whose forward gathers it: (name,), a group's
    # members, or none (buckets)
    options: UnitOptions = field(default_factory=UnitOptions)  # see [Note: per-unit options]

    @property
    def methods(self) -> tuple[str, ...]:
        """The module's methods besides forward that gather the unit (`forward_methods`)."""
        return self.options.methods

    @property
    def mp(self) -> MixedPrecision | None:
        """The unit's own mixed-precision policy (`None`: the state's)."""
        return self.options.mp

    @property
    def placement(self) -> str:
        """How its parameters lie over the shard axis: "even" or "owned"."""
        return self.options.placement

    def bytes_per_rank(self, world_size: int) -> int:
        """Bytes each rank holds when the unit is sharded over `world_size` ranks, padding
        included: evenly, or (owned) as much as the most loaded rank."""
        total = 0
        for dtype in self.dtypes:
            numels = tuple(
                math.prod(s)
                for s, d in zip(self.shapes, self.param_dtypes, strict=True)
                if d == dtype
            )
            shard = -(-sum(numels) // world_size)
            if self.placement == "owned" and world_size > 1:
                owners = placement_of.owners(numels, world_size)
                shard = placement_of.owned_offsets(numels, owners, world_size)[1]
            total += shard * dtype.itemsize
        return total


@dataclass(frozen=True)
class Plan:
    """Units in post-order (the root last) and the parameters kept out of every unit."""

    units: tuple[Unit, ...]
    ignored: tuple[str, ...]
    ignored_frozen: tuple[str, ...] = ()  # ignored ones that get no gradient (see `plan`)
    reduce_ignored: bool = True  # all-reduce the ignored ones' gradients (see `plan`)

    @property
    def fqns(self) -> tuple[str, ...]:
        """Every planned parameter, unit by unit."""
        return tuple(f for unit in self.units for f in unit.fqns)

    def fingerprint(self) -> str:
        """A stable hash of units, FQNs, shapes, dtypes, flags, member modules and per-unit
        options: equal plans, equal strings."""
        text = repr(
            [
                (
                    u.name,
                    u.fqns,
                    u.shapes,
                    [str(d) for d in u.param_dtypes],
                    u.keep_fp32,
                    u.frozen,
                    u.frozen_fqns,
                    u.frozen_apart,
                    u.modules,
                    repr(u.options),
                )
                for u in self.units
            ]
            + [self.ignored, self.ignored_frozen, self.reduce_ignored]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def table(self, world_size: int = 1) -> str:
        """One row per unit: params, numel, bytes per rank over `world_size`, flags; a total."""
        rows = [
            [
                u.name or "<root>",
                len(u.fqns),
                f"{u.numel:,}",
                f"{u.bytes_per_rank(world_size):,}",
                ",".join(str(d).removeprefix("torch.") for d in u.dtypes),
                " ".join(_flags(u)),
            ]
            for u in self.units
        ]
        total_bytes = sum(u.bytes_per_rank(world_size) for u in self.units)
        numel = sum(u.numel for u in self.units)
        rows.append(["total", len(self.fqns), f"{numel:,}", f"{total_bytes:,}", "", ""])
        headers = ["unit", "params", "numel", f"bytes/rank (world {world_size})", "dtypes", "flags"]
        table = tabulate(rows, headers=headers, colalign=("left", "right", "right", "right"))
        if self.ignored:
            reduced = "all-reduced" if self.reduce_ignored else "not reduced"
            table += f"\nignored (replicated, {reduced}): {format_names(self.ignored)}"
        return table

    def __str__(self) -> str:
        return self.table(1)


def _flags(unit: Unit) -> list[str]:
    """A unit's flags in `Plan.table`: fp32 (keep_fp32), its own policy's dtypes, frozen."""
    flags = []
    if unit.keep_fp32:
        flags.append("fp32")
    elif unit.mp is not None:
        named = zip(("param", "reduce", "output"), (unit.mp.param_dtype, unit.mp.reduce_dtype,
                                                    unit.mp.output_dtype), strict=True)  # fmt: skip
        given = [f"{k}={str(d).removeprefix('torch.')}" for k, d in named if d is not None]
        flags.append("mp " + (",".join(given) or "off"))
    if unit.frozen:
        flags.append("frozen")
    if unit.placement != "even":
        flags.append(unit.placement)
    return flags


def plan(
    model: nn.Module,
    policy: Policy | Buckets | None = None,
    ignored: Iterable[nn.Module | nn.Parameter | str] = (),
    keep_fp32: Iterable[type[nn.Module]] = (),
    frozen: str = "error",
    reduce_ignored: bool = True,
    forward_methods: Mapping[str | nn.Module, str | Iterable[str]] | None = None,
    groups: Iterable[Iterable[nn.Module | str] | nn.Module | str] = (),
    mp: Mapping[str | nn.Module | type[nn.Module], MixedPrecision] | None = None,
    placement: placement_of.Placement | None = None,
) -> Plan:
    """Choose the units of `model` (see [Note: choosing units]); the model is not modified.

    `policy=None` makes one unit, the root. `groups` lists units chosen by hand beside the
    policy, each a list of sibling modules (objects or FQNs) that gather, reshard and reduce
    as one unit named `<a+b>` (FSDP2's `fully_shard([a, b])`; see [Note: units of several
    modules]). `ignored` modules or parameters (objects or FQNs)
    stay out of every unit: every rank holds them whole, and they train as under DDP, their
    gradients all-reduced (mean) over every data-parallel rank; `reduce_ignored=False` leaves
    each rank its own gradient (FSDP2's `ignored_params`), so replicas may drift apart.
    Ignored parameters that do not require grad, or are not floating point, get none. Each
    module of a `keep_fp32` class becomes its own unit with mixed
    precision off. `frozen="error"` rejects a unit that mixes frozen and trainable parameters;
    `"split"` allows it (LoRA adapters beside their frozen base weights): the frozen members
    get flat buffers of their own in the unit, gathered with it but never reduced, with no
    gradient and no optimizer state; `"warn"` keeps them in the trainable buffer with a
    warning, where they take zero gradients that are reduced. `forward_methods` maps a
    unit's module (object or FQN) to methods other than `forward` that code outside it
    calls (`{"vit": "forward_features"}`): each call gathers the unit as its forward does
    (FSDP2's `register_fsdp_forward_method`). `mp` gives units a mixed-precision policy of
    their own in place of the state's (`shard(..., mp=...)`), keyed by unit name, module
    (object or FQN) or module class (`{"head": fs.MixedPrecision(param_dtype=torch.float16)}`,
    FSDP2's per-module `mp_policy`); it does not choose units. `placement` is how each
    unit's parameters lie over the shard axis: "even" (the default, one flat buffer split
    evenly) or "owned" (each parameter whole on one rank, so `fs.optim.whole_params` needs no
    collective; see [Note: owned placement]), for every unit, or a mapping keyed as `mp` is,
    or a callable `Unit -> "even" | "owned"`. Per-unit options are resolved here, once
    (see [Note: per-unit options]).
    """
    check_module(model, "funcshard.plan")
    methods = unit_methods.resolved(model, forward_methods)
    if isinstance(policy, Buckets):
        if keep_fp32 or groups:
            raise ValueError(
                f"funcshard.plan: {'keep_fp32' if keep_fp32 else 'groups'} applies to module "
                f"units; bucket plans hold parameters, not modules. Drop it or use a module "
                f"policy."
            )
        planned = _bucket_plan(model, policy, ignored)
        planned = _with_ignored(model, planned, reduce_ignored)
        return _with_options(model, planned, methods, mp, placement)
    if policy is not None and not callable(policy):
        raise TypeError(
            f"funcshard.plan: policy must be callable (module, fqn, unowned_numel) -> bool or "
            f"None, got {type(policy).__name__}. See funcshard.policy for ready ones."
        )
    if frozen not in ("error", "warn", "split"):
        raise ValueError(
            f"funcshard.plan: frozen must be 'error', 'split' or 'warn', got {frozen!r}."
        )
    fp32_policy = module_classes(keep_fp32) if keep_fp32 else None
    first_fqn = {id(p): name for name, p in model.named_parameters()}
    order = {pid: i for i, pid in enumerate(first_fqn)}
    ignored_modules, ignored_params = resolve_ignored(model, ignored)
    chosen_groups = unit_groups.resolved(model, groups, ignored_modules)
    group_of = {fqn: g for g, group in enumerate(chosen_groups) for fqn in group}
    collected: list[dict[int, nn.Parameter]] = [{} for _ in chosen_groups]
    visited = [0] * len(chosen_groups)

    units: list[Unit] = []
    overridden: list[str] = []
    owned: set[int] = set(ignored_params)
    leftover: dict[int, dict[int, nn.Parameter]] = {}
    for fqn, module in _post_order(model, ignored_modules):
        mine = {id(p): p for _, p in module.named_parameters(recurse=False)}
        for child in module.children():
            mine.update(leftover.get(id(child), {}))
        mine = {pid: p for pid, p in mine.items() if pid not in owned}
        leftover[id(module)] = mine
        is_root = module is model
        fp32 = fp32_policy is not None and fp32_policy(module, fqn, 0) and not is_root
        if fqn in group_of:  # see [Note: units of several modules]
            g = group_of[fqn]
            if fp32:
                raise ValueError(
                    f"funcshard.plan: {fqn!r} is in the group {list(chosen_groups[g])} and of "
                    f"a keep_fp32 class; give the group's unit mp={{...: "
                    f"MixedPrecision()}} instead, or leave it out of the group."
                )
            collected[g].update(mine)
            leftover[id(module)] = {}
            visited[g] += 1
            if visited[g] == len(chosen_groups[g]):
                params = {pid: p for pid, p in collected[g].items() if pid not in owned}
                if params:
                    name = unit_groups.unit_name(chosen_groups[g])
                    units.append(
                        _unit(name, params, first_fqn, order, False, frozen, chosen_groups[g])
                    )
                    owned.update(params)
            continue
        if not mine:
            continue
        chosen = not is_root and policy is not None and policy(module, fqn, _numel(mine))
        if is_root or fp32 or chosen:
            if fp32 and not chosen:
                overridden.append(fqn)
            units.append(_unit(fqn, mine, first_fqn, order, fp32, frozen, (fqn,)))
            owned.update(mine)
            leftover[id(module)] = {}
    if not units or units[-1].name != "":
        units.append(_unit("", {}, first_fqn, order, False, frozen, ("",)))
    if overridden:
        warnings.warn(
            f"funcshard.plan: keep_fp32 made {len(overridden)} module(s) their own units that "
            f"the policy did not choose ({format_names(overridden)}); each one costs its own "
            f"all-gather and reduce-scatter.",
            UserWarning,
            stacklevel=2,
        )
    ignored_fqns = tuple(first_fqn[pid] for pid in order if pid in ignored_params)
    planned = _with_ignored(model, Plan(units=tuple(units), ignored=ignored_fqns), reduce_ignored)
    return _with_options(model, planned, methods, mp, placement)


def _with_options(
    model: nn.Module,
    plan: Plan,
    methods: unit_methods.Methods,
    mp: Mapping[str | nn.Module | type[nn.Module], MixedPrecision] | None,
    placement: placement_of.Placement | None = None,
) -> Plan:
    """`plan` with its per-unit options (see [Note: per-unit options]): each unit's methods
    (of a unit's own module, not the root's), mixed-precision policy (keep_fp32 units:
    `MixedPrecision()`, mixed precision off) and placement."""
    root_hint = "(the root's methods are funcshard.call(..., method=...))"
    by_unit = unit_options.by_unit(
        model, plan.units, methods, "forward_methods", False, False, root_hint, groups=False
    )
    plan = _with_option(plan, "methods", by_unit)
    policies = unit_options.by_unit(model, plan.units, mp, "mp")
    unit_options.check_values("mp", policies, lambda v: isinstance(v, MixedPrecision),
                              "a funcshard.MixedPrecision")  # fmt: skip
    for u in plan.units:
        if u.keep_fp32 and u.name in policies and policies[u.name] != MixedPrecision():
            raise ValueError(
                f"funcshard.plan: unit {u.name!r} is a keep_fp32 unit (mixed precision off) and "
                f"mp gives it {policies[u.name]}; give one of the two."
            )
        if u.name in policies and not u.fqns:  # (the root, when other units own everything)
            raise ValueError(
                f"funcshard.plan: mp gives unit {u.name or '<root>'!r} a policy, but it holds "
                f"no parameters, so nothing would follow it; give the state's (fs.shard(mp=))."
            )
    policies.update({u.name: MixedPrecision() for u in plan.units if u.keep_fp32})
    plan = _with_option(plan, "mp", policies)
    return _with_option(plan, "placement", placement_of.resolved(model, plan.units, placement))


def _with_option(plan: Plan, option: str, values: Mapping[str, Any]) -> Plan:
    """`plan` with `values[unit]` as the option `option` of each unit it names."""
    if not values:
        return plan
    units = tuple(
        dataclasses.replace(u, options=dataclasses.replace(u.options, **{option: values[u.name]}))
        if u.name in values
        else u
        for u in plan.units
    )
    return dataclasses.replace(plan, units=units)


def _with_ignored(model: nn.Module, plan: Plan, reduce_ignored: bool) -> Plan:
    """`plan` with its ignored parameters' training settings: which get no gradient
    (requires_grad=False, or not floating point) and whether the others are reduced."""
    params = dict(model.named_parameters())
    frozen = tuple(
        f
        for f in plan.ignored
        if not params[f].requires_grad
        or not (params[f].is_floating_point() or params[f].is_complex())
    )
    return dataclasses.replace(plan, ignored_frozen=frozen, reduce_ignored=bool(reduce_ignored))


def _bucket_plan(
    model: nn.Module, policy: Buckets, ignored: Iterable[nn.Module | nn.Parameter | str]
) -> Plan:
    """DDP's buckets as units: see `funcshard.policy.buckets`. Frozen parameters form one
    unit of their own (never reduced); unit names are in angle brackets, which no module FQN
    can contain."""
    _, ignored_params = resolve_ignored(model, ignored)
    first_fqn = {id(p): name for name, p in model.named_parameters()}
    order = {pid: i for i, pid in enumerate(first_fqn)}
    params = {id(p): p for p in model.parameters() if id(p) not in ignored_params}
    trainable = [(pid, p) for pid, p in params.items() if p.requires_grad]
    frozen = {pid: p for pid, p in params.items() if not p.requires_grad}
    units: list[Unit] = []
    current: dict[int, nn.Parameter] = {}
    size = 0
    for pid, p in reversed(trainable):
        cap = (policy.first_bucket_mb if not units else policy.bucket_mb) * 2**20
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:
            units.append(_unit(f"<bucket {len(units)}>", current, first_fqn, order, False, "error"))
            current, size = {}, 0
        current[pid] = p
        size += nbytes
    if current:
        units.append(_unit(f"<bucket {len(units)}>", current, first_fqn, order, False, "error"))
    if frozen:
        units.append(_unit("<frozen>", frozen, first_fqn, order, False, "error"))
    ignored_fqns = tuple(first_fqn[pid] for pid in order if pid in ignored_params)
    return Plan(units=tuple(units), ignored=ignored_fqns)


def _numel(params: dict[int, nn.Parameter]) -> int:
    return sum(p.numel() for p in params.values())


def _unit(
    name: str,
    params: dict[int, nn.Parameter],
    first_fqn: dict[int, str],
    order: dict[int, int],
    keep_fp32: bool,
    frozen: str,
    modules: tuple[str, ...] = (),
) -> Unit:
    ordered = sorted(params.items(), key=lambda item: order[item[0]])
    fqns = tuple(first_fqn[pid] for pid, _ in ordered)
    tensors = [p for _, p in ordered]
    mixed = _check_frozen(name, fqns, tensors, frozen)
    param_dtypes = tuple(p.dtype for p in tensors)
    return Unit(
        name=name,
        fqns=fqns,
        numel=sum(p.numel() for p in tensors),
        dtypes=tuple(dict.fromkeys(param_dtypes)),
        keep_fp32=keep_fp32,
        frozen=bool(tensors) and not any(p.requires_grad for p in tensors),
        shapes=tuple(tuple(p.shape) for p in tensors),
        param_dtypes=param_dtypes,
        frozen_fqns=tuple(f for f, p in zip(fqns, tensors, strict=True) if not p.requires_grad)
        if any(p.requires_grad for p in tensors)
        else (),
        frozen_apart=mixed and frozen == "split",
        modules=modules,
    )


def _check_frozen(
    name: str, fqns: tuple[str, ...], tensors: list[nn.Parameter], frozen: str
) -> bool:
    """Whether the unit mixes frozen and trainable parameters; reject it (frozen="error") or
    warn about it ("warn")."""
    trainable = [(f, p.numel()) for f, p in zip(fqns, tensors, strict=True) if p.requires_grad]
    still = [(f, p.numel()) for f, p in zip(fqns, tensors, strict=True) if not p.requires_grad]
    if not trainable or not still:
        return False
    if frozen == "split":
        return True
    where = f"unit {name!r}" if name else "the root unit"
    message = (
        f"funcshard.plan: {where} mixes parameters with requires_grad=True and False.\n"
        f"  requires_grad=True ({sum(n for _, n in trainable):,} numel): "
        f"{format_names(f for f, _ in trainable)}\n"
        f"  requires_grad=False ({sum(n for _, n in still):,} numel): "
        f"{format_names(f for f, _ in still)}\n"
    )
    if frozen == "error":
        raise ValueError(
            message + "Pass plan(..., frozen='split') to give the frozen part flat buffers "
            "of its own in the unit (no gradient memory for it), or put it in a unit of its own "
            "(a policy that selects its module)."
        )
    warnings.warn(
        message + f"Its gradients are reduced over all {sum(p.numel() for p in tensors):,} "
        f"elements instead of the {sum(n for _, n in trainable):,} trainable ones (the frozen "
        f"ones get zero gradients and no updates); frozen='split' avoids that.",
        UserWarning,
        stacklevel=4,
    )
    return True


def _post_order(model: nn.Module, skip: set[int]) -> Iterator[tuple[str, nn.Module]]:
    """Yield each module once, children before parents, siblings in registration order."""
    seen = {id(model)} | skip

    def visit(fqn: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        for name, child in module.named_children():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                yield from visit(join_fqn(fqn, name), child)
        yield fqn, module

    yield from visit("", model)
