"""Which checkpoint a load reads: the one LATEST names under a directory (or the directory
itself), held against its writer retiring it while every rank reads it, and, when it is
damaged, the earlier complete one to load instead (see [Note: writers and readers of a
checkpoint directory] in funcshard/io/_checkpoint_dir.py).
"""

from __future__ import annotations

import os
import time
from typing import Any

from funcshard.comm import _collectives as collectives
from funcshard.comm import _process_groups as process_groups
from funcshard.io import _checkpoint_dir as checkpoint_dir
from funcshard.io import _integrity as integrity
from funcshard.io._checkpoint_dir import LATEST
from funcshard.io._integrity import CheckpointCorrupted

META = "funcshard.json"  # what a save writes last: a checkpoint without it is not complete
READ_WAIT = 10.0  # seconds a load keeps re-reading LATEST while its checkpoint is retired


def open_checkpoint(root: str, group: Any) -> tuple[str, str | None]:
    """The checkpoint to load, resolved once by the mesh's first rank, which holds it against
    retirement (its lease, returned there; None elsewhere). Communicates: one all-gather."""
    found: Any = None
    held = None
    if process_groups.group_rank(group) == 0:
        try:
            found, held = _hold(root)
        except (OSError, ValueError) as e:
            found = (type(e).__name__, str(e))
    found = collectives.all_gather_object(found, group)[0]
    if isinstance(found, tuple):
        checkpoint_dir.release(held)
        kind, message = found
        raise {"FileNotFoundError": FileNotFoundError, "CheckpointCorrupted": CheckpointCorrupted,
               "CheckpointRetired": CheckpointRetired}.get(kind, OSError)(message)  # fmt: skip
    return found, held


class CheckpointRetired(OSError):
    """The checkpoint a load asked for was retired by its writer while the load opened it."""


def _hold(root: str) -> tuple[str, str | None]:
    """Resolve LATEST and lease the checkpoint it names, again while a writer retires it
    (see [Note: writers and readers of a checkpoint directory])."""
    if os.path.exists(os.path.join(root, integrity.DCP_METADATA)):  # a checkpoint itself
        parent, name = os.path.split(os.path.normpath(root))
        held = checkpoint_dir.lease(parent, name) if _is_root(parent) else None
        if checkpoint_dir.retiring(parent, name) or not os.path.exists(os.path.join(root, META)):
            checkpoint_dir.release(held)
            raise CheckpointRetired(
                f"funcshard.checkpoint.load: {root!r} is being retired by the job that saved "
                f"it (save(keep=N)). Load the latest instead: funcshard.checkpoint.load("
                f"{parent!r}, like=...)."
            )
        return root, held
    deadline = time.monotonic() + READ_WAIT
    while True:
        before = checkpoint_dir.read_latest(root)
        try:
            directory = latest(root)
        except integrity.CheckpointCorrupted:  # named, then retired: LATEST moved on since
            if checkpoint_dir.read_latest(root) != before and time.monotonic() < deadline:
                continue
            raise
        name = os.path.basename(directory)
        held = checkpoint_dir.lease(root, name)
        if not checkpoint_dir.retiring(root, name) and os.path.exists(
            os.path.join(directory, META)
        ):
            return directory, held
        checkpoint_dir.release(held)
        if time.monotonic() > deadline:
            raise CheckpointRetired(
                f"funcshard.checkpoint.load: every checkpoint LATEST named under {root!r} for "
                f"{READ_WAIT:.0f} s was retired by its writer (save(keep=N)) before this load "
                f"could hold it, the last {name!r}. Save with a larger keep, or load a "
                f"checkpoint directory no writer retires."
            )
        time.sleep(0.01)


def _is_root(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, n)) for n in (LATEST, checkpoint_dir.HIDDEN))


def latest(root: str, caller: str = "load") -> str:
    """The checkpoint LATEST names under `root`, or `root` itself if it is a checkpoint."""
    if os.path.exists(os.path.join(root, integrity.DCP_METADATA)):
        return root
    pointer = os.path.join(root, LATEST)
    if not os.path.isfile(pointer):
        raise FileNotFoundError(
            f"funcshard.checkpoint.{caller}: no complete checkpoint under {root!r} (no "
            f"{LATEST} file). Save one with funcshard.checkpoint.save first."
        )
    with open(pointer, errors="replace") as f:
        name = f.read().strip()
    directory = os.path.join(root, name)
    if checkpoint_dir.index(name) is None:
        raise integrity.CheckpointCorrupted(
            f"funcshard.checkpoint.{caller}: {pointer} holds {name[:80]!r}, not the name of "
            f"a checkpoint (step-<n>-<k> or save-<k>): it was damaged or written by hand. "
            f"{previous_hint(os.path.join(root, LATEST))}"
        )
    if not os.path.isdir(directory):
        raise integrity.CheckpointCorrupted(
            f"funcshard.checkpoint.{caller}: {pointer} names {directory!r}, which is missing. "
            f"{previous_hint(directory)}"
        )
    return directory


def previous_hint(directory: str) -> str:
    """What to do instead: load the newest complete checkpoint before `directory` (any, when
    its name is not a checkpoint's)."""
    root, name = os.path.split(os.path.normpath(directory))
    index = checkpoint_dir.index(name)
    try:
        found = checkpoint_dir.saves(root)
    except OSError:
        found = []
    older = [
        (i, n)
        for i, n in found
        if (index is None or i < index) and os.path.exists(os.path.join(root, n, META))
    ]
    if not older:
        return "There is no earlier complete checkpoint under it to load instead."
    previous = os.path.join(root, older[-1][1])
    return (
        f"Load the previous checkpoint instead: funcshard.checkpoint.load({previous!r}, "
        f"like=...), and check it with `funcshard checkpoint verify {previous}`."
    )
