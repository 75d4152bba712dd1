"""A sharded state's buffers through one step, on the meta device (see [Note: dry run]).

`MetaStep` mirrors `funcshard.step._unit_schedule.Run` and `funcshard.step._regather.Regather` with
allocations where they communicate: what is gathered, prefetched, resharded after forward,
regathered in backward, and reduced with one reduce in flight. Keep the two in step: the
estimate is only as right as this mirror (benchmarks/estimate.py and tests/planning/test_estimate.py
compare it with LiveTensors in a real step).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from funcshard.core import _recompute as recompute
from funcshard.core._binding import Binding, set_slot
from funcshard.core._layout import FlatLayout, Layout, frozen_ranges, param_views
from funcshard.core._precision import (
    MixedPrecision,
    cast_inputs,
    cast_outputs,
    gather_dtype,
    reduce_dtype,
    root_policy,
)
from funcshard.planning._meta_saved import Handle
from funcshard.step._regather import SavedView, still_held


class _Call:
    """One call of the model: what is gathered, prefetched and regathered (see
    `funcshard.step._unit_schedule.Run` and `funcshard.step._regather.Regather`)."""

    def __init__(self) -> None:
        self.full: dict[int, tuple[Tensor, ...]] = {}  # gathered in forward
        self.params: dict[int, tuple[Tensor, ...]] = {}
        self.pending: dict[int, tuple[Tensor, ...]] = {}  # issued, not yet used
        self.regathered: dict[int, tuple[Tensor, ...]] = {}
        self.slices: dict[int, tuple[Tensor, ...]] = {}  # reshard_after_forward=k
        self.order: list[int] = []
        self.relinked: set[int] = set()
        self.finished: set[int] = set()
        self.unfinished: dict[int, int] = {}
        self.latest: tuple[int, tuple[Tensor, ...]] | None = None  # returned last
        self.aliases: dict[int, Tensor] = {}  # flat index -> a whole-call buffer's alias
        self.whole: dict[int, list[weakref.ref[Tensor]]] = {}  # unit -> its aliases, weakly
        self.started: set[int] = set()  # units backward has asked for
        self.to_run: dict[int, set[int]] = {}  # an entered group -> its members yet to run


class MetaStep:
    """The sharded state of one dry run and the life of its units' buffers."""

    def __init__(
        self,
        binding: Binding,
        layout: Layout,
        sizes: tuple[int, int],
        mp: MixedPrecision | None,
        reshard_after_forward: bool | int,
        prefetch: bool,
    ) -> None:
        self.binding, self.layout, self.mp, self.prefetch = binding, layout, mp, prefetch
        self.replicate, self.shard = sizes
        flats = layout.flats
        self.shards = tuple(
            torch.empty(f.shard_numel, dtype=f.dtype, device="meta").requires_grad_(not f.frozen)
            for f in flats
        )
        trainable = set(layout.replicated_trainable)
        self.replicated = {
            fqn: torch.empty(
                _shape(binding, fqn), dtype=_dtype(binding, fqn), device="meta"
            ).requires_grad_(fqn in trainable)
            for fqn in layout.replicated
        }
        for slot, fqn in binding.replicated_slots:
            set_slot(slot, self.replicated[fqn])
        for slot, _ in binding.buffer_slots:  # the state's buffers, on the meta device
            buffer = slot.module._buffers[slot.attr]
            assert buffer is not None  # bound from named_buffers, which skips None buffers
            set_slot(slot, torch.empty_like(buffer, device="meta"))
        self.copies = self.shard > 1 or any(gather_dtype(mp, f) != f.dtype for f in flats)
        self.reshard = reshard_after_forward is not False and self.copies
        k = reshard_after_forward
        self.k = k if not isinstance(k, bool) and k < self.shard else None
        whole = binding.whole_call
        sharded = [u for u in range(len(binding.unit_names)) if u not in whole]
        self.forward_next = dict(itertools.pairwise(sharded))
        self.first_forward = sharded[0] if sharded else None
        self.owner: dict[int, tuple[_Call, int, int]] = {}  # id of a gathered buffer ->
        # (call, unit, flat index): how `pack` recognizes the parameters' views
        self.calls: list[_Call] = []
        self.current: _Call | None = None
        self.in_flight: Tensor | None = None  # the input of the reduce in flight

    # the state
    def leaves(self) -> list[Tensor]:
        """What the step differentiates: the trainable shards and replicated parameters."""
        return [t for t in (*self.shards, *self.replicated.values()) if t.requires_grad]

    def optimized(self) -> dict[str, Tensor]:
        """The leaves the optimizer updates, as a dict (`funcshard.optim` takes one)."""
        return {str(i): t.detach() for i, t in enumerate(self.leaves())}

    def finish(self) -> None:
        """Backward is done: the last reduce lands, and each call's buffers go."""
        self.in_flight = None
        self.calls.clear()
        self.owner.clear()

    # forward
    def install_hooks(self, model: nn.Module) -> list[Any]:
        binding = self.binding
        handles = [
            model.register_forward_pre_hook(self._begin, prepend=True, with_kwargs=True),
            model.register_forward_hook(self._end, always_call=True),
        ]
        for relinked, units in binding.relinks:
            handles.append(relinked.register_forward_pre_hook(self._relink_hook(units)))
        for unit, members in enumerate(binding.unit_members):
            group = frozenset(map(id, members)) if len(members) > 1 else None
            for module in members if unit not in binding.whole_call else ():
                handles.append(module.register_forward_pre_hook(self._enter_hook(unit, group)))
                handles.append(
                    module.register_forward_hook(self._leave_hook(unit), always_call=True)
                )
        return handles

    def _enter_hook(self, unit: int, group: frozenset[int] | None) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            call = self.current
            if call is not None and (group is None or unit not in call.to_run):
                if group is not None:  # a group: entered by its first member to run
                    call.to_run[unit] = set(group)
                self._enter(call, unit)

        return hook

    def _leave_hook(self, unit: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            call = self.current
            if call is None:
                return
            to_run = call.to_run.get(unit)
            if to_run is not None:  # a group: left once each member has run
                to_run.discard(id(module))
                if to_run:
                    return
                del call.to_run[unit]
            self._leave(call, unit)

        return hook

    def _relink_hook(self, units: tuple[int, ...]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.current is not None:
                for unit in units:
                    self._relink(self.current, unit)

        return hook

    def _begin(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The model's call starts: gather the whole-call units, cast the inputs."""
        call = self.current = _Call()
        self.calls.append(call)
        for unit in range(len(self.binding.unit_names)):  # issued first (`UnitGathers.start`)
            if unit in self.binding.whole_call:
                self._issue(call, unit)
        if self.prefetch and self.first_forward is not None:
            self._issue(call, self.first_forward)
        for unit in range(len(self.binding.unit_names)):
            if unit in self.binding.whole_call:
                self._enter(call, unit)
            else:
                self._swap_out(unit)
        return cast_inputs(root_policy(self.mp, self.layout.flats), args, kwargs)

    def _end(self, model: nn.Module, args: tuple, output: Any) -> Any:
        """The model's call returns: keep what backward needs, cast the outputs."""
        call, self.current = self.current, None
        if call is None:
            return output
        call.pending.clear()  # a prefetch nobody used
        if call.latest is not None:  # the unit that ran last stays for backward
            unit, fulls = call.latest
            call.latest = None
            call.regathered[unit] = fulls
        for unit in list(call.full):
            self._swap_out(unit)  # the call puts the model's own tensors back
            if self.reshard or not self._trainable(unit):
                call.full.pop(unit)
        for unit in self.binding.whole_call:  # from now on held by saved views alone
            flats = self.binding.unit_flats[unit]
            if all(i in call.aliases for i in flats):
                call.whole[unit] = [weakref.ref(call.aliases[i]) for i in flats]
        call.aliases = {}
        call.params.clear()  # views whose nodes hold the call: a cycle through autograd
        return cast_outputs(root_policy(self.mp, self.layout.flats), output)

    def _enter(self, call: _Call, unit: int) -> None:
        if unit not in self.binding.whole_call:
            call.latest = None  # the unit before is released
        params = self._gathered(call, unit)
        call.order.append(unit)
        nxt = self.forward_next.get(unit) if self.prefetch else None
        if nxt is not None:
            self._issue(call, nxt)
        for slot, index, _ in self.binding.param_slots[unit]:
            set_slot(slot, params[index])

    def _gathered(self, call: _Call, unit: int) -> tuple[Tensor, ...]:
        if unit in call.params:
            return call.params[unit]
        self._issue(call, unit)
        fulls = call.full.get(unit) or call.pending.pop(unit)
        params: list[Tensor] = []
        grad, whole = torch.is_grad_enabled(), unit in self.binding.whole_call
        for i, full in zip(self.binding.unit_flats[unit], fulls, strict=True):
            flat = self.layout.flats[i]
            if self.shards[i].requires_grad and grad:
                params.extend(_DryGather.apply(self.shards[i], (self, call, unit, i, full, True)))
                if self.reshard:
                    self.owner[id(full)] = (call, unit, i)
                    call.unfinished[unit] = call.unfinished.get(unit, 0) + 1
            else:
                params.extend(param_views(full, flat))
            if self.reshard and grad and whole:  # frozen ones too, as `Regather.track`
                self.owner[id(full)] = (call, unit, i)
                call.aliases.setdefault(i, full.detach())
        call.full[unit] = fulls
        call.params[unit] = tuple(params)
        return call.params[unit]

    def _issue(self, call: _Call, unit: int) -> None:
        """Allocate a unit's buffers where the all-gathers would be issued."""
        if unit in call.full or unit in call.pending or unit in call.regathered:
            return
        call.slices.pop(unit, None)  # regathered from the slices: they go
        flats = [self.layout.flats[i] for i in self.binding.unit_flats[unit]]
        if not self.copies:  # a size-1 shard axis without a cast: the shards themselves
            call.pending[unit] = tuple(
                self.shards[i].detach() for i in self.binding.unit_flats[unit]
            )
            return
        call.pending[unit] = tuple(
            torch.empty(f.padded_numel, dtype=gather_dtype(self.mp, f), device="meta")
            for f in flats
        )

    def _relink(self, call: _Call, unit: int) -> None:
        """A fresh gather node over a whole-call unit's buffers (see `Run.relink`)."""
        if unit in call.relinked or not self._trainable(unit) or not torch.is_grad_enabled():
            return
        call.relinked.add(unit)
        params: list[Tensor] = []
        old = iter(call.params[unit])
        for i, full in zip(self.binding.unit_flats[unit], call.full[unit], strict=True):
            views = [next(old) for _ in self.layout.flats[i].fqns]
            if self.shards[i].requires_grad:
                # (uncounted: the run's relinked gathers do not report their backward)
                where = (self, call, unit, i, full, False)
                views = list(_DryGather.apply(self.shards[i], where))
            params.extend(views)
        call.params[unit] = tuple(params)
        for slot, index, _ in self.binding.param_slots[unit]:
            set_slot(slot, params[index])

    def _leave(self, call: _Call, unit: int) -> None:
        self._swap_out(unit)
        trainable = self._trainable(unit)
        if trainable and not self.reshard:
            return
        fulls = call.full.pop(unit, ())
        call.params.pop(unit, None)
        if trainable:
            if self.k is not None:  # this rank's 1/k slice stays until backward
                call.slices[unit] = tuple(f.detach().chunk(self.k)[0].clone() for f in fulls)
            elif len(fulls) == len(self.binding.unit_flats[unit]):
                call.latest = (unit, tuple(fulls))
            for f in fulls:
                self.owner.pop(id(f), None)

    def _swap_out(self, unit: int) -> None:
        for slot, _, placeholder in self.binding.param_slots[unit]:
            set_slot(slot, placeholder)

    def _trainable(self, unit: int) -> bool:
        return any(self.shards[i].requires_grad for i in self.binding.unit_flats[unit])

    # backward
    def pack(self, tensor: Tensor) -> Any:
        owner = self.owner.get(id(tensor if tensor._base is None else tensor._base))
        if owner is None:
            return tensor
        call, unit, i = owner
        if tensor.dtype != gather_dtype(self.mp, self.layout.flats[i]):
            return tensor
        if unit in self.binding.whole_call:
            alias = call.aliases.get(i)
            return tensor if alias is None else SavedView(alias, tensor)
        return Handle(call, unit, i, tensor)

    def unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, SavedView):
            return packed.view_of(packed.alias)
        if not isinstance(packed, Handle):
            return packed
        call, unit = packed.call, packed.unit
        flat = self._regathered(call, unit)[self.binding.unit_flats[unit].index(packed.flat)]
        return packed.view_of(flat)

    def _regathered(self, call: _Call, unit: int) -> tuple[Tensor, ...]:
        """A unit's buffers in backward: regathered the first time backward asks, with the
        prefetch of the unit that ran before it."""
        if unit not in call.regathered:
            self._issue(call, unit)
            call.regathered[unit] = call.pending.pop(unit)
        if unit not in call.started:
            call.started.add(unit)
            nxt = self._next(call, unit) if self.prefetch else None
            if nxt is not None:
                self._issue(call, nxt)
        return call.regathered[unit]

    # activation checkpointing: see [Note: recomputation in the dry run]
    @contextlib.contextmanager
    def recomputing(
        self, model: nn.Module, modes: Callable[[], contextlib.AbstractContextManager]
    ) -> Iterator[None]:
        """During the block (backward), a module of `model` that runs again outside a call
        (a checkpointed region recomputed) gets its units' parameters back: regathered if
        they were resharded, as `funcshard.step._call_recomputation.Recomputation` does. The
        outermost recomputed module runs under `modes()`: autograd runs backward without the torch
        function modes the step's forward ran under."""
        under = _units_under(model, self.binding)
        mine = {id(m) for m in model.modules()}
        entered: list[tuple[nn.Module, list[int]]] = []
        held: set[int] = set()
        outer = contextlib.ExitStack()

        def before(module: nn.Module, args: Any) -> None:
            if self.current is not None or id(module) not in mine:
                return
            if not entered:
                outer.enter_context(modes())
            units = [u for u in under.get(id(module), ()) if u not in held]
            for unit in units:
                params = self._recompute_params(unit)
                for slot, index, _ in self.binding.param_slots[unit]:
                    set_slot(slot, params[index])
                held.add(unit)
            entered.append((module, units))

        def after(module: nn.Module, args: Any, output: Any) -> None:
            if entered and entered[-1][0] is module:
                for unit in entered.pop()[1]:
                    self._swap_out(unit)
                    held.discard(unit)
                if not entered:
                    outer.close()

        try:
            with recompute.around_every_module(before, after):
                yield
        finally:
            for _, units in entered:
                for unit in units:
                    self._swap_out(unit)
            outer.close()

    def _recompute_params(self, unit: int) -> tuple[Tensor, ...]:
        """Fresh leaves over the unit's buffers, requiring grad as forward's parameters did
        (so autograd saves the same tensors; the gradients flow through forward's graph)."""
        call = next((c for c in reversed(self.calls) if unit in c.order), None)
        if call is None:
            raise ValueError(
                f"funcshard.estimate: unit {self.binding.unit_names[unit]!r} is recomputed in "
                f"backward but did not run in forward. Checkpoint modules the step ran."
            )
        held = still_held(call.whole.get(unit, ()))
        fulls = call.full.get(unit) or held or self._regathered(call, unit)
        return tuple(
            view.detach().requires_grad_(self.shards[i].requires_grad)
            for i, full in zip(self.binding.unit_flats[unit], fulls, strict=True)
            for view in param_views(full, self.layout.flats[i])
        )

    def _next(self, call: _Call, unit: int) -> int | None:
        """The unit that ran before `unit` in forward, if backward still needs it."""
        if unit not in call.order or call.order.index(unit) == 0:
            return None
        earlier = call.order[call.order.index(unit) - 1]
        if earlier in self.binding.whole_call or earlier in call.finished:
            return None
        return None if earlier in call.regathered else earlier

    def reduce(
        self, call: _Call, unit: int, i: int, grads: tuple[Tensor | None, ...], counted: bool
    ) -> Tensor:
        """A gather node's backward: drop the regathered buffers (the unit's backward is
        done, if the node is `counted`), concatenate, cast, and reduce with one reduce in
        flight."""
        if counted and unit in call.unfinished:
            call.unfinished[unit] -= 1
            if call.unfinished[unit] == 0:
                call.finished.add(unit)
                call.regathered.pop(unit, None)
        flat = self.layout.flats[i]
        full = _concat(grads, flat, gather_dtype(self.mp, flat), reduce_dtype(self.mp, flat))
        grad = _prepared(full, flat, self.mp)
        if self.shard > 1:
            self.in_flight = None  # finishing the last reduce frees its input
            out = grad.new_empty(flat.shard_numel)
            self.in_flight = grad
            return out
        if self.replicate > 1:  # an all-reduce in place
            self.in_flight = grad
        return grad


class _DryGather(torch.autograd.Function):
    """A unit's parameters as views of its buffer; backward is `MetaStep.reduce`."""

    @staticmethod
    def forward(ctx: Any, shard: Tensor, where: tuple) -> tuple[Tensor, ...]:
        step, call, unit, i, full, counted = where
        ctx.where = (step, call, unit, i, counted)  # not the buffer: the graph must not keep it
        ctx.set_materialize_grads(False)
        return param_views(full, step.layout.flats[i])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, None]:
        step, call, unit, i, counted = ctx.where
        return step.reduce(call, unit, i, grads, counted), None


def _concat(
    grads: tuple[Tensor | None, ...], flat: FlatLayout, dtype: torch.dtype, reduce: torch.dtype
) -> Tensor:
    """One full (padded) flat gradient, as `funcshard.step._gather._concat` makes it: cast to the
    reduce dtype as it is concatenated."""
    like = next((g for g in grads if g is not None), None)
    dtype = like.dtype if like is not None else dtype
    pieces = [
        torch.zeros(n, dtype=dtype, device="meta") if g is None else g.reshape(-1)
        for g, n in zip(grads, flat.numels, strict=True)
    ]
    if flat.padded_numel > flat.numel:
        pieces.append(torch.zeros(flat.padded_numel - flat.numel, dtype=dtype, device="meta"))
    if dtype != reduce:
        out = torch.empty(flat.padded_numel, dtype=reduce, device="meta")
        return torch.cat(pieces, out=out)
    return torch.cat(pieces)


def _prepared(full: Tensor, flat: FlatLayout, mp: MixedPrecision | None) -> Tensor:
    grad = full.to(reduce_dtype(mp, flat))
    if flat.frozen_fqns:
        grad = grad.clone() if grad is full else grad
        for frozen in frozen_ranges(flat):
            grad[frozen] = 0
    return grad


def _units_under(model: nn.Module, binding: Binding) -> dict[int, list[int]]:
    """id of each module of `model` -> the units owning parameters at or under it."""
    owners: dict[int, set[int]] = {}
    for unit, slots in enumerate(binding.param_slots):
        for slot, _, _ in slots:
            owners.setdefault(id(slot.module), set()).add(unit)
    under: dict[int, list[int]] = {}
    for module in model.modules():
        units = set().union(*(owners.get(id(m), set()) for m in module.modules()))
        if units:
            under[id(module)] = sorted(units)
    return under


def _shape(binding: Binding, fqn: str) -> tuple[int, ...]:
    return tuple(_replicated_tensor(binding, fqn).shape)


def _dtype(binding: Binding, fqn: str) -> torch.dtype:
    return _replicated_tensor(binding, fqn).dtype


def _replicated_tensor(binding: Binding, fqn: str) -> Tensor:
    for slot, name in binding.replicated_slots:
        if name == fqn:
            param = slot.module._parameters[slot.attr]
            assert param is not None  # bound from named_parameters, which skips None
            return param
    raise ValueError(f"funcshard.estimate: no module holds the ignored parameter {fqn!r}.")
