"""Count live tensor memory op by op, on any device (a TorchDispatchMode).

Every tensor an op returns is tracked by its storage; a storage counts as live while any
tracked tensor that uses it is alive. A tensor subclass that wraps others (a traceable
wrapper subclass such as DTensor) is tracked by the tensors it wraps: its own
`untyped_storage()` is a storage object of its full (global) size without data, so a
DTensor counts by its local shard. Storages are keyed by their C++ identity, and resizes of
tracked storages (`untyped_storage().resize_`, which FSDP2 uses to free and regrow gathered
parameters, and which no dispatch mode sees) are counted too. Tensors made before the mode
started are not counted unless adopted. Used by the memory tests and the benchmarks' "peak
live tensor memory".

[Note: a finished collective's tensors outlive its wait]
A gloo collective's Work holds its tensors, and `wait()` returns once the work is marked
done, while the process group's worker thread still holds the work. When that thread lets
go, the last reference to a tensor Python knows is dropped, which needs the GIL: until the
main thread releases it, the tensor (the global norm's 4-byte all-reduce buffer, say) still
counts as live. So a reading taken right after a step may count one more small tensor than
the same reading a step later, though nothing leaked; `settled()` sleeps (releasing the GIL)
and collects before each read until the reads agree. Leak tests compare settled readings.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from funcshard.comm import _exchange as exchange

_Self = TypeVar("_Self", bound="LiveTensors")


class LiveTensors(TorchDispatchMode):
    """Track live bytes of tensors created inside the mode; `peak` is the largest total seen.

    `watch(predicate)` also counts, at each op, how many live storages were produced by ops
    for which `predicate(func)` holds (e.g. all-gathers), in `peak_watched`. Watching
    `is_all_gather` also watches the outputs of gloo's exchange all-gathers, which dispatch
    no all-gather op (see `exchange.observe_gathers`).
    """

    def __init__(self, watch: Callable[[Any], bool] | None = None) -> None:
        super().__init__()
        self._users: dict[int, int] = {}  # storage identity -> live tracked tensors using it
        self._bytes: dict[int, int] = {}
        self._watched: set[int] = set()
        self._seen: set[int] = set()  # ids of the tensor objects tracked (and still alive)
        self._watch = watch
        self.live = 0
        self.peak = 0
        self.peak_watched = 0

    def __enter__(self: _Self) -> _Self:
        self._original_resize = torch.UntypedStorage.resize_
        mode = self

        def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            before = storage.nbytes()
            out = mode._original_resize(storage, size)
            mode._resized(storage._cdata, storage.nbytes() - before)
            return out

        # a patch of torch's method, which its stubs declare on the private _StorageBase
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        self._observing = contextlib.ExitStack()
        if self._watch is is_all_gather:
            self._observing.enter_context(exchange.observe_gathers(self.watch_tensor))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        super().__exit__(*exc)
        self._observing.close()

    def _resized(self, key: int, delta: int) -> None:
        if key in self._users:
            self._bytes[key] += delta
            self.live += delta
            self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        watched = self._watch is not None and self._watch(func)
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t, watched)
        self.peak = max(self.peak, self.live)
        self.peak_watched = max(self.peak_watched, self.watched_live())
        return out

    def settled(self, reads: int = 3, pause: float = 0.005, limit: float = 2.0) -> int:
        """Live bytes once other threads have let go of finished collectives' tensors: read
        after a collection, pausing between reads, until `reads` in a row agree (see
        [Note: a finished collective's tensors outlive its wait]). At most `limit` seconds."""
        last, agreed, deadline = None, 0, time.monotonic() + limit
        while agreed < reads and time.monotonic() < deadline:
            time.sleep(pause)  # hands the GIL to a thread waiting to free a tensor
            gc.collect()
            agreed = agreed + 1 if self.live == last else 1
            last = self.live
        return self.live

    def watched_live(self) -> int:
        """How many watched storages are live now (and not resized to nothing)."""
        return sum(1 for key in self._watched if self._bytes[key] > 0)

    def adopt(self, tree: Any) -> None:
        """Count tensors made before the mode started (parameters, optimizer state) as live,
        and see when they are freed."""
        for t in optree.tree_leaves(tree, none_is_leaf=False):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t, watched=False)
        self.peak = max(self.peak, self.live)

    def watch_tensor(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage as watched from now on (made by an op `watch` cannot
        recognize, e.g. a gloo exchange's all-gather output, made by `new_empty`)."""
        self._track(tensor, watched=True)

    def _track(self, tensor: torch.Tensor, watched: bool) -> None:
        if is_traceable_wrapper_subclass(tensor):
            # Counted by what it wraps (a DTensor by its local shard): the wrapper's own
            # storage holds no data, but reports the global size. An in-place op on a
            # DTensor returns it, and its local tensor was seen already.
            for name in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self._track(inner, watched)
            return
        try:
            storage = tensor.untyped_storage()
            ptr = storage._cdata
        except (RuntimeError, NotImplementedError):
            return  # a wrapper without storage of its own (e.g. FSDP2's parameter wrappers)
        if id(tensor) in self._seen:  # an in-place op returns its input: counted already
            if watched and ptr in self._users:  # (gloo's all-gather fills a tensor made first)
                self._watched.add(ptr)
            return
        if ptr not in self._users:
            self._users[ptr] = 0
            self._bytes[ptr] = storage.nbytes()
            self.live += storage.nbytes()
        if watched:
            self._watched.add(ptr)
        self._users[ptr] += 1
        self._seen.add(id(tensor))
        weakref.finalize(tensor, self._release, ptr, id(tensor))

    def _release(self, ptr: int, tensor_id: int) -> None:
        self._seen.discard(tensor_id)
        self._users[ptr] -= 1
        if self._users[ptr] == 0:
            del self._users[ptr]
            self.live -= self._bytes.pop(ptr)
            self._watched.discard(ptr)


def is_all_gather(func: Any) -> bool:
    """True for the all-gather ops funcshard's gathers go through: the process group's own
    eagerly (see [Note: eager collectives through Work objects]), the functional op traced.
    (A gloo exchange dispatches no all-gather op: see `exchange.observe_gathers`.)"""
    name = str(func)
    return "all_gather_into_tensor" in name or "_allgather_base" in name


def metering_compiler(peaks: list[int], adopt_inputs: bool = False) -> Callable[..., Any]:
    """An aot_autograd graph compiler that runs each graph under `LiveTensors` and appends
    its peak to `peaks`: memory of a compiled step metered from inside (a dispatch mode
    entered around a compiled call makes dynamo skip the frame). `adopt_inputs` counts the
    graph's inputs as live (a backward graph's: what its forward saved)."""

    def compiler(gm: torch.fx.GraphModule, example_inputs: object) -> Callable[..., Any]:
        def run(*args: object) -> object:
            with LiveTensors() as meter:
                if adopt_inputs:
                    meter.adopt([a for a in args if isinstance(a, torch.Tensor)])
                out = gm.forward(*args)
            peaks.append(meter.peak)
            return out

        return run

    return compiler
