"""Applying funcshard's autograd Functions (the gather, the reduce, the wait nodes) without
torch's argument binding, which `Function.apply` repeats on every call: they run per unit and step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor


def apply_function(function: type[torch.autograd.Function], *args: Any) -> Any:
    """`function.apply(*args)` with every argument given positionally.

    `Function.apply` of a setup_context-style function binds the arguments through
    `inspect.signature` first, ~30 us a call and the largest part of funcshard's own CPU
    time per unit; outside torch.func transforms and dynamo it then only unwraps tensors
    left over from finished transforms and calls the C++ apply, which this does directly."""
    if torch._C._are_functorch_transforms_active() or torch.compiler.is_dynamo_compiling():
        return function.apply(*args)
    unwrap = torch._C._functorch.unwrap_if_dead
    unwrapped = [unwrap(a) if isinstance(a, Tensor) else a for a in args]  # (a list
    # comprehension: a generator resumes once per item, and this runs per unit and step)
    # the C++ apply of torch._C._FunctionBase, absent from torch's stubs
    return super(torch.autograd.Function, function).apply(*unwrapped)  # type: ignore[misc]


def has_tangent(tensor: Tensor) -> bool:
    """Whether `tensor` carries a forward-mode tangent (`torch.func.jvp`, `forward_ad`):
    then an op needs the variant of its Function that defines `jvp`, which dynamo refuses
    to trace (so the plain one, without it, is what compiled steps meet)."""
    if torch.compiler.is_dynamo_compiling():
        return False
    return fwAD.unpack_dual(tensor).tangent is not None


def forward_mode(tensor: Tensor) -> bool:
    """Whether an op on `tensor` may be differentiated in forward mode, so it needs the
    variant of its Function that defines `jvp`: `tensor` has a tangent, or torch.func
    transforms are active (a tangent at an outer level, as in `jvp` of `grad`, is not
    visible on the inner level's tensors)."""
    if torch.compiler.is_dynamo_compiling():
        return False
    return torch._C._are_functorch_transforms_active() or has_tangent(tensor)
