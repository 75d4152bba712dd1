"""Applying funcshard's autograd Functions (the gather, the reduce, the wait nodes) without
torch's argument binding, which `Function.apply` repeats on every call: they run per unit and step.
"""

from __future__ import annotations

from typing import Any

import torch
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
