"""Cross-rank checks of collectives (Mesh(check_collectives=True)): before each collective on a
checked group, the ranks compare what they are about to issue, and a mismatch raises on every
rank, naming each rank's collective, instead of corrupting data or hanging in gloo."""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from funcshard.comm import _exchange as exchange
from funcshard.comm._failures import CollectiveError, unit_words

_checked_groups: set[str] = set()
_OP_CODES = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "all_to_all": 4}

Described = tuple[str, int, str, "str | None"]  # (op, element count, dtype, unit)


def check_group(group: ProcessGroup) -> None:
    """Compare every later collective on `group` across its ranks before issuing it
    (op, element count, dtype, unit): a mismatch raises on every rank instead of corrupting
    data or hanging in gloo. One small all-gather per collective: for debugging."""
    if group.size() > 1:
        _checked_groups.add(group.group_name)


def checked(group: ProcessGroup) -> bool:
    """Whether the collectives on `group` are compared across its ranks first."""
    return group.group_name in _checked_groups


def forget_checked_groups() -> None:
    """Drop every group's check and backend (their names may be reused once the groups are
    destroyed)."""
    _checked_groups.clear()
    exchange.forget_groups()


def described(op: str, tensor: Tensor, what: str | None, agreed: int | None = None) -> Described:
    """What the ranks compare: the op, the element count (`agreed` where sizes differ by
    rank), the dtype and the unit."""
    numel = tensor.numel() if agreed is None else agreed
    return (op, numel, str(tensor.dtype), what)


def code(mine: Described, device: torch.device) -> Tensor:
    """`mine` as the int64s the check gathers: (3,)."""
    op, numel, dtype, what = mine
    code = [_OP_CODES[op], numel, zlib.crc32(f"{dtype}|{what}".encode())]
    return torch.tensor(code, dtype=torch.int64, device=device)


def agree(rows: Tensor, mine: Described, group: ProcessGroup) -> None:
    """Return if every rank's code (`rows`, gathered: (group size, 3)) is the same; otherwise
    raise on every rank, naming each rank's collective."""
    if bool((rows == rows[0]).all()):
        return
    ranks = dist.get_process_group_ranks(group)
    theirs: list[Any] = [None] * group.size()
    dist.all_gather_object(theirs, mine, group=group)
    lines = "\n".join(
        f"  rank {r}: {o} of {n} x {d}" + unit_words(w, "for")
        for r, (o, n, d, w) in zip(ranks, theirs, strict=True)
    )
    raise CollectiveError(
        f"rank {dist.get_rank()}: the ranks of group {ranks} are about to issue different "
        f"collectives:\n{lines}\nEvery rank must run the same units in the same order with "
        f"the same shapes and dtypes: check that every rank built the same model and plan and "
        f"that batch shapes do not change which modules run."
    )
