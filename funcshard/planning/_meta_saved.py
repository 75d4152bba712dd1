"""What autograd keeps, in the dry run, instead of a view into a resharded unit's buffer
(mirroring `funcshard.step._regather`'s `_Handle`; see [Note: dry run])."""

from __future__ import annotations

from typing import Any

from torch import Tensor


class Handle:
    """What autograd keeps instead of a view into a resharded unit's buffer."""

    __slots__ = ("call", "flat", "offset", "size", "stride", "unit")

    def __init__(self, call: Any, unit: int, flat: int, tensor: Tensor) -> None:
        self.call, self.unit, self.flat = call, unit, flat
        self.size, self.stride, self.offset = (
            tensor.size(),
            tensor.stride(),
            tensor.storage_offset(),
        )
