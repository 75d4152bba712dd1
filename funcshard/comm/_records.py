"""What `collectives.record()` collects: one `Record` per collective issued, and the bytes
one rank sends for them.

[Note: recorded sizes of an uneven exchange]
A record's `numel` is the collective's buffer as every rank issues it (the padded buffer
of an owned unit), the same on every rank, so logs compare across ranks. An owned unit's
gloo exchange sends less than that buffer says (see [Note: the uneven exchange] in
funcshard/comm/_exchange.py), and each rank a different amount; its record carries `sent`,
the elements this rank sends, which `bytes_sent` counts instead of the ring formula. `sent`
takes no part in a record's equality.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Record:
    """One collective as issued: for tests that check communication against a formula."""

    op: str
    ranks: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    sent: int | None = field(default=None, compare=False)  # elements this rank sends, where
    # the exchange is uneven (see [Note: recorded sizes of an uneven exchange])


recording: list[list[Record]] = []


def bytes_sent(records: list[Record]) -> int:
    """Bytes one rank sends for these collectives with ring algorithms: an all-gather sends its
    shard to the group's other ranks, a reduce-scatter (size - 1) of its chunks, an all-reduce
    2 (size - 1) / size of its buffer; an uneven exchange what it sent (`Record.sent`)."""
    sent = 0
    for r in records:
        size, item = len(r.ranks), r.dtype.itemsize
        if r.sent is not None:
            sent += r.sent * item
        elif r.op == "all_gather":
            sent += (size - 1) * r.numel * item
        elif r.op in ("reduce_scatter", "all_to_all"):
            sent += (size - 1) * (r.numel // size) * item
        else:
            sent += 2 * (size - 1) * r.numel * item // size
    return sent


@contextlib.contextmanager
def record() -> Iterator[list[Record]]:
    """Collect every collective issued inside the block (size-1 groups issue none), eagerly
    or under make_fx; not those inside a torch.compile'd graph (see [Note: bookkeeping
    outside compiled graphs] in funcshard/comm/_collectives.py). Blocks nest: each collects
    what was issued inside it."""
    log: list[Record] = []
    recording.append(log)
    try:
        yield log
    finally:  # by identity: a nested block's log equals its outer one's (the same records)
        del recording[next(i for i, kept in enumerate(recording) if kept is log)]
