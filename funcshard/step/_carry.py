"""The carry of a user's reduce (see [Note: communication as user functions] in
funcshard/comm/_comm.py): one full-size buffer per trainable flat buffer of a state, threaded
through `value_and_grad` and `reduce` by the user."""

from __future__ import annotations

import torch
from torch import Tensor

from funcshard.core._precision import reduce_dtype
from funcshard.core._state import ShardedState


def carry_zeros(state: ShardedState) -> tuple[Tensor | None, ...]:
    """A reduce's carry at its start: per flat buffer of `state`, a full-size (padded) zero
    buffer in its reduce dtype, None for frozen buffers (see [Note: communication as user
    functions]: the whole model's gradient size on every rank)."""
    device = state.layout.mesh.device
    return tuple(
        None
        if flat.frozen
        else torch.zeros(flat.padded_numel, dtype=reduce_dtype(state.mp, flat), device=device)
        for flat in state.layout.flats
    )


def check_carry(carry: object, state: ShardedState, where: str) -> tuple[Tensor | None, ...]:
    """`carry` as a tuple lined up with the state's flat buffers, or a ValueError that says
    what is expected (checked before any collective)."""
    flats = state.layout.flats
    if not isinstance(carry, tuple | list) or len(carry) != len(flats):
        n = len(carry) if isinstance(carry, tuple | list) else type(carry).__name__
        raise ValueError(
            f"funcshard.{where}: carry must hold one entry per flat buffer of the state "
            f"({len(flats)}), got {n}. Start from funcshard.carry_zeros(state)."
        )
    for flat, c in zip(flats, carry, strict=True):
        if flat.frozen and c is not None:
            raise ValueError(
                f"funcshard.{where}: carry of unit {flat.unit!r} must be None: the buffer is "
                f"frozen and has no gradient to reduce."
            )
        if not flat.frozen and c is None:
            raise ValueError(
                f"funcshard.{where}: carry of unit {flat.unit!r} is None, but the buffer is "
                f"trainable and its reduce needs its state. Start from "
                f"funcshard.carry_zeros(state)."
            )
    return tuple(carry)
