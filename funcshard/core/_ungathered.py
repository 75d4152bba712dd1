"""What a unit's parameter slot holds while the unit is not gathered: a placeholder that
answers metadata and refuses any computation, naming the parameter and the unit.

[Note: placeholders that refuse to compute]
Between calls, and during a call outside its unit's forward, a parameter slot cannot hold
the parameter: only the shard exists. It used to hold a plain meta tensor, on the theory
that any use would fail. Many do, but not all: a convolution, `mm`, a 3-D by 2-D `matmul`,
a bias-free `F.linear` or `baddbmm` given a CPU input and a meta weight dispatch to their
meta kernels, which check no devices and allocate their output like the first operand: an
uninitialized CPU tensor, computed from nothing (a unit reached through
`vit.forward_features` gave losses of 1e21, different on every run, with a zero gradient).
So the placeholder is a wrapper subclass on the meta device whose every dispatched op
raises `UngatheredParameterError`, except the size and stride queries a wrapper answers
through dispatch. Metadata read in Python (`.shape`, `.dtype`, `.device`, `.requires_grad`,
what Hugging Face models read from other modules' parameters) never dispatches, and
`__torch_function__` is disabled, so the placeholder costs nothing until something
computes with it. Placeholders are built once per binding and swapped in and out.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as torch_pytree

_aten = torch.ops.aten
_META = torch.device("meta")
_METADATA = frozenset(
    {
        _aten.sym_size.default,
        _aten.sym_size.int,
        _aten.sym_stride.default,
        _aten.sym_stride.int,
        _aten.sym_numel.default,
        _aten.sym_storage_offset.default,
        _aten.dim.default,
        _aten.is_same_size.default,
    }
)


class UngatheredParameterError(RuntimeError):
    """Code computed with a unit's parameter while the unit was not gathered."""


class Ungathered(Tensor):
    """Stands in a parameter slot of unit `unit` (module `module`) while it is not gathered."""

    fqn: str
    unit: str
    module: nn.Module | None

    @staticmethod
    def __new__(
        cls, shape: tuple[int, ...], dtype: torch.dtype, fqn: str, unit: str, module: Any
    ) -> Ungathered:
        made = Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=_META)
        made.fqn, made.unit, made.module = fqn, unit, module
        return made

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # (torch's stub omits `func`)
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            return func(*[_as_meta(a) for a in args], **kwargs)
        read = next(
            a for a in torch_pytree.tree_leaves((args, kwargs)) if isinstance(a, Ungathered)
        )
        raise UngatheredParameterError(read.refusal(func.__name__))

    def refusal(self, op: str) -> str:
        """Why `op` may not read this parameter now, and what to do instead."""
        module = type(self.module).__name__ if self.module is not None else "the unit's module"
        method = _calling_method(self.module)
        through = f" (it ran inside {module}.{method})" if method else ""
        fix = (
            f"fs.plan(..., forward_methods={{{self.unit!r}: {method!r}}})"
            if method
            else f"fs.plan(..., forward_methods={{{self.unit!r}: '<method>'}})"
        )
        return (
            f"funcshard: {op} read parameter {self.fqn!r} of unit {self.unit!r} while the "
            f"unit was not gathered{through}: a unit's parameters are in place only while "
            f"its module's forward ({module}.forward) runs. Call the module itself, or, if "
            f"code outside calls another method of it, name that method on the plan: {fix}."
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"Ungathered({self.fqn!r} of unit {self.unit!r}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype})"
        )


def _as_meta(x: Any) -> Any:
    if isinstance(x, Ungathered):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _calling_method(module: nn.Module | None) -> str | None:
    """The outermost method of `module` on the stack (an error path only): the method code
    outside the unit called instead of its forward."""
    if module is None:
        return None
    found = None
    for frame in inspect.stack(context=0):
        if frame.frame.f_locals.get("self") is module and frame.filename != _MODULE_FILE:
            found = frame.function  # (not nn.Module's own call machinery)
    return found


_MODULE_FILE = inspect.getfile(nn.Module)
