"""Which stored key each entry of `like` loads from, checked on every rank before a byte is read.

A checkpoint's keys are its entries' (see [Note: checkpoints] in funcshard/io/_checkpoint.py),
except values saved per rank or per replica, stored under `rank/<r>/` or `replica/<q>/`
([Note: per-rank leaves] in funcshard/io/_rank_values.py). A load maps each of `like`'s entries
to the stored key it reads, compares the stored keys with every rank's (owned state: each
rank holds some of the keys; `like=(state, None)`: the optimizer's stay on disk) and raises
the same error on every rank, naming the keys, before DCP reads anything.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from funcshard.comm import _collectives as collectives
from funcshard.core._tree import format_names
from funcshard.io import _dcp as dcp
from funcshard.io import _rank_values as rank_values


class LoadPlan:
    """Which stored key each of `like`'s entries loads from (see [Note: per-rank leaves])."""

    def __init__(self, directory: str, meta: dict, here: tuple, rank: int, per_rank: Any):
        self.directory, self.meta, self.rank = directory, meta, rank
        saved_mesh = tuple(meta.get("mesh", here))
        self.source = rank_values.source(saved_mesh, here, rank, per_rank)
        self.per_rank = set(meta.get("per_rank", ())) | set(meta.get("rank_scalars", {}))
        self.per_replica = set(meta.get("per_replica", ()))

    def route(self, template: dict, like_scalars: dict) -> tuple[dict, list, dict, list]:
        """(stored key -> entry to load into, keys that keep like's, scalars, problems)."""
        routed, kept, problems = {}, [], []
        for key, value in template.items():
            where = self.where(key)
            if where is None:
                kept.append(key)
            elif isinstance(where, str):
                routed[where] = value
            else:
                problems.append(key)
        scalars = {}
        stored, by_rank = self.meta.get("scalars"), self.meta.get("rank_scalars", {})
        for key, leaf in like_scalars.items():
            if stored is None:  # saved before numbers were: keep like's
                scalars[key] = leaf
            elif key in by_rank:
                if isinstance(self.source, tuple) and str(self.source[0]) in by_rank[key]:
                    scalars[key] = by_rank[key][str(self.source[0])]
                elif self.source is None:
                    scalars[key] = leaf
                else:
                    problems.append(key)
            elif key in stored:
                scalars[key] = stored[key]
        if problems:
            problems = [self.refusal(problems)]
        return routed, kept, scalars, problems

    def where(self, key: str) -> str | bool | None:
        """The stored key for `key`; None: keep like's; False: cannot be given back here."""
        if key not in self.per_rank and key not in self.per_replica:
            return key
        if self.source is None:
            return None
        if isinstance(self.source, str):
            return False
        if key in self.per_replica:
            return rank_values.replica_key(self.source[1], key)
        return rank_values.rank_key(self.source[0], key)

    def refusal(self, keys: list[str]) -> str:
        why = self.source if isinstance(self.source, str) else "that rank saved none of them"
        return (
            f"{format_names(sorted(keys))} differed across ranks when saved, so each rank's "
            f"own was stored, and {why}. Load on the saving mesh, or pass per_rank='like' to "
            f"keep like's values for them, or per_rank=r to give every rank rank r's."
        )

    def extra(self) -> Any:
        """`extra` as saved, or this rank's where ranks saved different ones."""
        if "rank_extra" not in self.meta:
            return self.meta["extra"]
        if self.source is None:
            return None
        if isinstance(self.source, tuple):
            return self.meta["rank_extra"][self.source[0]]
        raise ValueError(self.refusal(["extra"]))


def shape_problems(saved: dict, routed: dict) -> list[str]:
    return [
        f"{k} (saved {saved[k]}, expected {dcp.global_size(v)})"
        for k, v in routed.items()
        if k in saved and saved[k] != dcp.global_size(v)
    ]


def agree_on_keys(directory, saved, meta, report, with_optim, group) -> None:
    """Compare the stored keys with every rank's (owned state: each rank holds some of the
    keys) and raise the same error on every rank. Communicates: one all-gather."""
    reports = collectives.all_gather_object(report, group)
    wanted = {k for r in reports for k in r[0]}
    stored = {rank_values.base_key(k) for k in saved}
    stored = {k for k in stored if not k.startswith("extra/")}  # extra's: never a mismatch
    if meta.get("scalars") is not None:
        # a None stored by older saves holds nothing (see [Note: optimizer leaves in
        # checkpoints]): like's entry, whatever it is, is not asked to match it
        stored |= {k for k, v in meta["scalars"].items() if v is not None}
        stored |= set(meta.get("rank_scalars", {}))
    if not with_optim:  # parameters alone: the optimizer state stays on disk
        stored = {k for k in stored if not k.startswith("optim/")}
    missing = sorted({k for r in reports for k in r[0]} - stored - {"extra"})
    missing = [k for k in missing if not k.startswith("extra/")]
    missing = [k for k in missing if not migrated(k)]  # (a newer format's: like's stay)
    unexpected = sorted(stored - wanted)
    wrong = sorted({p for r in reports for p in r[2]})
    refused = sorted({p for r in reports for p in r[1]})
    if refused:
        raise ValueError(f"funcshard.checkpoint.load: {directory!r}: {refused[0]}")
    if missing or unexpected or wrong:
        raise ValueError(
            f"funcshard.checkpoint.load: {directory!r} does not match the state: missing "
            f"{format_names(missing) or 'none'}; unexpected {format_names(unexpected) or 'none'}; "
            f"shape differs for {format_names(wrong) or 'none'}. Load into the model (and "
            f"optimizer) that saved it; world size, mesh and plan may differ."
        )


def warn_casts(directory: str, routed: dict) -> None:
    """Warn once, naming the leaves, when a load changes dtypes (DCP casts without a word)."""
    saved = dcp.dcp_dtypes(directory)
    cast = [
        f"{k} ({str(saved[k]).removeprefix('torch.')} -> "
        f"{str(dcp.global_dtype(v)).removeprefix('torch.')})"
        for k, v in routed.items()
        if k in saved and saved[k] != dcp.global_dtype(v)
    ]
    if cast:
        warnings.warn(
            f"funcshard.checkpoint.load: {directory!r} holds other dtypes than like; these "
            f"are cast as they load: {format_names(cast)}. Load into a like of the saved "
            f"dtypes to keep the values exact.",
            stacklevel=4,
        )


_NEWER = re.compile(r"(^optim/|\.)skipped_steps\[")


def migrated(key: str) -> bool:
    """Whether `key` belongs to an optimizer state format newer than some checkpoints, which
    then load keeping like's values for it: Adam's per-parameter counts of skipped steps,
    zeros in a fresh state (see [Note: optimizers skip unused parameters] in
    funcshard/optim/_unused.py)."""
    return _NEWER.search(key) is not None
