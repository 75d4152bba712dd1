"""Non-finite flags of CPU tensors, read on the host: the eager CPU step's check (see [Note:
non-finite steps skipped by default] in funcshard/step/_finite.py; its rows cross the mesh
as funcshard/comm/_host_rows.py says). Right after a backward, where the check runs, each
distinct op and each line of Python is paid cold (the first `torch.empty` after a backward
of 100 small layers took 9-11 us, the second 1.3), so what counts here is how few
different things the check does, more than how much work each does.

[Note: one op asks whether anything is non-finite]
A step's gradients are finite far more often than not, so the common question is whether
any element of any tensor is NaN or inf; the per-tensor answer is wanted only when one is.
torch's own gradient scaler asks the first question in one call over a list of tensors
(`torch._amp_foreach_non_finite_check_and_unscale_`, which looks at every element and sets
a one-element flag). With a scale of exactly 1 it writes each fp32 or fp64 value back with
the same bits (NaN payloads too) and bumps no version counter, so the gradients are as they
were (tested); the memory is still written, so a copy-on-write page (a tensor loaded with
`mmap=True`) is copied. fp16 and bf16 values go through float in it, which would quiet a
signaling NaN; they, complex tensors, a tensor that requires grad (the loss: the call has
no autograd formula) and any the call refuses (overlapping memory such as an expanded
tensor; a torch without the CPU kernel) are summed instead, one sum a tensor read on the
host (finite unless NaN or inf, or finite values whose sum overflows). When either
test says some tensor may not be finite, each tensor is looked at element by element, so
large finite values never count. One call for the overhead matrix's FSDP cell's 34 shards
took that cell's check from 171 to 90-110 us a step, DDP's (three pieces) from 78 to 55-65.
"""

from __future__ import annotations

import cmath
import threading

import torch
from torch import Tensor

# the dtypes whose values (NaN payloads too) the scaler's check writes back bit for bit; fp16 and
# bf16 go through float there, which quiets a signaling NaN, so they (and complex) are summed
_SCALED_DTYPES = frozenset({torch.float32, torch.float64})


class _Found(threading.local):
    """This thread's flag for the one-call check (reset after a hit), and the scale of 1."""

    def __init__(self) -> None:
        with torch.inference_mode(False):  # (whatever the defaults where a thread first asks)
            self.flag = torch.zeros(1, dtype=torch.float32, device="cpu")
            self.one = torch.ones(1, dtype=torch.float32, device="cpu")


_FOUND = _Found()


def flags_on_host(tensors: list[Tensor | None]) -> list[int]:
    """One int per tensor: 1 where it holds a NaN or inf (None counts as finite)."""
    live = [t for t in tensors if t is not None]
    if not _any_nonfinite(live):
        return [0] * len(tensors)
    with torch.no_grad():
        return [0 if t is None or bool(t.isfinite().all()) else 1 for t in tensors]


def _any_nonfinite(tensors: list[Tensor]) -> bool:
    """Whether some element of `tensors` may be NaN or inf: one call of the scaler's check
    where it applies, a sum each elsewhere (see [Note: one op asks whether anything is
    non-finite]). Never False where one is; True now and then for large finite sums."""
    scaled: list[Tensor] = []
    rest: list[Tensor] = []
    for t in tensors:  # (one that requires grad, the loss, is read, not written back)
        one_call = t.dtype in _SCALED_DTYPES and t.device.type == "cpu" and not t.requires_grad
        (scaled if one_call else rest).append(t)
    if scaled:
        found = _FOUND.flag
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(scaled, found, _FOUND.one)
        except (RuntimeError, NotImplementedError):  # overlapping memory (an expanded tensor)
            found.zero_()
            rest = tensors
        else:
            if found.item():
                found.zero_()
                return True
    if all(t.dim() == 0 for t in rest):  # (the usual rest: the loss, read as it is)
        return not all(cmath.isfinite(t.item()) for t in rest)
    with torch.no_grad():  # (one context, not a detach per tensor)
        return not all(cmath.isfinite(t.sum().item()) for t in rest)
