"""What autograd keeps, in the dry run, instead of a view into a resharded unit's buffer
(mirroring `funcshard.step._regather`'s `_Handle`; see [Note: dry run])."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from funcshard.step._regather import Geometry


class Handle(Geometry):
    """What autograd keeps instead of a view into a resharded unit's buffer."""

    __slots__ = ("call", "flat", "unit")

    def __init__(self, call: Any, unit: int, flat: int, tensor: Tensor) -> None:
        super().__init__(tensor)
        self.call, self.unit, self.flat = call, unit, flat
