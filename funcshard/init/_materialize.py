"""Initialize a meta-device model straight into local shards, one unit at a time.

[Note: initializing from the meta device]
The rule: modules are initialized in registration order by their own `reset_parameters()`
(then `reset_buffers()`, if they define one, for buffers such as rotary frequencies), all
under one seed shared by every rank, and each parameter only by the first module that holds
it. A model that initializes itself otherwise passes `shard(..., init=fn)`: `fn(module)` is
then called as `model.apply(fn)` calls it, children first, and may write its descendants'
tensors (a transformers model's `_init_weights`; see [Note: init functions applied like
nn.Module.apply] in funcshard/init/_apply_init.py). Every rank replays the whole sequence and
keeps only its slice, so the values do not depend on the world size. They equal a model built
on the CPU after `torch.manual_seed(seed)` whenever construction initialized modules in that
same order, as models made of torch's layers do (the GPT here). A parent that calls its own
`reset_parameters()` after building its children initializes in a different order from
construction, so its values differ from the CPU build's (they are still the same on every
rank and world size).

A later holder of a tied parameter (a GPT head tied to its embedding) still runs its
`reset_parameters()`, on a scratch tensor that is then dropped, so the random stream advances
exactly as it did when the model was constructed, and the embedding keeps its values.

Two other forms, each a small record passed as `init=`:
- `whole_model(fn, **kwargs)`: `fn(model, **kwargs)` once, for models whose initialization is
  one call on the root that walks its children itself (torchtitan's
  `init_weights(buffer_device=...)`). Such a call needs every tensor at once, so this form
  materializes the whole model on each rank for the call, then slices: peak memory is the
  model's, not a unit's. Its values are exactly a CPU build's followed by the same call under
  `torch.manual_seed(seed)`.
- `skip(fn=None)` (or `"skip"`): parameters and persistent buffers start at zero and nothing
  draws a random number, for a state a checkpoint fills next. Non-persistent buffers (rotary
  frequencies) are in no checkpoint, so they are still computed, by their modules'
  `reset_buffers()` or by `fn` called on just the modules that hold them; one that nothing
  computes raises rather than stay zero.

Methods bound to a module of the caller's model (`model._init_weights`, `model.init_weights`)
are rebound to that module's working copy, so they act on the copy they are called for.

Work happens on a deep copy of the meta model (free: meta tensors have no storage), so the
caller's model is untouched, and under a forked RNG, so the caller's streams do not move.
Fresh tensors start filled with NaN (floats) or the lowest integer; a tensor counts as
initialized when its init replaced it, or wrote it (its version counter moved, or the sentinel
is gone, for inits that write through `.data`). Anything else is reported by FQN, never left
as garbage. A flat buffer is sliced to this rank's shard as soon as its last parameter is
initialized, and the full tensors are dropped, so peak memory stays near one unit's worth
rather than the model's.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast, overload

import torch
from torch import Tensor, nn

from funcshard.core._layout import FlatLayout, Layout
from funcshard.core._tree import format_names, join_fqn
from funcshard.init._apply_init import (
    PerModule,
    fill_slots,
    get_slot,
    holders,
    init_applied,
    sentinel,
    still_sentinel,
)


class StillOnMeta(RuntimeError):
    """`shard` could not initialize some tensors of a meta-device model (their modules
    define no `reset_parameters()` or `reset_buffers()`)."""


@dataclass(frozen=True)
class WholeModel:
    """`init=whole_model(fn, **kwargs)`: `fn(model, **kwargs)` called once on the whole model
    (a method bound to it, `model.init_weights`, as `copy.init_weights(**kwargs)`)."""

    fn: Callable[..., None]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Skip:
    """`init=skip(fn)`: zeros for whatever a checkpoint holds; `fn` (or `reset_buffers()`)
    computes the non-persistent buffers, which no checkpoint holds."""

    fn: PerModule | WholeModel | None = None


def whole_model(fn: Callable[..., None], **kwargs: Any) -> WholeModel:
    """Initialize a meta model by one call on its root, `fn(model, **kwargs)`, or a method
    bound to it on the working copy: `init=fs.whole_model(model.init_weights,
    buffer_device=mesh.device)` for torchtitan."""
    if not callable(fn):
        raise TypeError(f"funcshard.whole_model: fn must be callable, got {fn!r}.")
    return WholeModel(fn, kwargs)


def skip(fn: PerModule | WholeModel | None = None) -> Skip:
    """Build a state's layout with zeros and no random draws, for a checkpoint load to fill;
    `fn` computes the non-persistent buffers (`init=fs.skip(model._init_weights)`)."""
    if not (fn is None or callable(fn) or isinstance(fn, WholeModel)):
        raise TypeError(
            f"funcshard.skip: fn must be callable, whole_model(...) or None, got {fn!r}."
        )
    return Skip(fn)


Init = PerModule | WholeModel | Skip | str | None
Checked = PerModule | WholeModel | Skip | None  # an Init as check_init returns it


def check_init(init: Init, where: str = "funcshard.shard") -> Checked:
    """`init` as materialize takes it ("skip" becomes `Skip()`), or a TypeError saying what
    fits, raised as `where` (the public call that was given `init`)."""
    if init == "skip":
        return Skip()
    if init is None or callable(init) or isinstance(init, WholeModel | Skip):
        return init
    raise TypeError(
        f"{where}: init must be a function called with each module, "
        f"fs.whole_model(fn), fs.skip(fn), 'skip', or None, got {init!r}."
    )


def local_slice(tensors: list[Tensor], flat: FlatLayout, shard_rank: int) -> Tensor:
    """This rank's (shard_numel,) slice of the zero-padded concatenation of `tensors`."""
    device = tensors[0].device if tensors else torch.device("cpu")
    return local_slice_of(lambda i: tensors[i], flat, shard_rank, device)


def local_slice_of(
    member: Callable[[int], Tensor], flat: FlatLayout, shard_rank: int, device: Any = "cpu"
) -> Tensor:
    """This rank's (shard_numel,) slice of `flat`, asking `member(i)` for the i-th member's
    value only where it overlaps the slice, and dropping it before the next (so a replayed
    model holds one member at a time)."""
    out = torch.zeros(flat.shard_numel, dtype=flat.dtype, device=device)
    start = shard_rank * flat.shard_numel
    end = start + flat.shard_numel
    for i, (offset, numel) in enumerate(zip(flat.offsets, flat.numels, strict=True)):
        lo, hi = max(start, offset), min(end, offset + numel)
        if lo < hi:
            value = member(i).detach().reshape(-1)
            out[lo - start : hi - start] = value[lo - offset : hi - offset]
            del value
    return out


class _Collected:
    """Initialized tensors by FQN; each flat buffer is sliced to this rank's shard as soon as
    its last member arrives, and its full tensors are dropped."""

    def __init__(self, layout: Layout, shard_rank: int) -> None:
        self.layout, self.shard_rank = layout, shard_rank
        self.flat_of = {fqn: i for i, flat in enumerate(layout.flats) for fqn in flat.fqns}
        self.remaining = [set(flat.fqns) for flat in layout.flats]
        self.values: dict[str, Tensor] = {}
        self.shards: list[Tensor | None] = [None] * len(layout.flats)

    def put(self, fqn: str, value: Tensor) -> None:
        self.values[fqn] = value
        i = self.flat_of.get(fqn)
        if i is None:
            return
        self.remaining[i].discard(fqn)
        if not self.remaining[i]:
            flat = self.layout.flats[i]
            full = [self.values.pop(f) for f in flat.fqns]
            self.shards[i] = local_slice(full, flat, self.shard_rank)

    def result(self, work: nn.Module) -> tuple[list[Tensor], dict[str, Tensor], dict[str, Tensor]]:
        replicated = {fqn: self.values.pop(fqn) for fqn in self.layout.replicated}
        buffers = {fqn: self.values.pop(fqn) for fqn, _ in work.named_buffers()}
        # every flat was sliced once its last member arrived (else materialize raised first)
        return cast("list[Tensor]", self.shards), replicated, buffers


def materialize(
    model: nn.Module,
    layout: Layout,
    shard_rank: int,
    seed: int,
    device: torch.device,
    init: Init = None,
    where: str = "funcshard.shard",
) -> tuple[list[Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """Initialize a meta model per [Note: initializing from the meta device].

    Returns this rank's shards (in layout order), the replicated parameters and the buffers;
    errors name `where`, the public call that asked for them.
    """
    init = check_init(init, where)
    work = copy.deepcopy(model)
    init = _on_copy(init, model, work)
    collected = _Collected(layout, shard_rank)
    uninitialized: list[str] = []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        if isinstance(init, Skip):
            _skip(work, init.fn, device, collected, uninitialized)
        elif isinstance(init, WholeModel):
            _init_whole(work, init, device, collected.put, uninitialized)
        elif init is not None:
            init_applied(work, init, device, collected.put, uninitialized)
        else:
            _put_real(work, collected.put)
            _init_by_reset_methods(work, device, collected.put, uninitialized)
    if uninitialized:
        raise StillOnMeta(_still_on_meta_message(uninitialized, init, where))
    return collected.result(work)


def _still_on_meta_message(uninitialized: list[str], init: Init, where: str) -> str:
    names = format_names(uninitialized, limit=20)
    call = where.removeprefix("funcshard.")
    if isinstance(init, Skip):
        return (
            f"{where}(init=skip): these non-persistent buffers are in no checkpoint and "
            f"nothing computed them: {names}. Pass the model's own initialization, "
            f"init=fs.skip(fn) (a transformers model: init=fs.skip(model._init_weights)), or "
            f"define reset_buffers() on their modules."
        )
    if isinstance(init, WholeModel):
        return (
            f"{where}: these tensors are still on the meta device after "
            f"{_name(init.fn)}(model) ran: {names}. Make that call initialize them, or pass a "
            f"function called with each module instead: init=fn."
        )
    return (
        f"{where}: these tensors are still on the meta device after initialization: "
        f"{names}. Their modules define no reset_parameters() (for parameters and persistent "
        f"buffers) or reset_buffers() (for computed buffers such as rotary frequencies) that "
        f"writes them. Define one, pass the model's own initialization as {call}(..., init=fn), "
        f"called with each module (a transformers model: init=model._init_weights), or "
        f"init=fs.whole_model(fn) for one call on the whole model (torchtitan: "
        f"init=fs.whole_model(model.init_weights)), or build the model inside "
        f"`with fs.deferred_init():` to replay its own constructor, or on a real device."
    )


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


@overload
def _on_copy(init: Skip, model: nn.Module, work: nn.Module) -> Skip: ...
@overload
def _on_copy(init: WholeModel, model: nn.Module, work: nn.Module) -> WholeModel: ...
@overload
def _on_copy(
    init: Callable[..., None], model: nn.Module, work: nn.Module
) -> Callable[..., None]: ...
@overload
def _on_copy(init: None, model: nn.Module, work: nn.Module) -> None: ...
def _on_copy(init: Checked, model: nn.Module, work: nn.Module) -> Checked:
    """`init` with every method bound to a module of `model` rebound to that module's copy."""
    if isinstance(init, Skip):
        return Skip(_on_copy(init.fn, model, work))
    if isinstance(init, WholeModel):
        return WholeModel(_on_copy(init.fn, model, work), init.kwargs)
    if isinstance(init, functools.partial):
        return functools.partial(_on_copy(init.func, model, work), *init.args, **init.keywords)
    owner = getattr(init, "__self__", None)
    if inspect.ismethod(init) and isinstance(owner, nn.Module):
        copies = {id(m): c for m, c in zip(model.modules(), work.modules(), strict=True)}
        if id(owner) in copies:
            return types.MethodType(init.__func__, copies[id(owner)])
    return init


def _put_real(work: nn.Module, put: Callable[[str, Tensor], None]) -> None:
    """Hand on the tensors of a partly materialized model that are real already, as they are."""
    for fqn, tensor in (*work.named_parameters(), *work.named_buffers()):
        if not tensor.is_meta:
            put(fqn, tensor.detach().clone())


def _init_by_reset_methods(
    work: nn.Module,
    device: torch.device,
    put: Callable[[str, Tensor], None],
    uninitialized: list[str],
    only: set[str] | None = None,
) -> None:
    """Each module's own reset methods, in registration order; `only` restricts them to the
    modules with those prefixes."""
    first_fqn = {id(p): n for n, p in work.named_parameters()}
    first_fqn.update({id(b): n for n, b in work.named_buffers()})
    seen: set[int] = set()
    for prefix, module in work.named_modules():
        if only is None or prefix in only:
            _init_module(module, prefix, first_fqn, seen, device, put, uninitialized)


def _init_whole(
    work: nn.Module,
    whole: WholeModel,
    device: torch.device,
    put: Callable[[str, Tensor], None],
    uninitialized: list[str],
) -> None:
    """Fill every meta tensor with a sentinel (ties kept), make the one call, hand on every
    tensor."""
    before: dict[str, Tensor] = dict(work.named_parameters())
    before.update(work.named_buffers())
    fresh = _fill_with_sentinels(work, device)
    bound_to_work = inspect.ismethod(whole.fn) and whole.fn.__self__ is work
    with torch.no_grad():
        if bound_to_work:  # model.init_weights, rebound to the copy
            whole.fn(**whole.kwargs)
        else:
            whole.fn(work, **whole.kwargs)
    now: dict[str, Tensor] = dict(work.named_parameters())
    now.update(work.named_buffers())
    for fqn in before:
        value = now.get(fqn)
        if value is None or (fqn in fresh and still_sentinel(value, anywhere=True)):
            uninitialized.append(fqn)
        else:
            put(fqn, value.detach())


def _fill_with_sentinels(work: nn.Module, device: torch.device) -> set[str]:
    """Give every holder of each meta tensor of `work` one and the same sentinel tensor (ties
    kept); return their first FQNs."""
    fresh = set()
    for fqn, slots in holders(work).items():
        if get_slot(slots[0]).is_meta:
            fill_slots(slots, device)
            fresh.add(fqn)
    return fresh


def _own_meta(module: nn.Module) -> list[tuple[str, Tensor, bool]]:
    """The module's own meta tensors: (name, tensor, is a parameter)."""
    slots: list[tuple[str, Tensor, bool]] = [
        (n, t, True) for n, t in module.named_parameters(recurse=False)
    ]
    slots += [(n, t, False) for n, t in module.named_buffers(recurse=False)]
    return [(n, t, is_param) for n, t, is_param in slots if t.is_meta]


def _skip(
    work: nn.Module,
    fn: PerModule | WholeModel | None,
    device: torch.device,
    collected: _Collected,
    uninitialized: list[str],
) -> None:
    """Zeros for parameters and persistent buffers; non-persistent buffers computed."""
    computed = _non_persistent_meta_buffers(work)
    zeros = [
        (fqn, t.shape, t.dtype)
        for fqn, t in (*work.named_parameters(), *work.named_buffers())
        if t.is_meta and fqn not in computed
    ]
    missed: list[str] = []

    def keep(fqn: str, value: Tensor) -> None:
        if fqn in computed:
            collected.put(fqn, value)

    _put_real(work, collected.put)
    owners = set(computed.values())
    if computed:
        if isinstance(fn, WholeModel):
            _init_whole(work, fn, device, keep, missed)
        elif fn is not None:
            init_applied(work, fn, device, keep, missed, only=owners)
        else:
            _init_by_reset_methods(work, device, keep, missed, only=owners)
    uninitialized.extend(f for f in missed if f in computed)
    for fqn, shape, dtype in zeros:
        collected.put(fqn, torch.zeros(shape, dtype=dtype, device=device))


def _non_persistent_meta_buffers(work: nn.Module) -> dict[str, str]:
    """FQN -> owning module's prefix of each meta buffer left out of the state dict."""
    found = {}
    for prefix, module in work.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta and name in module._non_persistent_buffers_set:
                found[join_fqn(prefix, name)] = prefix
    return found


def _init_module(
    module: nn.Module,
    prefix: str,
    first_fqn: dict[int, str],
    seen: set[int],
    device: torch.device,
    on_initialized: Callable[[str, Tensor], None],
    uninitialized: list[str],
) -> None:
    """Run one module's own reset methods on fresh tensors; report each tensor it first owns."""
    slots = _own_meta(module)
    if not slots:
        return
    fresh = {}
    for name, meta, is_param in slots:
        tensor = sentinel(meta, device)
        obj = nn.Parameter(tensor, meta.requires_grad) if is_param else tensor
        fresh[name] = (obj, obj._version)
        setattr(module, name, obj)
    with torch.no_grad():
        for method in ("reset_parameters", "reset_buffers"):
            if callable(getattr(module, method, None)):
                getattr(module, method)()
    for name, meta, _ in slots:
        value = getattr(module, name)
        obj, version = fresh[name]
        setattr(module, name, meta)  # back to meta: the copy holds no memory
        if id(meta) in seen:
            continue  # a later holder of a tied tensor: its init only advanced the RNG
        seen.add(id(meta))
        fqn = first_fqn.get(id(meta), join_fqn(prefix, name))
        if value is obj and obj._version == version and still_sentinel(obj):
            uninitialized.append(fqn)
        else:
            on_initialized(fqn, value.detach())
