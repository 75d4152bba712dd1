"""What a rank knows of its process groups: its rank, a group's members, how many collectives
a group carried. For the modules that may not name torch.distributed themselves."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup

from funcshard.comm import _meta_groups as meta_groups


def global_rank() -> int:
    """This process's rank in the default group (0 when there is none)."""
    return dist.get_rank() if dist.is_initialized() else 0


def issued_count(group: ProcessGroup) -> int | None:
    """How many collectives this rank has issued on `group` (the backend's sequence number,
    gloo's and NCCL's alike), or None where the backend keeps none."""
    try:
        # private torch API, absent from its stubs
        return group._get_sequence_number_for_group()  # type: ignore[attr-defined]
    except (RuntimeError, AttributeError):
        return None


def group_ranks(group: ProcessGroup) -> list[int]:
    """The global ranks of the group's members, in group order."""
    return dist.get_process_group_ranks(group)


def group_rank(group: ProcessGroup) -> int:
    """This process's rank within `group` (a dry run's MetaGroup: 0)."""
    return group.rank() if meta_groups.is_meta(group) else dist.get_rank(group)
