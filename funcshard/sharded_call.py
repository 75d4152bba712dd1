"""Run a model on a sharded state, gathering each unit just before it runs.

[Note: per-unit gathering]
`call(model, state, ...)` installs a forward pre-hook and post-hook on every unit's module for
the duration of the call. The pre-hook gathers the unit through `funcshard.gather.gather` (the
differentiable gather, see [Note: one differentiable gather]; its all-gathers were usually
issued earlier, as a prefetch), swaps the parameters into the module's slots, and issues the
next unit's all-gathers so they overlap this unit's compute. The post-hook swaps meta
placeholders back in and drops the gathered buffers. The root unit, and any unit whose
parameters are also used from outside its own module (a tied weight across units), stay
gathered for the whole call. Outside its unit's forward a parameter slot holds a meta
placeholder, so code that touches it there fails loudly instead of reading stale values.

Differentiation is autograd's own: each gather is an autograd node whose backward reduces, so
the call is a differentiable function of `state.shards`. Autograd runs ready nodes newest
first, so a unit's gather node, created at its module's forward, runs (and starts its
reduce-scatter) right after the unit's backward; a whole-call unit's node runs at the end.

Resharding after forward: while the model runs, `saved_tensors_hooks` replaces every tensor
autograd saves from a gathered buffer with a small handle (unit, buffer, view geometry). In
backward the first unpack of a unit regathers it (prefetching the unit that ran before it in
forward), and the regathered buffer is dropped when the unit's gather node is about to run
(a node pre-hook): its backward reads no parameter. With `reshard_after_forward=False` the
saved views are kept as they are. torch.func refuses saved-tensor hooks, so under its
transforms units stay gathered through backward (a one-time warning says so).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from funcshard import collectives, compiled, gather, recompute
from funcshard.layout import Layout, param_views
from funcshard.module import call as call_on_dict
from funcshard.precision import cast_inputs, cast_outputs
from funcshard.state import ShardedState, ensure_live
from funcshard.tree import format_names, join_fqn


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
    unit_flats: tuple[tuple[int, ...], ...]  # flat indices of each unit
    unit_params: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]  # per unit, each
    # parameter once, in flat order: (flat index, shape)
    param_slots: tuple[tuple[tuple[Slot, int, Tensor], ...], ...]  # per unit: (slot, index into
    # unit_params, meta placeholder) for every slot holding one of the unit's parameters
    whole_call: frozenset[int]  # units gathered for the whole call
    replicated_slots: tuple[tuple[Slot, str], ...]
    buffer_slots: tuple[tuple[Slot, str], ...]
    module_ids: frozenset[int]  # every module of the model (see funcshard/recompute.py)
    relinks: tuple[tuple[nn.Module, tuple[int, ...]], ...]  # (module, the whole-call units
    # owning a slot in it): where each such unit is first used (see `_Run.relink`)
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
    units = layout.units
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
                if not _inside(join_fqn(prefix, attr), units[unit]):
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
    param_slots = []
    for flats, slots in zip(unit_flats, slots_by_unit, strict=True):
        index = {f: k for k, f in enumerate(f for i in flats for f in layout.flats[i].fqns)}
        param_slots.append(
            tuple(
                (slot, index[fqn], torch.empty(shape_of[fqn], device="meta")) for slot, fqn in slots
            )
        )
    root = units.index("") if "" in units else None
    modules = tuple(_module_or_none(model, u) for u in units)
    # Buckets, and containers such as ModuleList, have no forward that runs (so no hook
    # fires): they stay gathered for the whole call (free on a size-1 shard axis).
    not_called = {k for k, m in enumerate(modules) if m is None or not _has_forward(m)}
    whole = frozenset(crossing | not_called | ({root} if root is not None else set()))
    relinks: dict[int, tuple[nn.Module, list[int]]] = {}
    for unit in sorted(whole):
        for slot, _, _ in param_slots[unit]:
            if _has_forward(slot.module):
                entry = relinks.setdefault(id(slot.module), (slot.module, []))
                if unit not in entry[1]:
                    entry[1].append(unit)
    return Binding(
        layout=layout,
        unit_names=units,
        unit_modules=modules,
        unit_flats=unit_flats,
        unit_params=unit_params,
        param_slots=tuple(param_slots),
        whole_call=whole,
        replicated_slots=tuple(replicated),
        buffer_slots=buffer_slots,
        module_ids=frozenset(id(m) for m in model.modules()),
        relinks=tuple((module, tuple(units)) for module, units in relinks.values()),
    )


def _has_forward(module: nn.Module) -> bool:
    """False for containers (ModuleList, ModuleDict) whose forward is never called."""
    return type(module).forward is not nn.Module.forward


def _module_or_none(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _inside(fqn: str, unit: str) -> bool:
    return unit == "" or fqn.startswith(unit + ".")


def _set_slot(slot: Slot, tensor: Tensor) -> None:
    """Store a plain tensor in a parameter or buffer slot (nn.Module's setattr would refuse)."""
    store = slot.module._parameters if slot.is_param else slot.module._buffers
    store[slot.attr] = tensor


def _get_slot(slot: Slot) -> Tensor:
    store = slot.module._parameters if slot.is_param else slot.module._buffers
    return store[slot.attr]


@dataclass(frozen=True)
class Prefetch:
    """Explicit prefetch orders, by unit name ("" is the root).

    When a unit starts in forward, the unit after it in `forward` has its all-gather issued;
    when a unit is regathered in backward, the unit after it in `backward` is. `None` keeps
    the default for that direction: plan order in forward, reverse run order in backward.
    """

    forward: tuple[str, ...] | None = None
    backward: tuple[str, ...] | None = None


class _Handle:
    """What autograd keeps instead of a view into a resharded unit's gathered buffer."""

    __slots__ = ("flat", "offset", "size", "stride", "unit")

    def __init__(self, unit: int, flat: int, tensor: Tensor) -> None:
        self.unit, self.flat = unit, flat
        self.size, self.stride, self.offset = (
            tensor.size(),
            tensor.stride(),
            tensor.storage_offset(),
        )


class _Run:
    """The life of one sharded call: what is gathered, in flight, and in what order units ran."""

    def __init__(self, binding: Binding, state: ShardedState):
        self.binding = binding
        self.state = state
        layout = self.layout = state.layout
        options = state if isinstance(state, gather.Differentiated) else None
        reduction = options.reduction if options is not None else "mean"
        sinks = options.sinks if options is not None else None
        self.specs = _specs(layout, state.mp, reduction)
        grad = torch.is_grad_enabled()
        # torch.func's transforms refuse saved-tensor hooks and wrap the shards they see
        self.functorch = any(_is_functorch(s) for s in state.shards)
        self.sinks = sinks if sinks is not None else (None,) * len(layout.flats)
        self.differentiable = tuple(
            grad and not flat.frozen and (s.requires_grad or sink is not None)
            for s, sink, flat in zip(state.shards, self.sinks, layout.flats, strict=True)
        )
        self.deferred = tuple(
            d and reduction != "none" and not self.functorch and s.requires_grad
            for d, s in zip(self.differentiable, state.shards, strict=True)
        )
        # the wait nodes come first, before any compute: see [Note: one differentiable gather]
        self.inputs = tuple(
            gather.defer_wait(s, spec) if deferred else s
            for s, spec, deferred in zip(state.shards, self.specs, self.deferred, strict=True)
        )
        n_units = len(binding.unit_names)
        self.full: list[tuple[Tensor | None, ...] | None] = [None] * n_units
        self.params: list[tuple[Tensor, ...] | None] = [None] * n_units
        self.pending: dict[int, tuple[collectives.Pending, ...]] = {}
        self.order: list[int] = []
        self.owner_of: dict[int, tuple[int, int]] = {}  # id of a gathered flat buffer ->
        # (unit, flat index): how the saved-tensor hook recognizes gathered parameters
        self.backward_full: dict[int, tuple[Tensor, ...]] = {}
        self.finished: set[int] = set()  # units whose gather nodes ran in backward
        self.relinked: set[int] = set()  # whole-call units given their later gather node
        self.unfinished: dict[int, int] = {}  # unit -> gather nodes still to run
        # nothing to free on a size-1 shard axis, where the "gathered" buffers are the shards
        # themselves (unless mixed precision or offload made them copies)
        copies = layout.mesh.shard > 1 or state.mp is not None or state.offload
        reshard = state.reshard_after_forward is not False and copies
        if reshard and self.functorch and any(self.differentiable):
            _warn_kept_gathered()
        self.reshard = reshard and not self.functorch
        self.saves = self.reshard and any(self.differentiable)
        k = state.reshard_after_forward
        self.post_forward_k = k if not isinstance(k, bool) and k < layout.mesh.shard_size else None
        self.post_forward: dict[int, tuple[Tensor, ...]] = {}  # unit -> this rank's 1/k slices
        prefetch = options.prefetch if options is not None else True
        self.prefetch = prefetch is not False and not self.functorch
        explicit = prefetch if isinstance(prefetch, Prefetch) else Prefetch()
        forward = self._units_named(explicit.forward) if explicit.forward is not None else None
        self.forward_next = _successors(forward or self._sharded_units())
        self.backward_next = (
            _successors(self._units_named(explicit.backward))
            if explicit.backward is not None
            else None
        )

    def _units_named(self, names: tuple[str, ...]) -> list[int]:
        unknown = [n for n in names if n not in self.binding.unit_names]
        if unknown:
            raise ValueError(
                f"funcshard.value_and_grad: prefetch names {unknown}, which are not units of "
                f"this state; its units are {list(self.binding.unit_names)} ('' is the root)."
            )
        return [self.binding.unit_names.index(n) for n in names]

    def _sharded_units(self) -> list[int]:
        return [u for u in range(len(self.binding.unit_names)) if u not in self.binding.whole_call]

    def issue(self, unit: int) -> None:
        """Start the all-gathers of a unit's flat buffers, unless already gathered or started
        (under torch.func each is gathered inside its op instead: no prefetch)."""
        if self.full[unit] is not None or unit in self.pending or self.functorch:
            return
        self.pending[unit] = tuple(
            gather.issue_gather(self.state.shards[i], self.specs[i])
            for i in self.binding.unit_flats[unit]
        )

    def gathered(self, unit: int) -> tuple[Tensor, ...]:
        """A unit's parameters, waiting for its all-gathers (issuing them if needed)."""
        if self.params[unit] is None:
            flats = self.binding.unit_flats[unit]
            self.issue(unit)
            sources = self.pending.pop(unit, (None,) * len(flats))
            params: list[Tensor] = []
            fulls = []
            for i, source in zip(flats, sources, strict=True):
                views = self._gather(i, source)
                full = gather.gathered_buffer(views)
                if full is not None:
                    self.owner_of[id(full)] = (unit, i)
                if self.saves and self.differentiable[i]:
                    self._release_when_reduced(unit, views)
                params.extend(views)
                fulls.append(full)
            self.full[unit] = tuple(fulls)
            self.params[unit] = tuple(params)
        return self.params[unit]

    def _gather(self, i: int, source: collectives.Pending | None) -> tuple[Tensor, ...]:
        spec = self.specs[i]
        if self.differentiable[i]:
            return gather.gather(self.inputs[i], spec, source, self.sinks[i], self.deferred[i])
        if source is None:
            source = gather.issue_gather(self.state.shards[i], spec)
        return param_views(source.wait(), spec.flat)

    def _release_when_reduced(self, unit: int, views: tuple[Tensor, ...]) -> None:
        """Drop a unit's regathered buffers when its gather nodes run in backward."""
        run = weakref.ref(self)  # the graph must not keep the run (and its buffers) alive
        self.unfinished[unit] = self.unfinished.get(unit, 0) + 1

        def reduced(grads: object) -> None:
            alive = run()
            if alive is not None:
                alive.unfinished[unit] -= 1
                if alive.unfinished[unit] == 0:
                    alive.finished.add(unit)
                    alive.backward_full.pop(unit, None)

        views[0].grad_fn.register_prehook(reduced)

    def enter(self, unit: int) -> None:
        """A unit's module is about to run: put its parameters in place, prefetch the next."""
        params = self.gathered(unit)
        self.order.append(unit)
        nxt = self.forward_next.get(unit) if self.prefetch else None
        if nxt is not None:
            self.issue(nxt)
        for slot, index, _ in self.binding.param_slots[unit]:
            _set_slot(slot, params[index])

    def relink(self, unit: int) -> None:
        """The first module owning a slot of a whole-call unit is about to run: give the unit
        a fresh gather node over the buffers it already has, so that its reduce starts
        once backward is past that module, not at the end (autograd runs the nodes created
        first last). Slots read before, e.g. by a parent module, keep the first node, which
        reduces their part at the end; the two reduces add up."""
        flats = self.binding.unit_flats[unit]
        if unit in self.relinked or not any(self.deferred[i] for i in flats):
            return  # nothing reduces asynchronously (second order, torch.func): no overlap
        self.relinked.add(unit)
        old, params = iter(self.params[unit] or ()), []
        for i, full in zip(flats, self.full[unit] or (), strict=True):
            views = [next(old) for _ in self.specs[i].flat.fqns]
            if self.deferred[i]:
                source = collectives.Pending(full, done=True)
                spec, sink = self.specs[i], self.sinks[i]
                views = gather.gather(self.inputs[i], spec, source, sink, self.deferred[i])
            params.extend(views)
        self.params[unit] = tuple(params)
        for slot, index, _ in self.binding.param_slots[unit]:
            _set_slot(slot, params[index])

    def differentiates(self, unit: int) -> bool:
        return any(self.differentiable[i] for i in self.binding.unit_flats[unit])

    def leave(self, unit: int) -> None:
        """A unit's module has run: release its parameters until backward needs them."""
        if unit in self.binding.whole_call:
            return
        self._swap_out(unit)
        differentiates = self.differentiates(unit)
        if differentiates and not self.reshard:
            return  # kept gathered through backward (autograd holds its views anyway)
        if differentiates and self.post_forward_k is not None:
            self.post_forward[unit] = self._slices(self.full[unit] or ())
        self._forget(unit)
        self.full[unit] = None
        self.params[unit] = None

    def _slices(self, flats: tuple[Tensor | None, ...]) -> tuple[Tensor, ...]:
        """This rank's 1/k of each gathered buffer, kept between forward and backward."""
        k = self.post_forward_k
        assert k is not None
        index = self.layout.mesh.shard_rank % k
        return tuple(f.detach().chunk(k)[index].clone() for f in flats if f is not None)

    def _forget(self, unit: int) -> None:
        """Stop recognizing a released unit's buffers: their ids may be reused."""
        for tensor in self.full[unit] or ():
            self.owner_of.pop(id(tensor), None)

    def _swap_out(self, unit: int) -> None:
        """Put meta placeholders in a unit's slots: a use outside its forward fails loudly."""
        for slot, _, placeholder in self.binding.param_slots[unit]:
            _set_slot(slot, placeholder)

    # saved-tensor hooks: see [Note: per-unit gathering]
    def pack(self, tensor: Tensor) -> Any:
        owner = self.owner_of.get(id(tensor if tensor._base is None else tensor._base))
        if owner is None or owner[0] in self.binding.whole_call:
            return tensor  # not a gathered buffer, or one kept for the whole step
        if tensor.dtype != self.full_dtype(owner[1]):
            return tensor
        return _Handle(owner[0], owner[1], tensor)

    def unpack(self, packed: Any) -> Tensor:
        if not isinstance(packed, _Handle):
            return packed
        flats = self.backward_gathered(packed.unit)
        flat = flats[self.binding.unit_flats[packed.unit].index(packed.flat)]
        return flat.as_strided(packed.size, packed.stride, packed.offset)

    def full_dtype(self, flat_index: int) -> torch.dtype:
        return self.specs[flat_index].gather_dtype

    def backward_gathered(self, unit: int) -> tuple[Tensor, ...]:
        """Regather a unit in backward, prefetching the one that ran before it in forward."""
        if unit not in self.backward_full:
            self.issue_backward(unit)
            self.backward_full[unit] = tuple(p.wait() for p in self.pending.pop(unit))
            nxt = self._backward_next(unit) if self.prefetch else None
            if nxt is not None:
                self.issue_backward(nxt)
        return self.backward_full[unit]

    def issue_backward(self, unit: int) -> None:
        """Start regathering a unit: from its k-rank slices, or from the full shard group."""
        if unit in self.backward_full or unit in self.pending:
            return
        slices = self.post_forward.pop(unit, None)
        if slices is None:
            self.full[unit] = None
            self.issue(unit)
            return
        group = self.layout.mesh.post_forward_group(self.post_forward_k)
        name = self.binding.unit_names[unit]
        self.pending[unit] = tuple(collectives.all_gather(s, group, what=name) for s in slices)

    def _backward_next(self, unit: int) -> int | None:
        """The unit to regather next: the explicit order's, or the one that ran just before
        `unit` in forward, if backward still needs it."""
        if self.backward_next is not None:
            earlier = self.backward_next.get(unit)
        elif unit in self.order and self.order.index(unit) > 0:
            earlier = self.order[self.order.index(unit) - 1]
        else:
            earlier = None
        if earlier is None or earlier in self.binding.whole_call:
            return None  # whole-call units stay gathered through backward
        if earlier in self.finished or earlier in self.backward_full:
            return None
        return earlier

    def recompute_params(self, unit: int) -> tuple[Tensor, ...]:
        """A unit's parameters for a recomputation in backward, regathered if the unit was
        resharded: fresh leaves (the gradients flow through the first forward's graph) that
        require grad as the first forward's did, so autograd saves the same tensors."""
        params = self.params[unit]
        if params is None:
            flats = self.backward_gathered(unit)
            params = tuple(
                param
                for i, flat in zip(self.binding.unit_flats[unit], flats, strict=True)
                for param in param_views(flat, self.layout.flats[i])
            )
        flats = self.binding.unit_flats[unit]
        trainable = any(not self.layout.flats[i].frozen for i in flats)
        return tuple(p.detach().requires_grad_(trainable) for p in params)

    def drain(self) -> None:
        """Wait for gathers nobody used (a prefetch past the last unit): every rank issued them."""
        for pending in self.pending.values():
            for p in pending:
                p.wait()
        self.pending.clear()

    def after_call(self) -> None:
        """Keep only what backward needs: the whole-call units when resharding, every
        gathered unit when not (autograd holds their views anyway), nothing without grad."""
        keep = [
            self.differentiates(u) and (not self.reshard or u in self.binding.whole_call)
            for u in range(len(self.full))
        ]
        self.full = [f if k else None for f, k in zip(self.full, keep, strict=True)]
        self.params = [p if k else None for p, k in zip(self.params, keep, strict=True)]


def _specs(layout: Layout, mp: Any, reduction: str) -> tuple[gather.GatherSpec, ...]:
    return tuple(gather.GatherSpec(flat, layout.mesh, mp, reduction) for flat in layout.flats)


def _is_functorch(tensor: Tensor) -> bool:
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor)


_warned_kept_gathered = False


def _warn_kept_gathered() -> None:
    global _warned_kept_gathered
    if not _warned_kept_gathered:
        _warned_kept_gathered = True
        warnings.warn(
            "funcshard.call under a torch.func transform: units stay gathered from their "
            "forward through backward (torch.func refuses the saved-tensor hooks that "
            "reshard_after_forward regathers with), so this step holds more memory than "
            "fs.value_and_grad or torch.autograd.grad would. Shown once.",
            stacklevel=4,
        )


class _Recomputation:
    """Puts a finished sharded call's tensors back while backward recomputes one of its
    modules (see [Note: recomputation after funcshard.call]): the units owning parameters
    under that module (regathered if they were resharded), the replicated tensors, and
    copies of the buffers the call ended with. Counts what it put in, so nested modules
    and units shared by several recomputed modules come out once, last."""

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.buffers: dict[str, Tensor] = {}  # the call's buffers when it returned
        self.holds: dict[int, int] = {}  # unit -> how many entered modules need it
        self.saved: dict[int, list[tuple[Slot, Tensor]]] = {}  # unit -> what its slots held
        self.depth = 0
        self.saved_others: list[tuple[Slot, Tensor]] = []

    def enter(self, module: nn.Module) -> object:
        binding, run = self.run.binding, self.run
        units = self._units_under(module)
        # everything that can fail (regathering) first, so a failure leaves no slot changed
        fresh = {u: run.recompute_params(u) for u in units if u not in self.holds}
        if self.depth == 0:
            others = [s for s, _ in binding.replicated_slots] + [s for s, _ in binding.buffer_slots]
            self.saved_others = [(slot, _get_slot(slot)) for slot in others]
            for slot, fqn in binding.replicated_slots:
                _set_slot(slot, run.state.replicated[fqn])
            for slot, fqn in binding.buffer_slots:
                _set_slot(slot, self.buffers[fqn].detach().clone())
        self.depth += 1
        for unit in units:
            self.holds[unit] = self.holds.get(unit, 0) + 1
        for unit, params in fresh.items():
            slots = binding.param_slots[unit]
            self.saved[unit] = [(slot, _get_slot(slot)) for slot, _, _ in slots]
            for slot, index, _ in slots:
                _set_slot(slot, params[index])
        return units

    def exit(self, token: object) -> None:
        for unit in token:  # type: ignore[attr-defined]
            self.holds[unit] -= 1
            if self.holds[unit] == 0:
                del self.holds[unit]
                _restore_slots(self.saved.pop(unit))
        self.depth -= 1
        if self.depth == 0:
            _restore_slots(self.saved_others)
            self.saved_others = []

    def _units_under(self, module: nn.Module) -> tuple[int, ...]:
        binding = self.run.binding
        units = binding.units_under.get(id(module))
        if units is None:
            ids = {id(m) for m in module.modules()}
            units = binding.units_under[id(module)] = tuple(
                u
                for u, slots in enumerate(binding.param_slots)
                if any(id(slot.module) in ids for slot, _, _ in slots)
            )
        return units


def _successors(order: list[int]) -> dict[int, int]:
    return dict(itertools.pairwise(order))


def call(
    model: nn.Module,
    params: ShardedState | Mapping[str, Tensor],
    *args: Any,
    buffers: Mapping[str, Tensor] | None = None,
    mutable: bool = False,
    method: str = "forward",
    **kwargs: Any,
) -> Any:
    """Run `model.<method>(*args, **kwargs)` on a params dict or a sharded state.

    On a ShardedState each unit is all-gathered just before its module runs and released
    after it (see [Note: per-unit gathering]); the state's buffers are used (cloned, so the
    state is never written) and `mutable=True` returns `(out, new_buffers)`.
    Communicates (sharded): one all-gather per unit and flat buffer over the shard axis.
    """
    if not isinstance(params, ShardedState):
        return call_on_dict(
            model, params, *args, buffers=buffers, mutable=mutable, method=method, **kwargs
        )
    state = params
    if torch.compiler.is_dynamo_compiling():
        return compiled.call(model, state, args, kwargs, buffers, mutable, method)
    return _eager_call(
        model, state, *args, buffers=buffers, mutable=mutable, method=method, **kwargs
    )


def _eager_call(
    model: nn.Module,
    state: ShardedState,
    *args: Any,
    buffers: Mapping[str, Tensor] | None,
    mutable: bool,
    method: str,
    **kwargs: Any,
) -> Any:
    """`call` on a sharded state, eagerly (see [Note: per-unit gathering])."""
    ensure_live(state, "call")
    binding = bind(model, state.layout)
    if isinstance(state, gather.Differentiated) and not torch.is_grad_enabled():
        recompute.refuse_reentrant_checkpoint("call")
    run = _Run(binding, state)
    new_buffers = {
        k: v.clone() for k, v in (buffers if buffers is not None else state.buffers).items()
    }
    args, kwargs = cast_inputs(state.mp, args, kwargs)
    originals = _save_slots(binding)
    hooks = _install_hooks(binding, run)
    try:
        for slot, fqn in binding.replicated_slots:
            _set_slot(slot, state.replicated[fqn])
        for slot, fqn in binding.buffer_slots:
            _set_slot(slot, new_buffers[fqn])
        for unit in range(len(binding.unit_names)):
            if unit in binding.whole_call:
                run.enter(unit)
            else:
                run._swap_out(unit)
        saved = (
            torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack)
            if run.saves
            else contextlib.nullcontext()
        )
        recomputation = _Recomputation(run)
        with saved, recompute.calling(binding.module_ids, recomputation):
            target = model if method == "forward" else getattr(model, method)
            out = target(*args, **kwargs)
        new_buffers = {fqn: _get_slot(slot) for slot, fqn in binding.buffer_slots}
        recomputation.buffers = new_buffers
    finally:
        for handle in hooks:
            handle.remove()
        _restore_slots(originals)
        run.drain()
    run.after_call()
    out = cast_outputs(state.mp, out)
    return (out, new_buffers) if mutable else out


def _install_hooks(binding: Binding, run: _Run) -> list[Any]:
    handles = [
        module.register_forward_pre_hook(_relink_hook(run, units))
        for module, units in binding.relinks
    ]
    for unit, module in enumerate(binding.unit_modules):
        if unit in binding.whole_call:
            continue
        handles.append(module.register_forward_pre_hook(_pre_hook(run, unit)))
        handles.append(module.register_forward_hook(_post_hook(run, unit), always_call=True))
    return handles


def _relink_hook(run: _Run, units: tuple[int, ...]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        for unit in units:
            run.relink(unit)

    return hook


def _pre_hook(run: _Run, unit: int) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        run.enter(unit)

    return hook


def _post_hook(run: _Run, unit: int) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        run.leave(unit)

    return hook


def _save_slots(binding: Binding) -> list[tuple[Slot, Tensor]]:
    slots = [slot for unit in binding.param_slots for slot, _, _ in unit]
    slots += [s for s, _ in binding.replicated_slots] + [s for s, _ in binding.buffer_slots]
    return [(slot, _get_slot(slot)) for slot in slots]


def _restore_slots(saved: list[tuple[Slot, Tensor]]) -> None:
    for slot, tensor in saved:
        _set_slot(slot, tensor)
