"""Run a model on a sharded state, gathering each unit just before it runs.

[Note: per-unit gathering]
`call(model, state, ...)` installs a forward pre-hook and post-hook on every unit's module for
the duration of the call. The pre-hook gathers the unit through `funcshard.gather.gather` (the
differentiable gather, see [Note: one differentiable gather]; its all-gathers were usually
issued earlier, as a prefetch), swaps the parameters into the module's slots, and issues the
next unit's all-gathers so they overlap this unit's compute (the first unit's are issued when
the call starts, right after the whole-call units'). The post-hook swaps meta
placeholders back in and drops the gathered buffers. The root unit, and any unit whose
parameters are also used from outside its own module (a tied weight across units), stay
gathered for the whole call. Outside its unit's forward a parameter slot holds a meta
placeholder, so code that touches it there fails loudly instead of reading stale values.

Differentiation is autograd's own: each gather is an autograd node whose backward reduces, so
the call is a differentiable function of `state.shards`. Autograd runs ready nodes newest
first, so a unit's gather node, created at its module's forward, runs (and starts its
reduce-scatter) right after the unit's backward. A whole-call unit is gathered before any
compute, so its node would run at the end of backward; when the first module owning one of
its slots starts, the unit gets a second gather node over the same buffers (`_Run.relink`),
whose reduce starts once backward is past that module, as DDP's buckets do. (Slots read
before that, e.g. by a parent module, keep the first node; both reduces add up.)

Resharding after forward regathers in backward through saved-tensor hooks (see [Note:
resharding after forward] in funcshard/regather.py). torch.func refuses such hooks, so under
its transforms units stay gathered from their forward through backward (a one-time warning
says so), and their gathers are not prefetched.

[Note: generate across ranks]
A sharded call's forward communicates (every unit is all-gathered over the shard axis), so
every rank must run the same number of forwards. A generation loop (transformers'
`generate`) runs one forward per new token and stops when its own sequences are done, and
ranks with other prompts finish at other steps: the first to finish returns, and the
others' next all-gathers meet whatever it issues next (gloo aborts on mismatched shapes)
or nothing (a hang). transformers' answer for FSDP and ZeRO-3 is `synced_gpus=True`: before
each step every rank all-reduces "am I done" over the default process group, and a
finished rank keeps running forwards (outputs discarded) until all are done. transformers
turns it on by itself only for modules FSDP manages; `call` does so for funcshard: when
the state's shard axis has more than one rank and the method takes a `synced_gpus`
argument the caller did not pass, it is passed True. Its all-reduce goes to the default
group, which a `Mesh(...)` spans (its sizes multiply to the world size; a mesh from a
DeviceMesh over part of the world needs every rank of the world to generate); every rank
issues it at the same point of the same loop, so it interleaves with funcshard's gathers
in one order on every rank. A DDP state (shard axis of one rank) gathers nothing and is
left alone; `synced_gpus=False` turns it off.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from funcshard import chaos, collectives, compiled, gather, inplace, recompute, waits
from funcshard.binding import (
    Binding,
    Slot,
    bind,
    get_slot,
    restore_slots,
    restore_snapshot,
    set_slot,
    snapshot_slots,
)
from funcshard.comm import Comm
from funcshard.layout import param_views
from funcshard.module import call as call_on_dict
from funcshard.precision import cast_inputs, cast_outputs
from funcshard.regather import Regather
from funcshard.state import ShardedState, ensure_live


@dataclass(frozen=True)
class Prefetch:
    """Explicit prefetch orders, by unit name ("" is the root).

    When a unit starts in forward, the unit after it in `forward` has its all-gather issued;
    when a unit is regathered in backward, the unit after it in `backward` is. `None` keeps
    the default for that direction: plan order in forward, reverse run order in backward.
    """

    forward: tuple[str, ...] | None = None
    backward: tuple[str, ...] | None = None


class _Run:
    """The life of one sharded call: what is gathered, in flight, and in what order units ran."""

    def __init__(self, binding: Binding, state: ShardedState, comm: Comm | None = None):
        self.binding = binding
        self.state = state
        layout = self.layout = state.layout
        self.specs, self.sinks = gather.specs_and_sinks(state, comm)
        reduction = self.specs[0].reduction if self.specs else "mean"
        if reduction == "none" and any(s.grad_fn is not None for s in state.shards):
            raise ValueError(
                "funcshard.value_and_grad(reduce=False): the function calls the model on "
                "shards it computed (state.replace(shards=...)); local gradients are taken "
                "with respect to the gathered parameters, so the shards' own transformation "
                "would be lost. Use reduce=True, which differentiates through it."
            )
        grad = torch.is_grad_enabled()
        # torch.func's transforms refuse saved-tensor hooks and wrap the shards they see
        self.functorch = any(_is_functorch(s) for s in state.shards)
        self.differentiable = tuple(
            grad and not flat.frozen and (s.requires_grad or sink is not None)
            for s, sink, flat in zip(state.shards, self.sinks, layout.flats, strict=True)
        )
        # the wait nodes come first, before any compute: see [Note: one differentiable gather]
        asynchronous = tuple(  # (a user's reduce runs synchronously)
            d
            and reduction != "none"
            and not self.functorch
            and s.requires_grad
            and not spec.user_reduce
            and s.device == spec.device  # an offloaded shard's gradient goes to the host at once
            for d, s, spec in zip(self.differentiable, state.shards, self.specs, strict=True)
        )
        self.deferred = gather.wait_nodes(state.shards, self.specs, asynchronous)
        relinked = tuple(  # a second wait node for the second gather of `relink`
            a and flat.unit in binding.relinked_units
            for a, flat in zip(asynchronous, layout.flats, strict=True)
        )
        self.relink_deferred = gather.wait_nodes(state.shards, self.specs, relinked)
        n_units = len(binding.unit_names)
        self.full: list[tuple[Tensor | None, ...] | None] = [None] * n_units
        kept = getattr(state, "gathered", ())  # a GatheredState's: see [Note: keeping units
        if kept:  # gathered]; its gathers take these as their finished all-gathers
            self.full = [tuple(kept[i] for i in flats) for flats in binding.unit_flats]
        self.params: list[tuple[Tensor, ...] | None] = [None] * n_units
        self.with_grad = [False] * n_units  # the grad mode `params` were made under
        self.pending: dict[int, tuple[collectives.Pending, ...]] = {}
        self.order: list[int] = []
        self.relinked: set[int] = set()  # whole-call units given their later gather node
        # nothing to free on a size-1 shard axis, where the "gathered" buffers are the shards
        # themselves (unless mixed precision or offload made them copies)
        alone = collectives.alone(layout.mesh.shard_group)
        copies = not alone or state.mp is not None or state.offload
        reshard = state.reshard_after_forward is not False and copies
        if reshard and self.functorch and any(self.differentiable):
            _warn_kept_gathered()
        self.reshard = reshard and not self.functorch
        # see [Note: resharding after forward]
        regather = Regather(self) if self.reshard and any(self.differentiable) else None
        self._regather: Regather | weakref.ref[Regather] | None = regather  # weak after the call
        prefetch = state.prefetch if isinstance(state, gather.Differentiated) else True
        self.prefetch = prefetch is not False and not self.functorch
        explicit = prefetch if isinstance(prefetch, Prefetch) else Prefetch()
        forward = self._units_named(explicit.forward) if explicit.forward is not None else None
        forward = forward or self._sharded_units()
        self.forward_next = _successors(forward)
        self.first_forward = forward[0] if forward else None
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
        shards, specs = self.state.shards, self.specs
        self.pending[unit] = tuple(
            [gather.issue_gather(shards[i], specs[i]) for i in self.binding.unit_flats[unit]]
        )

    def start(self) -> None:
        """Issue the all-gathers a call begins with: the whole-call units', then (as a
        prefetch) the first unit's in forward order, so that it overlaps the wait for the
        whole-call units and the compute before the first unit."""
        for unit in range(len(self.binding.unit_names)):
            if unit in self.binding.whole_call:
                self.issue(unit)
        if self.prefetch and self.first_forward is not None:
            self.issue(self.first_forward)

    def gathered(self, unit: int) -> tuple[Tensor, ...]:
        """A unit's parameters, waiting for its all-gathers (issuing them if needed). Made
        again over the same buffers when grad mode changed since (a module of the unit run
        under no_grad inside a differentiated call)."""
        grad = torch.is_grad_enabled()
        if self.params[unit] is not None and self.with_grad[unit] == grad:
            return self.params[unit]
        flats = self.binding.unit_flats[unit]
        fulls = self.full[unit]
        if fulls is not None and all(f is not None for f in fulls):
            sources = tuple(collectives.Pending(f, done=True) for f in fulls)
        else:
            self.issue(unit)
            sources = self.pending.pop(unit, (None,) * len(flats))
        params: list[Tensor] = []
        new_fulls = []
        regather = self.regather
        tracked = regather is not None and grad  # frozen buffers too: autograd saves them
        for i, source in zip(flats, sources, strict=True):
            differentiable = self.differentiable[i] and grad
            on_backward = regather.on_backward(unit) if tracked and differentiable else None
            views = self._gather(i, source, differentiable, on_backward)
            full = gather.gathered_buffer(views)
            if tracked:
                regather.track(unit, i, full, gather_node=differentiable)
            params.extend(views)
            new_fulls.append(full)
        self.full[unit] = tuple(new_fulls)
        self.params[unit] = tuple(params)
        self.with_grad[unit] = grad
        return self.params[unit]

    def _gather(
        self,
        i: int,
        source: collectives.Pending | None,
        differentiable: bool,
        on_backward: Callable[[], None] | None,
    ) -> tuple[Tensor, ...]:
        spec = self.specs[i]
        if differentiable:
            shard = self.state.shards[i]
            return gather.gather(shard, spec, source, self.sinks[i], self.deferred[i], on_backward)
        if source is None:
            source = gather.issue_gather(self.state.shards[i], spec)
        return param_views(source.wait(), spec.flat)

    def enter(self, unit: int) -> None:
        """A unit's module is about to run: put its parameters in place, prefetch the next."""
        if not torch.is_grad_enabled() and isinstance(self.state, gather.Differentiated):
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
        old, params = iter(self.params[unit] or ()), []
        for i, full in zip(flats, self.full[unit] or (), strict=True):
            views = [next(old) for _ in self.specs[i].flat.fqns]
            deferred = self.relink_deferred[i]
            if deferred is not None:
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
            slot.module._parameters[slot.attr] = params[index]

    def _swap_out(self, unit: int) -> None:
        """Put meta placeholders in a unit's slots: a use outside its forward fails loudly."""
        for module, placeholders in self.binding.unit_placeholders[unit]:
            module._parameters.update(placeholders)

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

    def drain(self) -> None:
        """Wait for gathers nobody used (a prefetch past the last unit): every rank issued them."""
        for pending in self.pending.values():
            for p in pending:
                p.wait()
        self.pending.clear()

    @property
    def regather(self) -> Regather | None:
        """The resharding bookkeeping (see [Note: resharding after forward]). After the call
        only autograd's saved-tensor hooks hold it (and it holds the run): a strong reference
        back would be a cycle that keeps a finished step's buffers until the next gc pass."""
        regather = self._regather
        return regather() if isinstance(regather, weakref.ref) else regather

    def after_call(self) -> None:
        """Keep only what backward needs: the whole-call units when resharding, every
        gathered unit when not (autograd holds their views anyway), nothing without grad."""
        keep = [
            self.differentiates(u) and (not self.reshard or u in self.binding.whole_call)
            for u in range(len(self.full))
        ]
        self.full = [f if k else None for f, k in zip(self.full, keep, strict=True)]
        self.params = [p if k else None for p, k in zip(self.params, keep, strict=True)]
        if isinstance(self._regather, Regather):
            self._regather.forward_done()
            self._regather = weakref.ref(self._regather)


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
        # a recomputed unit may be regathered even if autograd saved none of its tensors
        # (checkpointed regions save through torch's hooks, not the run's)
        self.regather = run.regather
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
            self.saved_others = [(slot, get_slot(slot)) for slot in others]
            for slot, fqn in binding.replicated_slots:
                set_slot(slot, run.state.replicated[fqn])
            for slot, fqn in binding.buffer_slots:
                set_slot(slot, self.buffers[fqn].detach().clone())
        self.depth += 1
        for unit in units:
            self.holds[unit] = self.holds.get(unit, 0) + 1
        for unit, params in fresh.items():
            slots = binding.param_slots[unit]
            self.saved[unit] = [(slot, get_slot(slot)) for slot, _, _ in slots]
            for slot, index, _ in slots:
                set_slot(slot, params[index])
        return units

    def exit(self, token: object) -> None:
        for unit in token:  # type: ignore[attr-defined]
            self.holds[unit] -= 1
            if self.holds[unit] == 0:
                del self.holds[unit]
                restore_slots(self.saved.pop(unit))
        self.depth -= 1
        if self.depth == 0:
            restore_slots(self.saved_others)
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
    comm: Comm | None = None,
    **kwargs: Any,
) -> Any:
    """Run `model.<method>(*args, **kwargs)` on a params dict or a sharded state.

    On a ShardedState each unit is all-gathered just before its module runs and released
    after it (see [Note: per-unit gathering]); the state's buffers are used (cloned, so the
    state is never written) and `mutable=True` returns `(out, new_buffers)`. `comm` (a
    `funcshard.Comm`) replaces the all-gather and the backward's reduce-scatter with the
    user's functions (see [Note: communication as user functions]); without it, the one
    `value_and_grad(comm=...)` was given, if any. A params dict ignores it. A method that
    takes `synced_gpus` (transformers' `generate`) is passed `synced_gpus=True` on a sharded
    state unless the caller passes it, so that ranks whose generation stops at other steps
    keep running forwards together (see [Note: generate across ranks]).
    Communicates (sharded): one all-gather per unit and flat buffer over the shard axis.
    """
    if not isinstance(params, ShardedState):
        return call_on_dict(
            model, params, *args, buffers=buffers, mutable=mutable, method=method, **kwargs
        )
    state = params
    if torch.compiler.is_dynamo_compiling():
        return compiled.call(model, state, args, kwargs, buffers, mutable, method, comm)
    if _needs_sync(model, state, method, kwargs):  # see [Note: generate across ranks]
        kwargs = {**kwargs, "synced_gpus": True}
    start = collectives.count_issued()
    try:
        return _eager_call(
            model, state, *args, buffers=buffers, mutable=mutable, method=method, comm=comm,
            **kwargs,
        )
    except BaseException as error:  # see [Note: a rank out of step] in collectives.py
        waits.left_step("funcshard.call", error, start, state.layout.mesh.ranks)
        raise


def _needs_sync(
    model: nn.Module, state: ShardedState, method: str, kwargs: Mapping[str, Any]
) -> bool:
    """Whether `method` is a generation loop to keep in step across the shard axis."""
    if method == "forward" or "synced_gpus" in kwargs or state.layout.mesh.shard_size == 1:
        return False
    target = getattr(model, method, None)
    try:
        return callable(target) and "synced_gpus" in inspect.signature(target).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return False


def _eager_call(
    model: nn.Module,
    state: ShardedState,
    *args: Any,
    buffers: Mapping[str, Tensor] | None,
    mutable: bool,
    method: str,
    comm: Comm | None,
    **kwargs: Any,
) -> Any:
    """`call` on a sharded state, eagerly (see [Note: per-unit gathering])."""
    ensure_live(state, "call")
    binding = bind(model, state.layout)
    if isinstance(state, gather.Differentiated) and not torch.is_grad_enabled():
        recompute.refuse_reentrant_checkpoint("call")
    run = _Run(binding, state, comm)
    new_buffers = {
        k: v.clone() for k, v in (buffers if buffers is not None else state.buffers).items()
    }
    args, kwargs = cast_inputs(state.mp, args, kwargs)
    originals = snapshot_slots(binding)
    hooks = _install_hooks(binding, run)
    try:
        for slot, fqn in binding.replicated_slots:
            set_slot(slot, state.replicated[fqn])
        for slot, fqn in binding.buffer_slots:
            set_slot(slot, new_buffers[fqn])
        run.start()
        for unit in range(len(binding.unit_names)):
            if unit in binding.whole_call:
                run.enter(unit)
            else:
                run._swap_out(unit)
        saved = run.regather.hooks() if run.regather is not None else contextlib.nullcontext()
        recomputation = _Recomputation(run)
        with saved, recompute.calling(binding.module_ids, recomputation):
            target = model if method == "forward" else getattr(model, method)
            try:
                out = target(*args, **kwargs)
            except RuntimeError as e:  # see [Note: in-place writes to gathered parameters]
                refusal = inplace.refusal(e, model, binding)
                if refusal is None:
                    raise
                raise refusal from None
        new_buffers = {fqn: get_slot(slot) for slot, fqn in binding.buffer_slots}
        recomputation.buffers = new_buffers
    finally:
        for handle in hooks:
            handle.remove()
        restore_snapshot(originals)
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
        chaos.point()
        for unit in units:
            run.relink(unit)

    return hook


def _pre_hook(run: _Run, unit: int) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        chaos.point()
        run.enter(unit)

    return hook


def _post_hook(run: _Run, unit: int) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        chaos.point()
        run.leave(unit)

    return hook
