"""Probes `fs.testing.check` puts around a training step: which collectives were never
waited for, and how many all-gathered bytes were alive at once against the plan's bound.

[Note: the unwaited probe and compiled steps]
The probe wraps funcshard's collective issuers. Inside a step that dynamo traces, the
wrapper's Python (`inspect`'s argument binding) broke the graph: a compiled configuration of
`fs.testing.check` ran as several graphs (four breaks in the compiled FSDP 2 step of the
recipe property test), not the one graph a user's step is, and dynamo traced each break's
resume function too. So while torch compiles, the wrapper only issues, as funcshard's own
bookkeeping does (see [Note: bookkeeping outside compiled graphs] in
funcshard/comm/_collectives.py): a collective inside a compiled graph is the compiler's
node, waited for by the graph, and is not noted. Eager steps are probed as before.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from funcshard.comm import _collectives as collectives
from funcshard.comm import _failures as failures
from funcshard.core._binding import bind
from funcshard.core._precision import gather_dtype
from funcshard.core._state import ShardedState
from funcshard.testing.memory import LiveTensors, is_all_gather

_ISSUERS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass
class Issued:
    """A collective issued inside `unwaited()`, in words, and whether it was waited for."""

    what: str
    waited: bool = False


class _Tracked:
    """Handed to funcshard's code in place of a collective's `Pending`, noting when it is
    waited for. It holds no tensor of its own (a list of Pendings would keep every gathered
    buffer alive) and lives only as long as funcshard's code keeps it."""

    __slots__ = ("_issued", "_pending")

    def __init__(self, pending: collectives.Pending, issued: Issued) -> None:
        self._pending, self._issued = pending, issued

    def wait(self) -> Tensor:
        out = self._pending.wait()
        self._issued.waited = True
        return out

    def result(self) -> Tensor:
        return self._pending.result()


@contextlib.contextmanager
def unwaited() -> Iterator[list[Issued]]:
    """Note every collective funcshard issues inside the block, and whether it was waited
    for by the end (collectives over one rank issue nothing and are not noted)."""
    issued: list[Issued] = []
    originals = {name: getattr(collectives, name) for name in _ISSUERS}
    for name, issue in originals.items():
        setattr(collectives, name, _tracking(name, issue, issued))
    try:
        yield issued
    finally:
        for name, issue in originals.items():
            setattr(collectives, name, issue)


def _tracking(name: str, issue: Callable[..., Any], issued: list[Issued]) -> Callable[..., Any]:
    signature = inspect.signature(issue)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        pending = issue(*args, **kwargs)
        if torch.compiler.is_compiling():  # see [Note: the unwaited probe and compiled steps]
            return pending
        arguments = signature.bind_partial(*args, **kwargs).arguments
        group = arguments.get("group", args[1] if len(args) > 1 else None)
        if group is None or group.size() == 1:
            return pending  # nothing was issued (or a stand-in whose group we cannot read)
        issued.append(Issued(f"{name}{failures.unit_words(arguments.get('what'))}"))
        return _Tracked(pending, issued[-1])

    return wrapper


class GatheredBytes(LiveTensors):
    """Live bytes of all-gathered floating-point storages, at their peak (`LiveTensors`
    counts storages; `check_collectives` adds integer all-gathers of its own, not counted)."""

    def __init__(self) -> None:
        super().__init__(watch=is_all_gather)
        self.peak_bytes = 0
        self._integers: set[int] = set()

    def watch_tensor(self, tensor: Tensor) -> None:
        super().watch_tensor(tensor)
        if not tensor.is_floating_point():
            self._integers.add(tensor.untyped_storage()._cdata)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        gathered = out[0] if isinstance(out, tuple) else out  # c10d's op returns (out, work)
        if is_all_gather(func) and isinstance(gathered, Tensor):
            key = gathered.untyped_storage()._cdata  # the key LiveTensors tracks it by
            floating = gathered.is_floating_point()
            (self._integers.discard if floating else self._integers.add)(key)
        live = sum(self._bytes[key] for key in self._watched if key not in self._integers)
        self.peak_bytes = max(self.peak_bytes, live)
        return out


@contextlib.contextmanager
def gathered_bytes(measure: bool) -> Iterator[GatheredBytes | None]:
    """Count gathered bytes inside the block when `measure`, else nothing (None)."""
    if not measure:
        yield None
        return
    with GatheredBytes() as mode:
        yield mode


def gathered_bound(model: nn.Module, state: ShardedState) -> int:
    """The most gathered bytes a step may hold: the units gathered for the whole call (the
    root, containers such as ModuleList that never run, units whose tied parameters cross
    into another), the running unit and the prefetched one; with `reshard_after_forward=False`
    every unit, with k each other unit's 1/k slice kept for backward."""
    if state.layout.mesh.shard_size == 1:
        return 0  # nothing is gathered
    binding = bind(model, state.layout)
    sizes = [0] * len(binding.unit_names)
    for unit, flats in enumerate(binding.unit_flats):
        for i in flats:
            flat = state.layout.flats[i]
            sizes[unit] += flat.padded_numel * gather_dtype(state.mp, flat).itemsize
    whole = sum(sizes[u] for u in binding.whole_call)
    others = sorted((s for u, s in enumerate(sizes) if u not in binding.whole_call), reverse=True)
    keep = state.reshard_after_forward
    if keep is False:
        return whole + sum(others)
    kept = 0 if keep is True else math.ceil(sum(others) / keep)
    return whole + sum(others[:2]) + kept
