"""Mixed precision: the dtypes parameters are gathered in, gradients reduced in, outputs cast to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import optree
import torch
from torch import Tensor


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for one training step; `None` keeps each parameter's own dtype.

    The sharded master copy and the optimizer state always stay in the original dtype:
    `param_dtype` applies to the gathered copy, `reduce_dtype` to the gradient reduction, and
    `output_dtype` to the model's floating-point outputs. `cast_inputs` casts floating-point
    inputs to `param_dtype` before the model runs, and, eagerly, each unit's inputs before
    the unit runs (as FSDP2 does; not keep_fp32 units; not yet in compiled steps).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (
                isinstance(dtype, torch.dtype) and dtype.is_floating_point
            ):
                raise TypeError(
                    f"MixedPrecision: {name} must be a floating-point torch.dtype or None, "
                    f"got {dtype!r}."
                )

    def reduce_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of a parameter of `param_dtype` are reduced in."""
        return self.reduce_dtype or self.param_dtype or param_dtype


class FlatLayout(Protocol):
    """What the dtype helpers read of a flat buffer (funcshard.core._layout.FlatLayout)."""

    @property
    def unit(self) -> str: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def mp(self) -> MixedPrecision | None: ...


def unit_policy(mp: MixedPrecision | None, flat: FlatLayout) -> MixedPrecision | None:
    """The policy a flat buffer's unit runs under: its own (`plan(mp=...)`, keep_fp32's
    `MixedPrecision()`) or else the state's `mp`."""
    return mp if flat.mp is None else flat.mp


def root_policy(mp: MixedPrecision | None, flats: Sequence[FlatLayout]) -> MixedPrecision | None:
    """The root unit's policy (see `unit_policy`): what the model's inputs are cast with and
    its outputs cast to."""
    for flat in reversed(flats):  # (the root's buffers come last)
        if flat.unit == "":
            return unit_policy(mp, flat)
    return mp


def gather_dtype(mp: MixedPrecision | None, flat: FlatLayout) -> torch.dtype:
    """The dtype a flat buffer is gathered (and computed) in."""
    mp = unit_policy(mp, flat)
    if mp is None or mp.param_dtype is None:
        return flat.dtype
    return mp.param_dtype


def reduce_dtype(mp: MixedPrecision | None, flat: FlatLayout) -> torch.dtype:
    """The dtype a flat buffer's gradients are reduced in."""
    mp = unit_policy(mp, flat)
    if mp is None:
        return flat.dtype
    return mp.reduce_dtype_for(flat.dtype)


def cast_inputs(mp: MixedPrecision | None, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Floating-point inputs cast to `mp.param_dtype` when the policy asks for it."""
    if mp is None or not mp.cast_inputs or mp.param_dtype is None:
        return args, kwargs
    to = mp.param_dtype

    def cast(x: Any) -> Any:
        if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != to:
            return x.to(to)
        return x

    if not kwargs and all([isinstance(x, Tensor) for x in args]):  # the common case, cheaply
        return tuple([cast(x) for x in args]), kwargs
    # tree_map keeps the containers' types, but optree's stubs type a tree as optree's own
    # PyTree class, which no tuple or dict is
    return (
        optree.tree_map(cast, args),  # type: ignore[arg-type]
        optree.tree_map(cast, kwargs),  # type: ignore[arg-type]
    )  # type: ignore[return-value]


def casts_unit_inputs(mp: MixedPrecision | None, flat: FlatLayout) -> bool:
    """Whether a unit's floating-point inputs are cast (`cast_inputs`, to its policy's
    `param_dtype`) when it runs, as FSDP2 casts each module's, so an fp32 activation (a
    buffer added, a keep_fp32 unit's output) reaches the next unit in its compute dtype.
    Not for keep_fp32 units (no param_dtype), which take their inputs as they come."""
    mp = unit_policy(mp, flat)
    return mp is not None and mp.cast_inputs and mp.param_dtype is not None


def casts_unit_outputs(mp: MixedPrecision | None, flat: FlatLayout) -> bool:
    """Whether a unit's floating-point outputs are cast to an `output_dtype` when it
    returns: only a unit's own policy's (the state's applies to the model's outputs)."""
    return flat.mp is not None and flat.mp.output_dtype is not None


def cast_outputs(mp: MixedPrecision | None, out: Any) -> Any:
    """Floating-point outputs cast to `mp.output_dtype`, if set."""
    if mp is None or mp.output_dtype is None:
        return out
    return optree.tree_map(
        lambda x: x.to(mp.output_dtype) if isinstance(x, Tensor) and x.is_floating_point() else x,
        out,
    )
