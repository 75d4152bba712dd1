"""Counting a computation's memory on the meta device, where nothing is allocated.

`MetaBytes` counts the bytes of the meta tensors alive after every op, as
`funcshard.testing.memory.LiveTensors` counts real ones. (The ops whose meta version would
keep other intermediates than the device does, attention, take the device's path in
`funcshard.planning._attention_kernels`.)
"""

from __future__ import annotations

import weakref
from typing import Any

import optree
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


class MetaBytes(TorchDispatchMode):
    """Count the live bytes of meta tensors that ops return; `peak` is the largest total.

    A storage counts while any tensor using it is alive (the bookkeeping of LiveTensors).
    """

    def __init__(self) -> None:
        super().__init__()
        self._users: dict[int, int] = {}  # storage identity -> live tensors using it
        self._bytes: dict[int, int] = {}
        self._seen: set[int] = set()  # ids of the tensor objects counted (and alive)
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            if isinstance(t, Tensor) and t.device.type == "meta":
                self._track(t)
        self.peak = max(self.peak, self.live)
        return out

    def restart_peak(self) -> int:
        """The peak so far; from now on the peak counts from what is alive now."""
        peak, self.peak = self.peak, self.live
        return peak

    def _track(self, tensor: Tensor) -> None:
        if id(tensor) in self._seen:  # an in-place op returns its input: counted already
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self._users:
            self._users[key] = 0
            self._bytes[key] = storage.nbytes()
            self.live += storage.nbytes()
        self._users[key] += 1
        self._seen.add(id(tensor))
        weakref.finalize(tensor, self._release, key, id(tensor))

    def _release(self, key: int, tensor_id: int) -> None:
        self._seen.discard(tensor_id)
        self._users[key] -= 1
        if self._users[key] == 0:
            del self._users[key]
            self.live -= self._bytes.pop(key)
