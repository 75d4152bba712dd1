"""fp16 means over a group, divided before and after the sum (see [Note: fp16 means])."""

from __future__ import annotations

import torch
from torch import Tensor

# [Note: fp16 means]
# fp16 holds magnitudes up to 65504 and loses precision below 6.1e-5 (subnormals), so a
# mean of fp16 gradients is taken as FSDP2 takes it: each rank's values divided by a power
# of two near the square root of the group's size before the sum, the rest after it, so the
# sum neither overflows at large world sizes nor the small values lose more bits than they
# must. bf16 and fp32 have fp32's range: their means stay one reduction "avg" (sum, then
# divide), bitwise as before.


def fp16_divisors(size: int) -> tuple[int, float]:
    """(before, after) the sum of a mean over `size` fp16 tensors: `before` doubles from 1
    while it divides `size` and its square stays below `size`; `after` is the rest."""
    before = 1
    while size % before == 0 and before * before < size:
        before *= 2
    return before, size / before


def divided(
    tensor: Tensor, op: str, size: int, owned: bool = False
) -> tuple[Tensor, str, float | None]:
    """An fp16 mean as a sum of divided values: (what to reduce, the op, the divisor left
    for after the reduction); anything else as it is (see [Note: fp16 means])."""
    if op != "avg" or tensor.dtype != torch.float16:
        return tensor, op, None
    before, after = fp16_divisors(size)
    with torch.no_grad():  # (collectives are not differentiated through directly)
        divided = tensor.div_(before) if owned else tensor.div(before)
    return divided, "sum", after if after != 1 else None
