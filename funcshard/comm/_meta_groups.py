"""A process group for the dry run on the meta device: sizes, no communication.

[Note: collectives on a meta group]
`funcshard.estimate` runs the optimizer's real `init` and `update` on meta shards (see
[Note: the optimizer on a meta state] in funcshard/planning/_meta_state.py). Some
optimizers communicate: clipping all-reduces a norm, a weight-decay mask's per-parameter
sums cross the shard axis, `whole_params` exchanges pieces with their owners. There is no
process group in the estimating process, and it may be a rank of a real job whose groups
must not see these calls. So the meta state's mesh holds `MetaGroup`s: they know their
size and say this process is their rank 0. Each collective of funcshard/comm/_collectives.py
returns at once on one, with a new meta tensor of its result's size (what the real call
allocates), and records, counts and checks nothing. Only meta tensors go through one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class MetaGroup:
    """Stands for a process group of `n` ranks in a dry run; this process is rank 0."""

    def __init__(self, n: int) -> None:
        self._size = n
        self.group_name = f"<meta group of {n}>"

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"MetaGroup({self._size})"


def is_meta(group: Any) -> bool:
    """Whether `group` is the dry run's (collectives over it allocate their result only)."""
    return isinstance(group, MetaGroup)


def result(op: str, tensor: Tensor, group: Any, numel: int | None = None) -> Tensor:
    """What collective `op` over `group` returns without communicating: the input itself
    over a real one-rank group; over a MetaGroup, a new meta tensor of the result's size
    (`numel` elements for an uneven all-to-all)."""
    if not is_meta(group):
        return tensor
    if tensor.device.type != "meta" and tensor.numel():  # (an empty send may be on the CPU)
        raise RuntimeError(f"funcshard: a {op} of a {tensor.device} tensor over a {group!r}.")
    n = group.size()
    shape = {"all_gather": (tensor.numel() * n,), "reduce_scatter": (tensor.numel() // n,)}
    return torch.empty(  # all-reduce into a copy, all-to-all, broadcast: the input's shape
        shape.get(op, tensor.shape if numel is None else (numel,)),
        dtype=tensor.dtype,
        device="meta",
    )
