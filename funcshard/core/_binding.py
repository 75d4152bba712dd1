"""How a sharded state's layout maps onto one model's modules: the slots each unit's
parameters, the replicated tensors and the buffers are stored in (built once per model and
layout, cached)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar, cast

from torch import Tensor, nn

from funcshard.core._layout import Layout
from funcshard.core._tree import format_names, join_fqn
from funcshard.core._ungathered import Ungathered

T = TypeVar("T")
ByModule = tuple[tuple[nn.Module, tuple[T, ...]], ...]  # (module, its items), once per module


@dataclass(frozen=True)
class Slot:
    """One place a tensor is stored in the module tree: `module.<attr>`."""

    module: nn.Module
    attr: str
    is_param: bool


@dataclass(frozen=True)
class Binding:
    """How a layout maps onto one model's modules (built once per model and layout)."""

    layout: Layout
    unit_names: tuple[str, ...]
    unit_modules: tuple[nn.Module | None, ...]  # None for units of parameters (buckets)
    # and of several modules
    unit_members: tuple[tuple[nn.Module, ...], ...]  # the modules whose forward gathers each
    # unit: its module, a group's members (see [Note: units of several modules]), none
    unit_flats: tuple[tuple[int, ...], ...]  # flat indices of each unit
    unit_params: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]  # per unit, each
    # parameter once, in flat order: (flat index, shape)
    param_slots: tuple[tuple[tuple[Slot, int, Tensor], ...], ...]  # per unit: (slot, index into
    # unit_params, meta placeholder) for every slot holding one of the unit's parameters
    whole_call: frozenset[int]  # units gathered for the whole call
    replicated_slots: tuple[tuple[Slot, str], ...]
    buffer_slots: tuple[tuple[Slot, str], ...]
    module_ids: frozenset[int]  # every module of the model (see funcshard/core/_recompute.py)
    relinks: tuple[tuple[nn.Module, tuple[int, ...]], ...]  # (module, the whole-call units
    # owning a slot in it): where each such unit is first used (see `Run.relink`)
    relinked_units: frozenset[str]  # the names of the units in `relinks`
    unit_placeholders: tuple[ByModule[tuple[str, Tensor]], ...]  # per unit: (attr, meta
    # placeholder) of its parameter slots, by module
    param_attrs: ByModule[str]  # the attrs of every parameter slot (replicated ones too)
    buffer_attrs: ByModule[str]  # and of every buffer slot, by module
    units_under: dict[int, tuple[int, ...]] = field(default_factory=dict, compare=False)
    # module id -> the units owning a parameter slot under it (filled on first recompute)


_BINDINGS: weakref.WeakKeyDictionary[nn.Module, dict[int, Binding]] = weakref.WeakKeyDictionary()


def bind(model: nn.Module, layout: Layout) -> Binding:
    """The binding of `layout` to `model`, cached per (model, layout object)."""
    per_model = _BINDINGS.setdefault(model, {})
    binding = per_model.get(id(layout))
    if binding is None or binding.layout is not layout:
        binding = per_model[id(layout)] = _build_binding(model, layout)
    return binding


def _build_binding(model: nn.Module, layout: Layout) -> Binding:
    first_fqn = {id(p): n for n, p in model.named_parameters()}
    expected = set(layout.fqns) | set(layout.replicated)
    if set(first_fqn.values()) != expected:
        missing = sorted(expected - set(first_fqn.values()))
        extra = sorted(set(first_fqn.values()) - expected)
        raise ValueError(
            f"funcshard.call: the state does not belong to this {type(model).__name__}: the "
            f"state has {format_names(missing) or 'nothing'} that the model lacks, the model "
            f"has {format_names(extra) or 'nothing'} that the state lacks. Call the model "
            f"the state was sharded from."
        )
    flat_of = {fqn: i for i, flat in enumerate(layout.flats) for fqn in flat.fqns}
    shape_of = dict(zip(layout.fqns, (s for f in layout.flats for s in f.shapes), strict=True))
    _check_shapes(model, layout, shape_of, flat_of)
    units = layout.units
    members = _members(model, layout)
    unit_of_flat = [units.index(flat.unit) for flat in layout.flats]
    slots_by_unit: list[list[tuple[Slot, str]]] = [[] for _ in units]
    crossing: set[int] = set()
    replicated, buffers, seen = [], [], set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False):
            fqn = first_fqn[id(p)]
            if fqn in layout.replicated:
                if (id(module), attr) not in seen:
                    replicated.append((Slot(module, attr, True), fqn))
            else:
                unit = unit_of_flat[flat_of[fqn]]
                if (id(module), attr) not in seen:
                    slots_by_unit[unit].append((Slot(module, attr, True), fqn))
                if not any(_inside(join_fqn(prefix, attr), m) for m in members[unit]):
                    crossing.add(unit)
            seen.add((id(module), attr))
        for attr, _ in module.named_buffers(recurse=False):
            if (id(module), attr) not in seen:
                seen.add((id(module), attr))
                buffers.append((Slot(module, attr, False), join_fqn(prefix, attr)))
    first_buffer = {id(b): n for n, b in model.named_buffers()}
    buffer_slots = tuple(
        (slot, first_buffer[id(getattr(slot.module, slot.attr))]) for slot, _ in buffers
    )
    unit_flats = tuple(
        tuple(i for i, u in enumerate(unit_of_flat) if u == k) for k in range(len(units))
    )
    unit_params = tuple(
        tuple((i, shape_of[f]) for i in flats for f in layout.flats[i].fqns) for flats in unit_flats
    )
    modules = tuple(_module_or_none(model, u) for u in units)
    member_modules = tuple(tuple(model.get_submodule(m) for m in names) for names in members)
    param_slots = []
    for unit, (flats, slots) in enumerate(zip(unit_flats, slots_by_unit, strict=True)):
        index = {f: k for k, f in enumerate(f for i in flats for f in layout.flats[i].fqns)}
        placed = []
        for slot, fqn in slots:  # each slot's placeholder: what it holds while the unit is
            # not gathered (see [Note: placeholders that refuse to compute])
            dtype = layout.flats[flat_of[fqn]].dtype
            placeholder = Ungathered(shape_of[fqn], dtype, fqn, units[unit], modules[unit])
            placed.append((slot, index[fqn], placeholder))
        param_slots.append(tuple(placed))
    root = units.index("") if "" in units else None
    # Buckets, and containers such as ModuleList, have no forward that runs (so no hook
    # fires): they stay gathered for the whole call (free on a size-1 shard axis), as does
    # a group with such a member, whose parameters are read where no hook can tell.
    not_called = {
        k for k, ms in enumerate(member_modules) if not ms or not all(map(has_forward, ms))
    }
    whole = frozenset(crossing | not_called | ({root} if root is not None else set()))
    relinks: dict[int, tuple[nn.Module, list[int]]] = {}
    for unit in sorted(whole):
        for slot, _, _ in param_slots[unit]:
            if has_forward(slot.module):
                entry = relinks.setdefault(id(slot.module), (slot.module, []))
                if unit not in entry[1]:
                    entry[1].append(unit)
    every_slot = [s for unit in param_slots for s, _, _ in unit]
    every_slot += [s for s, _ in (*replicated, *buffer_slots)]
    return Binding(
        layout=layout,
        unit_names=units,
        unit_modules=modules,
        unit_members=member_modules,
        unit_flats=unit_flats,
        unit_params=unit_params,
        param_slots=tuple(param_slots),
        whole_call=whole,
        replicated_slots=tuple(replicated),
        buffer_slots=buffer_slots,
        module_ids=frozenset(id(m) for m in model.modules()),
        relinks=tuple((module, tuple(units)) for module, units in relinks.values()),
        relinked_units=frozenset(units[u] for _, us in relinks.values() for u in us),
        unit_placeholders=tuple(
            _by_module((s.module, (s.attr, placeholder)) for s, _, placeholder in slots)
            for slots in param_slots
        ),
        param_attrs=_by_module((s.module, s.attr) for s in every_slot if s.is_param),
        buffer_attrs=_by_module((s.module, s.attr) for s in every_slot if not s.is_param),
    )


def _by_module(items: Iterable[tuple[nn.Module, T]]) -> ByModule[T]:
    """`items` grouped by their module, modules in the order first seen."""
    groups: dict[int, tuple[nn.Module, list[T]]] = {}
    for module, item in items:
        groups.setdefault(id(module), (module, []))[1].append(item)
    return tuple((module, tuple(group)) for module, group in groups.values())


def has_forward(module: nn.Module) -> bool:
    """False for containers (ModuleList, ModuleDict) whose forward is never called."""
    return type(module).forward is not nn.Module.forward


def _check_shapes(
    model: nn.Module, layout: Layout, shape_of: dict[str, tuple[int, ...]], flat_of: dict
) -> None:
    """Every sharded parameter of `model` has the shape and dtype the state holds for it
    (checked once per binding, before any collective): a state from a model of another
    width would otherwise run, or fail deep inside an op."""
    wrong = []
    for fqn, p in model.named_parameters():
        if fqn not in shape_of:
            continue  # replicated: its tensor comes from the state whole
        flat = layout.flats[flat_of[fqn]]
        if tuple(p.shape) != tuple(shape_of[fqn]) or p.dtype != flat.dtype:
            wrong.append(
                f"{fqn!r}: the model has {tuple(p.shape)} {p.dtype}, the state "
                f"{tuple(shape_of[fqn])} {flat.dtype}"
            )
    if wrong:
        raise ValueError(
            f"funcshard.call: the state was sharded from another {type(model).__name__} "
            f"(parameters of other shapes or dtypes): {'; '.join(wrong[:5])}"
            f"{f'; and {len(wrong) - 5} more' if len(wrong) > 5 else ''}. Call the model the "
            f"state was sharded from, or shard this one (funcshard.shard)."
        )


def _members(model: nn.Module, layout: Layout) -> tuple[tuple[str, ...], ...]:
    """Each unit's member modules' FQNs: a group's members, a module unit's module, none
    for a unit of parameters (a bucket)."""
    groups = dict(layout.unit_groups)
    return tuple(
        groups[u] if u in groups else (() if _module_or_none(model, u) is None else (u,))
        for u in layout.units
    )


def _module_or_none(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _inside(fqn: str, unit: str) -> bool:
    return unit == "" or fqn.startswith(unit + ".")


def set_slot(slot: Slot, tensor: Tensor) -> None:
    """Store a plain tensor in a parameter or buffer slot (nn.Module's setattr would refuse)."""
    store = slot.module._parameters if slot.is_param else slot.module._buffers
    # a parameter slot holds a plain tensor during a call, where torch types it as Parameter
    store[slot.attr] = tensor  # type: ignore[assignment]  # as torch's _named_member_accessor


def get_slot(slot: Slot) -> Tensor:
    store = slot.module._parameters if slot.is_param else slot.module._buffers
    # a slot holds a tensor: `bind` takes no empty ones, and calls store only tensors
    return cast(Tensor, store[slot.attr])


def restore_slots(saved: list[tuple[Slot, Tensor]]) -> None:
    """Put back what a list of (slot, what it held) says."""
    for slot, tensor in saved:
        set_slot(slot, tensor)


Saved = list[tuple[nn.Module, dict[str, T]]]  # (module, what some of its slots hold)
# parameter slots, buffer slots (typed as nn.Module types its parameters and buffers)
Snapshot = tuple[Saved[nn.Parameter | None], Saved[Tensor | None]]


def snapshot_slots(binding: Binding) -> Snapshot:
    """What every slot of the model holds now (to put back after a call), per module: one
    dict of its parameter slots and one of its buffer slots. A call runs this over every
    slot of the model each step, and a comprehension per module costs less than a Python
    call per slot."""
    params = [(m, {a: m._parameters[a] for a in attrs}) for m, attrs in binding.param_attrs]
    buffers = [(m, {a: m._buffers[a] for a in attrs}) for m, attrs in binding.buffer_attrs]
    return params, buffers


def restore_snapshot(snapshot: Snapshot) -> None:
    """Put back what `snapshot_slots` saw: the slots only (a module's other entries, e.g. a
    buffer its forward registered, stay as they are)."""
    params, buffers = snapshot
    for module, saved_params in params:
        module._parameters.update(saved_params)
    for module, saved_buffers in buffers:
        module._buffers.update(saved_buffers)
