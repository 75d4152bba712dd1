"""Who may write, commit, retire and read the checkpoints of one directory, and when.

[Note: writers and readers of a checkpoint directory]
Several jobs may point at one directory (a second run started by mistake, an evaluation job
loading the latest checkpoint while training saves). Each process that saves is a *writer*
with an id of its own (host, pid, a random part). Its first rank
- holds an exclusive `flock` on `.funcshard/writers/<id>` for as long as the process lives,
  so any process can tell a running writer from a dead one (the OS drops a dead process's
  locks);
- creates every checkpoint directory with an exclusive `mkdir` (the next free counter), so a
  save never writes into a directory it did not create, and records its id in it
  (`funcshard.writer`);
- moves LATEST, under an `flock` on `.funcshard/LATEST.lock`, only from what it expects:
  its own last commit, or for its first commit what LATEST named when it first saved. If
  another writer committed in between, LATEST stays and the save raises
  `CheckpointConflict` naming the other writer's checkpoint (this save's directory is
  complete and loads by its path);
- retires (`keep=N`) only its own checkpoints and those of writers no longer running (a
  resumed job takes over its dead predecessor's), never what LATEST names.
A reader (the mesh's first rank, once for every rank) reads LATEST, writes a lease
`.funcshard/readers/<name>.<random>`, then checks that no retirement of `<name>` is under
way (`.funcshard/retiring/<name>`) and that the directory is still complete; if not, it
drops the lease and reads LATEST again. A retiring writer first marks `retiring/<name>`,
then looks for leases; if it finds one it leaves the checkpoint for a later save. Each side
writes its mark before it looks for the other's, so at least one of them sees the other:
a checkpoint a reader has opened is never deleted under it. Leases of readers that died are
ignored after `LEASE_TIMEOUT`, retirement marks after `MARK_TIMEOUT`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

HIDDEN = ".funcshard"
WRITER = "funcshard.writer"
LATEST = "LATEST"
LEASE_TIMEOUT = 3600.0  # seconds a reader's lease keeps its checkpoint from retirement
MARK_TIMEOUT = 60.0  # seconds after which a retirement mark is a dead writer's leftover


class CheckpointConflict(OSError):
    """Another writer committed to the same checkpoint directory since this one's last commit."""


@dataclass
class Writer:
    """This process's writer of one checkpoint directory (on the mesh's first rank)."""

    id: str
    base: str | None  # what LATEST named when this writer first saved
    last: str | None = None  # this writer's last commit
    lock: int = -1  # the descriptor holding the writer's flock


_WRITERS: dict[tuple[str, tuple[int, ...]], Writer] = {}


def writer(root: str, ranks: tuple[int, ...]) -> Writer:
    """This process's writer of `root` for the mesh over `ranks`, made on first use."""
    key = (os.path.realpath(root), ranks)
    if key not in _WRITERS:
        wid = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.makedirs(_hidden(root, "writers"), exist_ok=True)
        fd = os.open(_hidden(root, "writers", wid), os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _WRITERS[key] = Writer(wid, read_latest(root), lock=fd)
    return _WRITERS[key]


def running(root: str, wid: str | None, me: Writer) -> bool:
    """Whether writer `wid` still runs (holds its lock); None (an older funcshard) is not."""
    if wid == me.id:
        return True
    if not wid or "/" in wid:
        return False
    try:
        fd = os.open(_hidden(root, "writers", wid), os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def create(root: str, stem: str, me: Writer) -> str:
    """Make a fresh checkpoint directory `<stem>-<k>` (exclusively) and return its name."""
    index = max([-1, *(i for i, _ in saves(root))]) + 1
    while True:
        name = f"{stem}-{index}"
        try:
            os.mkdir(os.path.join(root, name))
        except FileExistsError:  # another writer took it first: the next one
            index += 1
            continue
        with open(os.path.join(root, name, WRITER), "w") as f:
            f.write(me.id)
        return name


def owner(directory: str) -> str | None:
    """The id of the writer that created a checkpoint directory (None before writers)."""
    try:
        with open(os.path.join(directory, WRITER)) as f:
            return f.read().strip()
    except OSError:
        return None


def read_latest(root: str) -> str | None:
    """What LATEST holds, stripped, or None when there is none."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def move_latest(root: str, name: str, me: Writer) -> None:
    """Point LATEST at `name` if it still names this writer's last commit (or, before its
    first, what it named when this writer started); else raise CheckpointConflict."""
    with _locked(_hidden(root, "LATEST.lock")):
        current = read_latest(root)
        expected = me.last if me.last is not None else me.base
        if current != expected:
            other = owner(os.path.join(root, current)) if current else None
            raise CheckpointConflict(
                f"another writer ({other or 'unknown'}) committed {current!r} to "
                f"{os.path.join(root, LATEST)} since "
                f"{'this job last committed ' + repr(me.last) if me.last else 'this job started'}"
                f", so LATEST was left naming it. This save, {os.path.join(root, name)!r}, is "
                f"complete and loads by its directory. Give each job a checkpoint directory of "
                f"its own."
            )
        pointer = os.path.join(root, LATEST + ".tmp")
        with open(pointer, "w") as f:
            f.write(name)
        os.replace(pointer, os.path.join(root, LATEST))  # the commit point
        me.last = name


def retire(root: str, doomed: list[str], me: Writer) -> None:
    """Delete the checkpoints `doomed` names that are this writer's or a dead writer's and
    that no reader holds (see [Note: writers and readers of a checkpoint directory])."""
    os.makedirs(_hidden(root, "retiring"), exist_ok=True)
    for name in doomed:
        wid = owner(os.path.join(root, name))
        if wid == me.id or not running(root, wid, me):
            _retire_one(root, name)


def _retire_one(root: str, name: str) -> None:
    mark = _hidden(root, "retiring", name)
    with open(mark, "w") as f:
        f.write(str(os.getpid()))
    try:
        if _leased(root, name):
            return  # a reader holds it: a later save retires it
        tomb = _hidden(root, "retired", f"{name}.{uuid.uuid4().hex[:8]}")
        os.makedirs(os.path.dirname(tomb), exist_ok=True)
        os.rename(os.path.join(root, name), tomb)
    finally:
        with contextlib.suppress(OSError):
            os.remove(mark)
    shutil.rmtree(tomb, ignore_errors=True)


def lease(root: str, name: str) -> str | None:
    """Hold checkpoint `name` against retirement; returns the lease (None where `root`
    cannot be written: a read-only copy has no writer retiring it)."""
    try:
        os.makedirs(_hidden(root, "readers"), exist_ok=True)
        path = _hidden(root, "readers", f"{name}.{uuid.uuid4().hex[:12]}")
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        return path
    except OSError:
        return None


def release(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            os.remove(path)


def retiring(root: str, name: str) -> bool:
    """Whether a writer is retiring checkpoint `name` right now."""
    try:
        return time.time() - os.path.getmtime(_hidden(root, "retiring", name)) < MARK_TIMEOUT
    except OSError:
        return False


def _leased(root: str, name: str) -> bool:
    folder = _hidden(root, "readers")
    now = time.time()
    try:
        entries = os.listdir(folder)
    except OSError:
        return False
    for entry in entries:
        if entry.rsplit(".", 1)[0] == name:
            with contextlib.suppress(OSError):
                if now - os.path.getmtime(os.path.join(folder, entry)) < LEASE_TIMEOUT:
                    return True
    return False


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _hidden(root: str, *parts: str) -> str:
    return os.path.join(root, HIDDEN, *parts)


def saves(root: str) -> list[tuple[int, str]]:
    """The entries of `root` named like checkpoints, as (save counter, name), oldest first."""
    return sorted((i, name) for name in os.listdir(root) if (i := index(name)) is not None)


def index(name: str) -> int | None:
    """The save counter in a checkpoint directory's name (`step-<s>-<k>` or `save-<k>`)."""
    match = re.fullmatch(r"(?:step-(?:None|-?[0-9]+)|save)-([0-9]+)", name)
    return int(match.group(1)) if match else None
