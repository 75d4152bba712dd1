"""Values that differ across the ranks that would store one copy: found at save, given back
to the rank that saved them.

[Note: per-rank leaves]
torch.distributed.checkpoint writes a tensor that several ranks hold once, from whichever
rank it picks, so a value that differs across ranks (a per-rank counter, an error-feedback
residual, the `extra` of each rank's data position, HSDP replicas that diverge on purpose
between DiLoCo's outer steps) would come back as one rank's everywhere, and the checksums
of the written files cannot show it. So before anything is written every rank digests
(BLAKE2b of the bytes, with dtype and shape; the value itself for Python numbers) each
leaf it would share a copy of, and one all-gather of the digests decides, the same way on
every rank:
- an optimizer leaf not laid out like the shards, a replicated parameter, a Python number
  in the optimizer state, `extra`: compared across every rank that holds it (all ranks, or
  for owned state the replicas holding that parameter's key). Equal: saved once, as
  before. Different: saved once per rank, tensors under `rank/<r>/<key>`, numbers and
  `extra` in funcshard.json as a list by rank;
- the shards of a flat buffer and the moments lined up with them: compared across the
  replicate axis (ranks with the same shard rank); only computed on meshes with replicas.
  Different: the whole flat is saved per replica, `replica/<q>/<key>`, each still sharded
  over the shard axis.
- buffers keep their rule: the mesh's first rank's, on purpose (see `_first_ranks_buffers`).
A load on a mesh of the same shape gives rank r (replica q) back what rank r (replica q)
saved. On any other mesh it refuses naming the leaves, unless `load(per_rank=...)` says
what to do: `"like"` keeps `like`'s values for them, `r` (an int) gives every rank what
rank r saved (for per-replica leaves, the replica rank r was in).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor

RANK = "rank"
REPLICA = "replica"


def digest(value: Any) -> Any:
    """A small value that differs when `value` does (bytes, dtype and shape of a tensor)."""
    if not isinstance(value, Tensor):
        return (type(value).__name__, repr(value))
    data = value.detach().reshape(-1).contiguous().cpu()
    h = hashlib.blake2b(digest_size=16)
    if data.numel():
        h.update(data.view(torch.uint8).numpy().tobytes())
    return (str(value.dtype), tuple(value.shape), h.hexdigest())


def differing(reports: list[dict[str, Any]]) -> set[str]:
    """The keys whose digests differ among the ranks that report them."""
    seen: dict[str, Any] = {}
    out = set()
    for report in reports:
        for key, d in report.items():
            if seen.setdefault(key, d) != d:
                out.add(key)
    return out


def differing_replicas(reports: list[dict[str, Any]], shard_ranks: list[int]) -> set[str]:
    """The keys whose digests differ among ranks of the same shard rank (across replicas)."""
    columns: dict[int, list[dict[str, Any]]] = {}
    for report, shard_rank in zip(reports, shard_ranks, strict=True):
        columns.setdefault(shard_rank, []).append(report)
    return set().union(*(differing(column) for column in columns.values()))


def rank_key(rank: int, key: str) -> str:
    return f"{RANK}/{rank}/{key}"


def replica_key(replica: int, key: str) -> str:
    return f"{REPLICA}/{replica}/{key}"


def base_key(key: str) -> str:
    """A stored key without its `rank/<r>/` or `replica/<q>/` prefix."""
    head, _, rest = key.partition("/")
    if head in (RANK, REPLICA):
        return rest.partition("/")[2]
    return key


def check_option(per_rank: Any) -> None:
    """Refuse a `per_rank=` that is neither "refuse", "like" nor a rank (an int >= 0)."""
    if per_rank in ("refuse", "like") or (
        isinstance(per_rank, int) and not isinstance(per_rank, bool) and per_rank >= 0
    ):
        return
    raise ValueError(
        f"funcshard.checkpoint.load: per_rank must be 'refuse', 'like' or a rank (an int >= "
        f"0), got {per_rank!r}. See [Note: per-rank leaves] in funcshard/io/_rank_values.py."
    )


def source(
    saved: tuple[int, int], here: tuple[int, int], rank: int, per_rank: Any
) -> tuple[int, int] | str | None:
    """Where this rank takes per-rank and per-replica values from: (saved rank, saved
    replica); None to keep `like`'s; or a sentence saying why neither works."""
    if per_rank == "like":
        return None
    if isinstance(per_rank, int) and not isinstance(per_rank, bool):
        if per_rank >= saved[0] * saved[1]:
            return f"per_rank={per_rank}, but the saving mesh had {saved[0] * saved[1]} ranks"
        return per_rank, per_rank // saved[1]
    if tuple(saved) == tuple(here):
        return rank, rank // here[1]
    return (
        f"they were saved on a mesh of replicate={saved[0]}, shard={saved[1]} and this mesh "
        f"is replicate={here[0]}, shard={here[1]}"
    )
