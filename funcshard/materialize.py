"""Initialize a meta-device model straight into local shards, one unit at a time.

[Note: initializing from the meta device]
The rule: modules are initialized in registration order by their own `reset_parameters()`
(then `reset_buffers()`, if they define one, for buffers such as rotary frequencies), or by
`shard(..., init=fn)`'s `fn(module)` instead when the model initializes itself otherwise (a
transformers model's `_init_weights`: bound to the caller's meta model, it reads only its
config, so it acts on the working copy's module it is handed), all
under one seed shared by every rank, and each parameter only by the first module that holds
it. Every rank replays the whole sequence and keeps only its slice, so the values do not
depend on the world size. They equal a model built on the CPU after `torch.manual_seed(seed)`
whenever construction initialized modules in that same order, as models made of torch's
layers do (the GPT here). A parent that calls its own `reset_parameters()` after building
its children initializes in a different order from construction, so its values differ from
the CPU build's (they are still the same on every rank and world size).

A later holder of a tied parameter (a GPT head tied to its embedding) still runs its
`reset_parameters()`, on a scratch tensor that is then dropped, so the random stream advances
exactly as it did when the model was constructed, and the embedding keeps its values.

Work happens on a deep copy of the meta model (free: meta tensors have no storage), so the
caller's model is untouched. Fresh tensors start filled with NaN (floats) or the lowest
integer; a tensor counts as initialized when its init replaced it, or wrote it (its version
counter moved, or the sentinel is gone, for inits that write through `.data`). Anything else
is reported by FQN, never left as garbage. A flat buffer is sliced to this rank's shard as
soon as its last parameter is initialized, and the full tensors are dropped, so peak memory
stays near one unit's worth rather than the model's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

from funcshard.layout import FlatLayout, Layout
from funcshard.tree import format_names, join_fqn


class StillOnMeta(RuntimeError):
    """`shard` could not initialize some tensors of a meta-device model (their modules
    define no `reset_parameters()` or `reset_buffers()`)."""


def local_slice(tensors: list[Tensor], flat: FlatLayout, shard_rank: int) -> Tensor:
    """This rank's (shard_numel,) slice of the zero-padded concatenation of `tensors`."""
    device = tensors[0].device if tensors else torch.device("cpu")
    out = torch.zeros(flat.shard_numel, dtype=flat.dtype, device=device)
    start = shard_rank * flat.shard_numel
    end = start + flat.shard_numel
    for tensor, offset, numel in zip(tensors, flat.offsets, flat.numels, strict=True):
        lo, hi = max(start, offset), min(end, offset + numel)
        if lo < hi:
            out[lo - start : hi - start] = tensor.detach().reshape(-1)[lo - offset : hi - offset]
    return out


def materialize(
    model: nn.Module,
    layout: Layout,
    shard_rank: int,
    seed: int,
    device: torch.device,
    init: Callable[[nn.Module], None] | None = None,
) -> tuple[list[Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """Initialize a meta model per [Note: initializing from the meta device].

    Returns this rank's shards (in layout order), the replicated parameters and the buffers.
    """
    work = copy.deepcopy(model)
    first_fqn = {id(p): n for n, p in work.named_parameters()}
    first_fqn.update({id(b): n for n, b in work.named_buffers()})
    flat_of = {fqn: i for i, flat in enumerate(layout.flats) for fqn in flat.fqns}
    remaining = [set(flat.fqns) for flat in layout.flats]
    values: dict[str, Tensor] = {}
    shards: list[Tensor | None] = [None] * len(layout.flats)
    uninitialized: list[str] = []

    def on_initialized(fqn: str, value: Tensor) -> None:
        values[fqn] = value
        i = flat_of.get(fqn)
        if i is None:
            return
        remaining[i].discard(fqn)
        if not remaining[i]:
            flat = layout.flats[i]
            shards[i] = local_slice([values.pop(f) for f in flat.fqns], flat, shard_rank)

    for fqn, tensor in (*work.named_parameters(), *work.named_buffers()):
        if not tensor.is_meta:  # a partly materialized model: keep what is real
            on_initialized(fqn, tensor.detach().clone())
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        seen: set[int] = set()
        for prefix, module in work.named_modules():
            _init_module(
                module, prefix, first_fqn, seen, device, on_initialized, uninitialized, init
            )
    if uninitialized:
        raise StillOnMeta(
            f"funcshard.shard: these tensors are still on the meta device after initialization: "
            f"{format_names(uninitialized, limit=20)}. Their modules define no "
            f"reset_parameters() (for parameters and persistent buffers) or reset_buffers() "
            f"(for computed buffers such as rotary frequencies) that writes them. Define one, "
            f"pass the model's own initialization as shard(..., init=fn), called with each "
            f"module (a transformers model: init=model._init_weights), or build the model on "
            f"a real device."
        )
    replicated = {fqn: values.pop(fqn) for fqn in layout.replicated}
    buffers = {fqn: values.pop(fqn) for fqn, _ in work.named_buffers()}
    return shards, replicated, buffers


def _sentinel(meta: Tensor, device: torch.device) -> Tensor:
    """A fresh tensor no init would produce: NaN, or the dtype's lowest integer."""
    fill = float("nan") if meta.is_floating_point() or meta.is_complex() else None
    if fill is None:
        fill = False if meta.dtype == torch.bool else torch.iinfo(meta.dtype).min
    return torch.full(meta.shape, fill, dtype=meta.dtype, device=device)


def _still_sentinel(tensor: Tensor) -> bool:
    if tensor.numel() == 0:
        return False
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(tensor.detach().isnan().all())
    if tensor.dtype == torch.bool:
        return True  # a bool buffer written through .data cannot be told apart
    return bool((tensor.detach() == torch.iinfo(tensor.dtype).min).all())


def _init_module(
    module: nn.Module,
    prefix: str,
    first_fqn: dict[int, str],
    seen: set[int],
    device: torch.device,
    on_initialized: Callable[[str, Tensor], None],
    uninitialized: list[str],
    init: Callable[[nn.Module], None] | None = None,
) -> None:
    """Run one module's init on fresh tensors (its own reset methods, or `init(module)`);
    report each tensor it first owns."""
    slots = [(n, t, True) for n, t in module.named_parameters(recurse=False)]
    slots += [(n, t, False) for n, t in module.named_buffers(recurse=False)]
    slots = [(n, t, is_param) for n, t, is_param in slots if t.is_meta]
    if not slots:
        return
    fresh = {}
    for name, meta, is_param in slots:
        tensor = _sentinel(meta, device)
        obj = nn.Parameter(tensor, meta.requires_grad) if is_param else tensor
        fresh[name] = (obj, obj._version)
        setattr(module, name, obj)
    with torch.no_grad():
        if init is not None:
            init(module)
        else:
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
        if value is obj and obj._version == version and _still_sentinel(obj):
            uninitialized.append(fqn)
        else:
            on_initialized(fqn, value.detach())
