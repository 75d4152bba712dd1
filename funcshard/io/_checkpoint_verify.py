"""Checking a checkpoint's bytes against the checksums its save recorded: every rank its
share of the chunks before a load reads any, or a whole checkpoint offline (`verify`). See
[Note: checkpoint integrity] in funcshard/io/_integrity.py.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from funcshard.comm import _collectives as collectives
from funcshard.comm import _process_groups as process_groups
from funcshard.io import _integrity as integrity
from funcshard.io._checkpoint_latest import META, latest, previous_hint


def verify(path: str | os.PathLike) -> integrity.Report:
    """Check the checkpoint LATEST names under `path` (or the checkpoint directory `path`)
    byte for byte against its checksums, offline: no process group needed."""
    directory = latest(os.fspath(path), "verify")
    if integrity.read(directory) is None and _saved_with_checksums(directory):
        missing = f"{os.path.join(directory, integrity.CHECKSUMS)}: missing"
        return integrity.Report(directory, (f"{integrity.CHECKSUMS}: missing",), (missing,), True)
    return integrity.verify(directory)


def verified(directory: str, group: Any) -> None:
    """Check the checkpoint's bytes against its checksums before anything reads them: each
    rank its share of the chunks; every rank raises if any rank found a mismatch."""
    share, shares = process_groups.group_rank(group), group.size()
    try:
        record = integrity.read(directory)
        if record is None and _saved_with_checksums(directory):
            found: Any = [f"{os.path.join(directory, integrity.CHECKSUMS)}: missing"]
        elif record is None:
            found = None
        else:
            found = integrity.check_files(directory, record) + integrity.check_chunks(
                directory, record, share, shares
            )
    except Exception as e:  # reported on every rank below, never a hang
        found = [f"{directory}: {type(e).__name__}: {e}"]
    everyone = collectives.all_gather_object(found, group)
    if any(f is None for f in everyone):
        warnings.warn(
            f"funcshard.checkpoint.load: {directory!r} was saved without checksums "
            f"(save(checksums=False), or before funcshard wrote them), so its bytes are not "
            f"verified.",
            stacklevel=3,
        )
        return
    problems = sorted({p for f in everyone for p in f})
    if problems:
        listed = "\n  ".join(problems)
        raise integrity.CheckpointCorrupted(
            f"funcshard.checkpoint.load: {directory!r} is corrupted; nothing was loaded:\n  "
            f"{listed}\n{previous_hint(directory)}"
        )


def _saved_with_checksums(directory: str) -> bool:
    """What funcshard.json says of the save (checkpoints before checksums do not say)."""
    try:
        with open(os.path.join(directory, META)) as f:
            return bool(json.load(f).get("checksums", False))
    except (OSError, ValueError):
        return False
