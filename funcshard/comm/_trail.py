"""A checksum of the collectives each rank issued since the last step's end, compared across
ranks where a step already communicates: the non-finite check's collective.

[Note: the collectives' trail]
Ranks that issue different collectives of the same size pair them without a word on NCCL,
and on gloo's all-reduces (the exchanges carry headers: see [Note: the exchange's header in
its tag] in comm/_exchange.py): a DDP rank reducing one bucket while another reduces a
bucket of the same size averages two different gradients. Comparing each collective first
(`Mesh(check_collectives=True)`) costs a collective per collective. So, by default, each
rank folds every eager collective it issues (its op, element count, dtype and unit; the
count agreed where sizes differ by rank) into a running checksum of the collective's
group, a multiply and two dictionary lookups per collective, and the step's verdict on
non-finite values carries the checksum of the mesh's own groups (the whole mesh, its shard
and replicate axes, in that order) and the number of their collectives since the last
verdict (funcshard/step/_finite.py): at the step's end every rank sees every rank's trail,
and ranks whose trails differ raise `CollectiveError` together before any update.
Collectives over other groups (a metric over some of the ranks) are not compared: those
groups' members differ from the mesh's. It names the ranks and how many collectives
each issued, not the first that differed (`check_collectives=True` does). On NCCL this is
the cheap check beside the flight recorder: one all-gather of a few int64 per step, which
the step issues anyway. Collectives inside compiled graphs are not followed (their
bookkeeping is outside the graph), nor are collectives a rank issues over a group of one;
and since a rank might run a step compiled while another runs it eagerly (a recompile
limit reached on one rank), a trail that spans a call of `fs.compile` is not compared.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from funcshard.comm import _exchange as exchange
from funcshard.comm._failures import CollectiveError

_MODULUS = 1 << 61


_TRAILS: dict[str, tuple[int, int]] = {}  # group name -> (checksum, collectives)
UNKNOWN = -1  # a trail's checksum where a compiled call ran since the last `take`


class _Compiled:
    ran = False  # whether a compiled call ran since the last `take`


def compiled_call() -> None:
    """Note that a compiled call ran: its collectives were not followed, so the trail up to
    the next `take` is not compared."""
    _Compiled.ran = True


def follow(op: str, numel: int, dtype: torch.dtype, what: str | None, group: str) -> None:
    """Fold one collective over the group named `group` into its trail."""
    code = exchange.described(op, what, numel, dtype) + 1  # (+1: never a zero term)
    checksum, count = _TRAILS.get(group, (0, 0))
    _TRAILS[group] = ((checksum * 1_000_003 + code) % _MODULUS, count + 1)


def take(groups: Sequence[str]) -> tuple[int, int]:
    """The trail of these groups (the mesh's, in a fixed order of roles, each once) since
    the last `take` of them: (checksum, collectives); theirs start anew."""
    checksum, count = 0, 0
    for group in dict.fromkeys(groups):
        code, n = _TRAILS.pop(group, (0, 0))
        checksum, count = (checksum * 1_000_003 + code) % _MODULUS, count + n
    if _Compiled.ran:
        _Compiled.ran = False
        return UNKNOWN, count
    return checksum, count


def forget() -> None:
    """Start every trail anew (a new task of the test runner, a new start)."""
    _TRAILS.clear()
    _Compiled.ran = False


def check(ranks: list[int], trails: list[list[int]]) -> None:
    """Raise CollectiveError (on every rank: every rank reads the same trails) when the
    ranks' trails (checksum, count) differ."""
    if all(t == trails[0] for t in trails) or any(t[0] == UNKNOWN for t in trails):
        return
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, t in zip(ranks, trails, strict=True):
        groups.setdefault(tuple(t), []).append(rank)
    told = "; ".join(
        f"ranks {rs}: {t[1]} collectives, checksum {t[0]:x}" for t, rs in groups.items()
    )
    raise CollectiveError(
        f"rank {dist.get_rank()}: the ranks issued different collectives in this step "
        f"(compared at its end with the non-finite check: the op, size, dtype and unit of "
        f"each): {told}. Collectives of equal sizes paired up, so this step's gradients may "
        f"mix different tensors: no update was applied. A forward or a collective call on "
        f"some ranks only (`if rank == 0:`) does this; Mesh(check_collectives=True) names "
        f"the first collective that differs."
    )
