"""A user's per-module init function, run on a meta model as `model.apply(fn)` runs it.

[Note: init functions applied like nn.Module.apply]
`shard(..., init=fn)` calls `fn(module)` for every module children first, parent last, as
`model.apply(fn)` does and as transformers' `post_init` does with `_init_weights`. A parent's
call may write its descendants' tensors: GPT-2 rescales the `c_proj.weight` of its attention
and MLP modules, T5's attention initializes its `q`, `k`, `v`, `o` children and its root the
shared embedding. So a tensor must be real from the first call that writes it until the last
one, and no longer, or peak memory would be the whole model's.

Which calls write which tensors is found by a rehearsal first: the same sequence of calls on a
copy of the model whose every tensor is on the meta device (free: no storage, no random
draws), under a dispatch mode that records the storage every mutating op writes (`.data` and
views share it, so writes through them count) and noticing tensors a call replaces. The real
pass then fills each tensor with a sentinel just before its first writer and hands it on just
after its last writer, when its unit's flat buffer may be sliced and dropped. With a unit plan
of transformer blocks that keeps about one block real at a time, plus the root's tensors whose
last writer is the root (T5's shared embedding).

A tensor counts as initialized when some call wrote it and no sentinel value is left in it
(so a call that writes one row of a weight, as an embedding's padding row, is not enough).
A tied tensor is one tensor: each of its holders' calls writes it in turn and the last write
wins, as in a model built on the CPU. Calls are made once per module, even for a module
reachable by two paths.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from funcshard.core._tree import join_fqn

PerModule = Callable[[nn.Module], None]
Slot = tuple[nn.Module, str]  # a holder module and the tensor's attribute name in it


def sentinel(meta: Tensor, device: torch.device) -> Tensor:
    """A fresh tensor no init would produce: NaN, or the dtype's lowest integer."""
    fill = float("nan") if meta.is_floating_point() or meta.is_complex() else None
    if fill is None:
        fill = False if meta.dtype == torch.bool else torch.iinfo(meta.dtype).min
    return torch.full(meta.shape, fill, dtype=meta.dtype, device=device)


def still_sentinel(tensor: Tensor, anywhere: bool = False) -> bool:
    """Whether the sentinel is left in every element (or, with `anywhere`, in any element)."""
    if tensor.numel() == 0:
        return False
    if tensor.dtype == torch.bool:
        return True  # a bool buffer written through .data cannot be told apart
    t = tensor.detach()
    left = t.isnan() if t.is_floating_point() or t.is_complex() else t == torch.iinfo(t.dtype).min
    return bool(left.any() if anywhere else left.all())


def post_order(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(prefix, module) children before parents, each module once, as `apply` visits them."""
    seen: set[int] = set()

    def walk(m: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
        for name, child in m.named_children():
            if id(child) not in seen:
                seen.add(id(child))
                yield from walk(child, join_fqn(prefix, name))
        yield prefix, m

    return list(walk(module, ""))


def holders(model: nn.Module) -> dict[str, list[Slot]]:
    """First FQN of each parameter and buffer -> every (module, name) slot that holds it."""
    first: dict[int, str] = {}
    for fqn, t in (*model.named_parameters(), *model.named_buffers()):
        first.setdefault(id(t), fqn)
    slots: dict[str, list[Slot]] = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        own = [*m._parameters.items(), *m._buffers.items()]
        for name, t in own:
            if t is not None:
                slots.setdefault(first.get(id(t), join_fqn(prefix, name)), []).append((m, name))
    for fqn in slots:  # a module reachable by two paths lists a slot twice
        slots[fqn] = list({(id(m), n): (m, n) for m, n in slots[fqn]}.values())
    return slots


def init_applied(
    work: nn.Module,
    fn: PerModule,
    device: torch.device,
    put: Callable[[str, Tensor], None],
    uninitialized: list[str],
    only: set[str] | None = None,
) -> None:
    """Run `fn` over `work` per [Note: init functions applied like nn.Module.apply], handing
    each initialized tensor to `put(fqn, value)` after its last writer; `only` restricts the
    calls to the modules with those prefixes."""
    order = [(p, m) for p, m in post_order(work) if only is None or p in only]
    slots = holders(work)
    writers = _rehearse(work, fn, order)
    starts: dict[int, list[str]] = {}
    ends: dict[int, list[str]] = {}
    for fqn, calls in writers.items():
        starts.setdefault(calls[0], []).append(fqn)
        ends.setdefault(calls[-1], []).append(fqn)
    for fqn in slots.keys() - writers.keys():
        current = get_slot(slots[fqn][0])
        if current.is_meta:
            uninitialized.append(fqn)
        else:  # a real tensor of a partly materialized model that no call writes
            put(fqn, current.detach().clone())
    for i, (_, module) in enumerate(order):
        for fqn in starts.get(i, ()):
            fill_slots(slots[fqn], device)
        with torch.no_grad():
            fn(module)
        for fqn in ends.get(i, ()):
            value = get_slot(slots[fqn][0])
            if value.is_meta or still_sentinel(value, anywhere=True):
                uninitialized.append(fqn)
            else:
                put(fqn, value.detach())
            for slot in slots[fqn]:  # back to meta: the copy holds no memory
                _set(slot, _as_meta(value))


def _rehearse(work: nn.Module, fn: PerModule, order: list[tuple[str, nn.Module]]) -> dict:
    """First FQN -> indices into `order` of the calls that write it, from the same calls on an
    all-meta copy."""
    copies = _all_meta_copy(work)
    slots = holders(copies[id(work)])
    writers: dict[str, list[int]] = {}
    for i, (_, module) in enumerate(order):
        before = {fqn: get_slot(s[0]) for fqn, s in slots.items()}
        storage = {_storage_id(t): fqn for fqn, t in before.items()}
        with torch.no_grad(), _Writes() as written:
            fn(copies[id(module)])
        for fqn, t in before.items():
            replaced = any(get_slot(slot) is not t for slot in slots[fqn])
            if replaced:  # ties are kept: every holder gets what the first one has now
                for slot in slots[fqn][1:]:
                    _set(slot, get_slot(slots[fqn][0]))
            if replaced or (storage.get(_storage_id(t)) == fqn and _storage_id(t) in written):
                writers.setdefault(fqn, []).append(i)
    return writers


def _all_meta_copy(work: nn.Module) -> dict[int, nn.Module]:
    """A deep copy of `work` with every tensor on meta (ties kept); id(original module) ->
    its copy."""
    twin = copy.deepcopy(work)
    for slots in holders(twin).values():
        meta = _as_meta(get_slot(slots[0]))
        for slot in slots:
            _set(slot, meta)
    return {id(a): b for a, b in zip(work.modules(), twin.modules(), strict=True)}


class _Writes(TorchDispatchMode):
    """The storages that mutating ops write while it is entered (a set of storage ids)."""

    def __enter__(self) -> set[int]:
        self.written: set[int] = set()
        super().__enter__()
        return self.written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = kwargs.get(arg.name, args[i] if i < len(args) else None)
                for t in value if isinstance(value, list | tuple) else (value,):
                    if isinstance(t, Tensor):
                        self.written.add(_storage_id(t))
        return func(*args, **kwargs)


def _storage_id(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def fill_slots(slots: list[Slot], device: torch.device) -> None:
    """Give every holder of a meta tensor one and the same sentinel-filled tensor."""
    meta = get_slot(slots[0])
    if not meta.is_meta:
        return
    value = sentinel(meta, device)
    if isinstance(meta, nn.Parameter):
        value = nn.Parameter(value, meta.requires_grad)
    for slot in slots:
        _set(slot, value)


def _as_meta(t: Tensor) -> Tensor:
    meta = torch.empty_like(t, device="meta")
    return nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta


def get_slot(slot: Slot) -> Tensor:
    module, name = slot
    t = module._parameters[name] if name in module._parameters else module._buffers[name]
    assert t is not None  # a slot holds a tensor: `holders` takes no empty ones
    return t


def _set(slot: Slot, value: Tensor) -> None:
    module, name = slot
    if name in module._parameters:
        # torch types the slot as Parameter; a tensor tied to a buffer may come plain
        module._parameters[name] = value  # type: ignore[assignment]
    else:
        module._buffers[name] = value
