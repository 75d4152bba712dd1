"""Answers for the yes/no questions a model asks of its batch, when the batch is on meta.

[Note: a plain batch's answers]
A meta tensor holds no values, so `bool(t)` or `t.item()` fails there. Models ask such
questions of their inputs before any kernel runs: transformers' mask code checks
`(packed_sequence_mask[:, -1] == 0).all()` (one sequence per row?) and
`padding_mask.all()` (no padding?) to skip building an (S x S) mask when it can, whenever
it has no cache (training, `use_cache=False`, activation checkpointing). The dry run plans
the step of a plain training batch: no padding, no packing, every value finite. So the
answer of a reduction `all` over a meta tensor is True and of `any` is False: every
element passes an `all` check, and none trips an `any` one. Only those two reductions are
answered, and only when their result is asked for as a Python bool or number; any other
`.item()` on meta still fails, with the dry run's message naming the fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

_ALL = {torch.all, Tensor.all}
_ANY = {torch.any, Tensor.any}
_READ = {Tensor.__bool__, Tensor.item}
_ANSWER = "_funcshard_plain_batch_answer"  # set on the result of an all/any on meta


class PlainBatch(TorchFunctionMode):
    """Answer `all`/`any` of meta tensors as a plain batch would (see [Note: a plain batch's
    answers])."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _READ and args and hasattr(args[0], _ANSWER):
            return getattr(args[0], _ANSWER)
        out = func(*args, **kwargs)
        if (func in _ALL or func in _ANY) and _is_meta_scalar(out):
            setattr(out, _ANSWER, func in _ALL)
        return out


def _is_meta_scalar(out: Any) -> bool:
    return isinstance(out, Tensor) and out.device.type == "meta" and out.numel() == 1
