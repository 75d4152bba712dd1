"""The user's gather and reduce of one flat buffer (a `funcshard.Comm`'s, see [Note:
communication as user functions] in funcshard/comm/_comm.py): called, their results checked and
cast.
"""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor

from funcshard.step._gather_spec import GatherSpec


def user_gather(shard: Tensor, spec: GatherSpec) -> Tensor:
    """The user's gather of one buffer (see [Note: communication as user functions]), its
    result checked and cast to the gather dtype."""
    assert spec.comm is not None and spec.comm.gather is not None
    full = spec.comm.gather(shard.to(spec.mesh.device), spec.axis)
    _check_user_result(full, spec.flat.padded_numel, spec, "gather")
    return full.reshape(-1).to(spec.gather_dtype)


def _check_user_result(out: object, numel: int, spec: GatherSpec, which: str) -> None:
    if not isinstance(out, Tensor) or out.numel() != numel:
        got = f"{tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"funcshard.Comm: the {which} of unit {spec.flat.unit!r} must return a tensor of "
            f"{numel} elements (the flat buffer's {'whole' if which == 'gather' else 'shard'}"
            f"), got {got}."
        )


def user_reduce(grad: Tensor, spec: GatherSpec, carry: Any = None) -> Any:
    """The user's reduce of one buffer's full gradient over the shard axis, or a DDP
    buffer's over the replicate axis (see [Note: communication as user functions]): this
    rank's chunk of the mean (a DDP buffer's whole mean), in `grad`'s dtype; with a carry,
    `(chunk, new carry)`."""
    assert spec.comm is not None and spec.comm.reduce is not None
    axis = spec.axis
    if carry is None:
        out, new_carry = spec.comm.reduce(grad, axis), None
    else:
        out = spec.comm.reduce(grad, axis, carry)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(
                f"funcshard.Comm: a reduce given a carry must return (shard, carry), got "
                f"{type(out).__name__} for unit {spec.flat.unit!r}."
            )
        out, new_carry = out
    _check_user_result(out, spec.flat.shard_numel, spec, "reduce")
    out = cast(Tensor, out).reshape(-1).to(grad.dtype)  # a tensor: checked just above
    return out if carry is None else (out, new_carry)
