"""Gathering each unit of a sharded call just before its module runs: the module hooks, and
the run that swaps a unit's parameters into its slots and out again.

[Note: per-unit gathering]
`call(model, state, ...)` installs a forward pre-hook and post-hook on every unit's module for
the duration of the call. The pre-hook gathers the unit through `funcshard.step._gather.gather` (the
differentiable gather, see [Note: one differentiable gather]; its all-gathers were usually
issued earlier, as a prefetch), swaps the parameters into the module's slots, and issues the
next unit's all-gathers so they overlap this unit's compute (the first unit's are issued when
the call starts, right after the whole-call units'). The post-hook swaps meta
placeholders back in and drops the gathered buffers. The root unit, and any unit whose
parameters are also used from outside its own module (a tied weight across units), stay
gathered for the whole call. Outside its unit's forward a parameter slot holds a
placeholder that refuses to compute (see [Note: placeholders that refuse to compute] in
funcshard/core/_ungathered.py); methods the plan names gather the unit as forward does
(see [Note: units called through other methods] in funcshard/core/_unit_methods.py). A unit
of several modules has the hooks on each member: gathered when the first starts, released
once each has run (see [Note: units of several modules] in funcshard/core/_unit_groups.py).
A unit with a policy of its own (`plan(mp=...)`) casts its inputs to its compute dtype and,
with an `output_dtype`, its outputs, in these hooks: eagerly only, as the per-unit input
cast (a compiled step casts the model's inputs and outputs, by the root unit's policy).

Differentiation is autograd's own: each gather is an autograd node whose backward reduces, so
the call is a differentiable function of `state.shards`. Autograd runs ready nodes newest
first, so a unit's gather node, created at its module's forward, runs (and starts its
reduce-scatter) right after the unit's backward. A whole-call unit is gathered before any
compute, so its node would run at the end of backward; when the first module owning one of
its slots starts, the unit gets a second gather node over the same buffers (`Run.relink`),
whose reduce starts once backward is past that module, as DDP's buckets do. (Slots read
before that, e.g. by a parent module, keep the first node; both reduces add up.)

Resharding after forward regathers in backward through saved-tensor hooks (see [Note:
resharding after forward] in funcshard/step/_regather.py). torch.func refuses such hooks, so under
its transforms units stay gathered from their forward through backward (a one-time warning
says so), and their gathers are not prefetched.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from funcshard.comm import _chaos as chaos
from funcshard.comm import _collectives as collectives
from funcshard.comm._comm import Comm
from funcshard.core import _precision as precision
from funcshard.core import _recompute as recompute
from funcshard.core._binding import Binding
from funcshard.core._layout import param_views
from funcshard.core._state import ShardedState
from funcshard.step import _gather as gather
from funcshard.step._autograd_apply import has_tangent
from funcshard.step._deferred_reduce import wait_nodes
from funcshard.step._gather_spec import Differentiated
from funcshard.step._regather import Regather
from funcshard.step._unit_gathers import UnitGathers


class Run(UnitGathers):
    """One sharded call's per-unit schedule: a unit's parameters gathered into its module's
    slots when it starts and released when it returns, and their gather nodes."""

    def __init__(self, binding: Binding, state: ShardedState, comm: Comm | None = None):
        super().__init__(binding, state, comm)
        layout = self.layout
        grad = torch.is_grad_enabled()
        self.differentiable = tuple(
            grad and not flat.frozen and (s.requires_grad or sink is not None)
            for s, sink, flat in zip(state.shards, self.sinks, layout.flats, strict=True)
        )
        # shards with a forward-mode tangent: see [Note: forward mode through the gather]
        self.tangent = tuple(has_tangent(s) for s in state.shards)
        # the wait nodes come first, before any compute: see [Note: one differentiable gather]
        asynchronous = tuple(  # (a user's reduce runs synchronously; a tangent: no wait node)
            d
            and not t
            and spec.reduction != "none"  # (a buffer kept local: see [Note: units kept local])
            and not self.functorch
            and s.requires_grad
            and not spec.user_reduce
            and s.device == spec.device  # an offloaded shard's gradient goes to the host at once
            for d, s, spec, t in zip(
                self.differentiable, state.shards, self.specs, self.tangent, strict=True
            )
        )
        self.deferred = wait_nodes(state.shards, self.specs, asynchronous)
        relinked = tuple(  # a second wait node for the second gather of `relink`
            a and flat.unit in binding.relinked_units
            for a, flat in zip(asynchronous, layout.flats, strict=True)
        )
        self.relink_deferred = wait_nodes(state.shards, self.specs, relinked)
        n_units = len(binding.unit_names)
        self.params: list[tuple[Tensor, ...] | None] = [None] * n_units
        self.with_grad = [False] * n_units  # the grad mode `params` were made under
        self.relinked: set[int] = set()  # whole-call units given their later gather node
        # nothing to free on a size-1 shard axis, where the "gathered" buffers are the shards
        # themselves (unless mixed precision, the state's or a unit's, or offload made them
        # copies)
        alone = collectives.alone(layout.mesh.shard_group)
        copies = (
            not alone
            or state.mp is not None
            or state.offload
            or any([flat.mp is not None for flat in layout.flats])
        )
        reshard = state.reshard_after_forward is not False and copies
        if reshard and self.functorch and any(self.differentiable):
            _warn_kept_gathered()
        self.reshard = reshard and not self.functorch
        # see [Note: resharding after forward]
        regather = Regather(self) if self.reshard and any(self.differentiable) else None
        self._regather: Regather | weakref.ref[Regather] | None = regather  # weak after the call

    def gathered(self, unit: int) -> tuple[Tensor, ...]:
        """A unit's parameters, waiting for its all-gathers (issuing them if needed). Made
        again over the same buffers when grad mode changed since (a module of the unit run
        under no_grad inside a differentiated call)."""
        grad = torch.is_grad_enabled()
        made = self.params[unit]
        if made is not None and self.with_grad[unit] == grad:
            return made
        flats = self.binding.unit_flats[unit]
        fulls = self.full[unit]
        sources: tuple[collectives.Pending | None, ...]
        if fulls is not None and all(f is not None for f in fulls):
            sources = tuple(collectives.Pending(cast(Tensor, f), done=True) for f in fulls)
        else:
            self.issue(unit)
            sources = self.pending.pop(unit, (None,) * len(flats))
        params: list[Tensor] = []
        new_fulls = []
        tracker = self.regather if grad else None  # tracks frozen buffers too: autograd saves them
        for i, source in zip(flats, sources, strict=True):
            differentiable = self.differentiable[i] and grad
            on_backward = None
            if tracker is not None and differentiable:
                on_backward = tracker.on_backward(unit)
            views = self._gather(i, source, differentiable, on_backward)
            full = gather.gathered_buffer(views)
            if tracker is not None:
                tracker.track(unit, i, full, gather_node=differentiable)
            params.extend(views)
            new_fulls.append(full)
        self.full[unit] = tuple(new_fulls)
        made = self.params[unit] = tuple(params)
        self.with_grad[unit] = grad
        return made

    def _gather(
        self,
        i: int,
        source: collectives.Pending | None,
        differentiable: bool,
        on_backward: Callable[[], None] | None,
    ) -> tuple[Tensor, ...]:
        spec = self.specs[i]
        if self.tangent[i] and not differentiable:
            return gather.gather(self.state.shards[i], spec, source)
        if differentiable:
            shard = self.state.shards[i]
            return gather.gather(shard, spec, source, self.sinks[i], self.deferred[i], on_backward)
        if source is None:
            source = gather.issue_gather(self.state.shards[i], spec)
        return param_views(source.wait(), spec.flat)

    def enter(self, unit: int) -> None:
        """A unit's module is about to run: put its parameters in place, prefetch the next."""
        if not torch.is_grad_enabled() and isinstance(self.state, Differentiated):
            name = self.binding.unit_names[unit]  # a rare path: the check walks the stack
            recompute.refuse_reentrant_checkpoint("call", f"around unit {name!r} inside a call")
        if self.regather is not None:  # (first: the unit before is released before this
            self.regather.entered(unit)  # one is gathered, if it was not prefetched)
        params = self.gathered(unit)
        self.order.append(unit)
        nxt = self.forward_next.get(unit) if self.prefetch else None
        if nxt is not None:
            self.issue(nxt)
        self._swap_in(unit, params)

    def relink(self, unit: int) -> None:
        """The first module owning a slot of a whole-call unit is about to run: give the unit
        a fresh gather node over the buffers it already has, so that its reduce starts
        once backward is past that module, not at the end (autograd runs the nodes created
        first last). Slots read before, e.g. by a parent module, keep the first node, which
        reduces their part at the end; the two reduces add up."""
        flats = self.binding.unit_flats[unit]
        if unit in self.relinked or not any(self.relink_deferred[i] for i in flats):
            return  # nothing reduces asynchronously (second order, torch.func): no overlap
        if not torch.is_grad_enabled() or not self.with_grad[unit]:
            return  # a module run under no_grad: the next one with grad relinks
        self.relinked.add(unit)
        old = iter(self.params[unit] or ())
        params: list[Tensor] = []
        for i, full in zip(flats, self.full[unit] or (), strict=True):
            views: Sequence[Tensor] = [next(old) for _ in self.specs[i].flat.fqns]
            deferred = self.relink_deferred[i]
            if deferred is not None:
                assert full is not None  # None only under torch.func, which defers nothing
                source = collectives.Pending(full, done=True)
                shard, spec, sink = self.state.shards[i], self.specs[i], self.sinks[i]
                views = gather.gather(shard, spec, source, sink, deferred)
            params.extend(views)
        self.params[unit] = tuple(params)
        self._swap_in(unit, params)

    def differentiates(self, unit: int) -> bool:
        differentiable = self.differentiable
        return any([differentiable[i] for i in self.binding.unit_flats[unit]])

    def leave(self, unit: int) -> None:
        """A unit's module has run: release its parameters until backward needs them."""
        if unit in self.binding.whole_call:
            return
        self._swap_out(unit)
        if self.differentiates(unit) and not self.reshard:
            return  # kept gathered through backward (autograd holds its views anyway)
        if self.regather is not None:
            self.regather.release(unit, self.full[unit] or ())
        self.full[unit] = None
        self.params[unit] = None

    def _swap_in(self, unit: int, params: Sequence[Tensor]) -> None:
        """Put a unit's parameters in its slots (`set_slot` inlined: it runs per slot, two
        dozen times per GPT block and call)."""
        for slot, index, _ in self.binding.param_slots[unit]:
            # (a plain tensor in a parameter slot, as torch.func.functional_call puts; torch's
            # stubs type the slots as Parameters)
            slot.module._parameters[slot.attr] = params[index]  # type: ignore[assignment]

    def _swap_out(self, unit: int) -> None:
        """Put placeholders in a unit's slots: a use outside its forward raises."""
        for module, placeholders in self.binding.unit_placeholders[unit]:
            module._parameters.update(placeholders)  # type: ignore[arg-type]  # (as `_swap_in`)

    def recompute_params(self, unit: int) -> tuple[Tensor, ...]:
        """A unit's parameters for a recomputation in backward, regathered if the unit was
        resharded: fresh leaves (the gradients flow through the first forward's graph) that
        require grad as the first forward's did, so autograd saves the same tensors."""
        params = self.params[unit]
        flats = self.binding.unit_flats[unit]
        if params is None and self.regather is not None:
            fulls = self.regather.gathered(unit)
            params = tuple(
                param
                for i, full in zip(flats, fulls, strict=True)
                for param in param_views(full, self.layout.flats[i])
            )
        elif params is None:  # a unit without gradients (all frozen), released after forward
            params = tuple(p for i in flats for p in self._gather(i, None, False, None))
        # per flat buffer, not per unit: the frozen members of a frozen="split" unit did not
        # require grad in the first forward, so autograd saved other tensors around them
        requires = [self.differentiable[i] for i in flats for _ in self.layout.flats[i].fqns]
        return tuple(p.detach().requires_grad_(r) for p, r in zip(params, requires, strict=True))

    @property
    def regather(self) -> Regather | None:
        """The resharding bookkeeping (see [Note: resharding after forward]). After the call
        only autograd's saved-tensor hooks hold it (and it holds the run): a strong reference
        back would be a cycle that keeps a finished step's buffers until the next gc pass."""
        regather = self._regather
        return regather() if isinstance(regather, weakref.ref) else regather

    def after_call(self) -> None:
        """Keep only what backward needs: every gathered unit when not resharding (autograd
        holds their views anyway), nothing when resharding or without grad. A whole-call
        unit is then held by what autograd saved of it alone, and freed with the last of it
        (see [Note: whole-call units in backward])."""
        keep = [self.differentiates(u) and not self.reshard for u in range(len(self.full))]
        self.full = [f if k else None for f, k in zip(self.full, keep, strict=True)]
        self.params = [p if k else None for p, k in zip(self.params, keep, strict=True)]
        if isinstance(self._regather, Regather):
            self._regather.forward_done()
            self._regather = weakref.ref(self._regather)


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


def install_hooks(binding: Binding, run: Run) -> list[Any]:
    # funcshard's pre-hooks run first (prepended; the relinks' before the units'): a user's
    # own pre-hook on a unit's module (torch's weight_norm computes the weight in one) reads
    # the gathered parameters, not placeholders
    handles = []
    entries = _Entries(run, binding)
    for unit, members in enumerate(binding.unit_members):
        if unit in binding.whole_call:
            continue
        for module in members:  # one, or a group's (see [Note: units of several modules])
            if entries.casts[unit]:
                pre = module.register_forward_pre_hook(
                    _casting_pre_hook(entries, unit), with_kwargs=True, prepend=True
                )
            else:
                pre = module.register_forward_pre_hook(_pre_hook(entries, unit), prepend=True)
            post = _casting_post_hook if entries.policies[unit] is not None else _post_hook
            handles += [pre, module.register_forward_hook(post(entries, unit), always_call=True)]
    handles += [
        module.register_forward_pre_hook(_relink_hook(run, units), prepend=True)
        for module, units in binding.relinks
    ]
    if run.layout.unit_methods:
        handles.extend(_wrap_methods(binding, run, entries))
    return handles


class _Entries:
    """Enters and leaves units for the hooks and the wrapped methods of one call, counting
    how deep each is entered, so a method that calls forward (or forward that calls it)
    gathers its unit once. A unit of several modules is entered when the first of them
    starts and left once each has run and none is running (FSDP2's group hooks), so it is
    gathered once for all of them (see [Note: units of several modules])."""

    def __init__(self, run: Run, binding: Binding) -> None:
        self.run, mp = run, run.state.mp
        n_units = len(binding.unit_names)
        self.depth = [0] * n_units  # member forwards (or methods) running now
        self.entered = [False] * n_units
        self.groups = [
            frozenset(map(id, members)) if len(members) > 1 else None
            for members in binding.unit_members
        ]
        self.to_run: list[set[int] | None] = [None] * n_units  # a group's members not yet
        # run since it was entered
        # whose inputs are cast as they run, and to what (see `precision.casts_unit_inputs`)
        flats = run.layout.flats
        self.mp = [
            precision.unit_policy(mp, flats[unit_flats[0]]) if unit_flats else mp
            for unit_flats in binding.unit_flats
        ]
        self.casts = [
            precision.casts_unit_inputs(mp, flats[unit_flats[0]]) if unit_flats else False
            for unit_flats in binding.unit_flats
        ]
        # a unit's own policy with an output dtype: its outputs are cast as it returns
        self.policies = [
            self.mp[unit]
            if unit_flats and precision.casts_unit_outputs(mp, flats[unit_flats[0]])
            else None
            for unit, unit_flats in enumerate(binding.unit_flats)
        ]

    def enter(self, unit: int) -> bool:
        """Enter `unit` unless it is already entered; whether this entered it."""
        self.depth[unit] += 1
        if self.entered[unit]:
            return False
        self.entered[unit] = True
        group = self.groups[unit]
        if group is not None:
            self.to_run[unit] = set(group)
        chaos.point()
        self.run.enter(unit)
        return True

    def leave(self, unit: int, module: nn.Module | None = None) -> None:
        """`module` (of `unit`) has run: leave the unit if nothing of it runs or is to run."""
        self.depth[unit] -= 1
        to_run = self.to_run[unit]
        if to_run is not None:
            to_run.discard(id(module))
            if to_run:
                return
        if self.depth[unit] == 0:
            self.entered[unit] = False
            self.to_run[unit] = None
            chaos.point()
            self.run.leave(unit)


def _wrap_methods(binding: Binding, run: Run, entries: _Entries) -> list[Any]:
    """Wrap the plan's other methods of each unit's module, for this call, so that calling
    one gathers the unit (see [Note: units called through other methods] in
    funcshard/core/_unit_methods.py)."""
    index = {name: unit for unit, name in enumerate(binding.unit_names)}
    handles = []
    for name, methods in run.layout.unit_methods:
        unit = index[name]
        module = binding.unit_modules[unit]
        if unit in binding.whole_call or module is None:
            continue
        for method in methods:
            handles.append(_Wrapped(module, method, _gathering(entries, unit, module, method)))
    return handles


def _gathering(entries: _Entries, unit: int, module: nn.Module, method: str) -> Callable[..., Any]:
    original = getattr(module, method)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            if entries.enter(unit) and entries.casts[unit]:
                args, kwargs = precision.cast_inputs(entries.mp[unit], args, kwargs)
            return precision.cast_outputs(entries.policies[unit], original(*args, **kwargs))
        finally:
            entries.leave(unit, module)

    return wrapped


class _Wrapped:
    """A method of one module instance replaced for one call; `remove()` puts it back."""

    def __init__(self, module: nn.Module, method: str, wrapper: Callable[..., Any]) -> None:
        self.module, self.method = module, method
        self.own = module.__dict__.get(method, _NONE)  # an instance attribute it shadows
        module.__dict__[method] = wrapper

    def remove(self) -> None:
        if self.own is _NONE:
            self.module.__dict__.pop(self.method, None)
        else:
            self.module.__dict__[self.method] = self.own


_NONE = object()


def _relink_hook(run: Run, units: tuple[int, ...]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        chaos.point()
        for unit in units:
            run.relink(unit)

    return hook


def _pre_hook(entries: _Entries, unit: int) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        entries.enter(unit)

    return hook


def _casting_pre_hook(entries: _Entries, unit: int) -> Callable[..., tuple[tuple, dict] | None]:
    """`_pre_hook` that also casts the unit's floating-point inputs to its policy's
    `param_dtype` (as FSDP2 casts each module's: a unit after an fp32 buffer's add, or after
    a keep_fp32 unit, gets its compute dtype's inputs). Each member of a group casts its own:
    a later member may take inputs from outside the group."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not entries.enter(unit) and entries.groups[unit] is None:
            return None  # (a module unit entered already: a method of it called forward)
        return precision.cast_inputs(entries.mp[unit], args, kwargs)

    return hook


def _post_hook(entries: _Entries, unit: int) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        entries.leave(unit, module)

    return hook


def _casting_post_hook(entries: _Entries, unit: int) -> Callable[..., Any]:
    """`_post_hook` that also casts the unit's floating-point outputs to its own policy's
    `output_dtype` (FSDP2's per-module `output_dtype`)."""
    policy = entries.policies[unit]

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        entries.leave(unit, module)
        return precision.cast_outputs(policy, output)

    return hook
