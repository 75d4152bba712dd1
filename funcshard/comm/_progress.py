"""Each rank's progress, where the other ranks can read it without a collective.

[Note: naming the rank that is behind]
A collective that times out on gloo tells the waiting rank only that the others did not
come ("Timed out waiting 10000ms for send operation"): not which rank is missing, nor where
it is. So each rank publishes its progress in the process group's store (the key-value
store every rank already reaches: torchrun's, or the one `init_process_group` made), and a
rank whose collective fails reads every rank's before it raises:

- what: the count, op and unit of the last funcshard collective the rank issued (what
  `failures.last_issued` says; a compiled step counts as its call, "inside compiled
  step k" while it runs), whether it is waiting in a collective right now, the call of
  every rank it is inside (`fs.checkpoint.save`, `fs.full_state_dict`: see
  `failures.every_rank_calls`), and when that last changed;
- who writes: a daemon thread per process, every `INTERVAL` seconds, and only when
  something changed. Nothing runs per collective but two attribute writes around a wait
  (`waiting`), so the cost per collective is what `_before` already pays (see
  benchmarks/progress.py);
- leaving: `fs.shutdown()` and the interpreter's exit write the rank's record at once, as
  "left", so a rank that ran out of data and shut down is named as gone, not as slow.

From the records, the failing rank says, for each other rank of the group: the last
collective it issued and how long ago, and whether it is waiting in one ("waiting in
#41 all_gather of unit 'blocks.1'"), not in any (user code, or a hang outside funcshard),
gone, or without a record (never started, or the store went with rank 0). A rank whose
count is below this rank's never entered the collective that failed.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

INTERVAL = 1.0  # seconds between a rank's writes: the age of what others read at worst

Source = Callable[[], tuple[int, str] | None]  # (count, last collective in words)
Describe = Callable[[str, str | None], str]  # (op, unit) -> the collective in words


class Here:
    """This process's progress as the writer thread sees it."""

    source: Source | None = None  # what collectives registered: the last collective
    describe: Describe | None = None  # and how it words a collective waited in
    rank: int | None = None
    store: Any = None
    waiting: tuple[str, str | None] | None = None  # (op, unit) a wait is blocked in
    call: str | None = None  # the funcshard call of every rank this rank is in, if any
    left: str | None = None  # why the rank left, once it did
    thread: threading.Thread | None = None
    written: tuple | None = None  # what was written last, and when it changed
    changed: float = 0.0


def watch(source: Source, describe: Describe) -> None:
    """Read the last collective from `source` and word the one waited in by `describe`
    (collectives registers both at import)."""
    Here.source, Here.describe = source, describe


def start(store: Any, rank: int) -> None:
    """Publish this rank's progress in `store` from now on (once per process and store)."""
    if Here.store is store and Here.thread is not None and Here.thread.is_alive():
        return
    Here.store, Here.rank, Here.left, Here.written = store, rank, None, None
    _write()
    if Here.thread is None or not Here.thread.is_alive():
        Here.thread = threading.Thread(target=_loop, name="funcshard-progress", daemon=True)
        Here.thread.start()


def leaving(reason: str) -> None:
    """Mark this rank as gone (`reason`: "fs.shutdown()", "the process exited"), at once."""
    if Here.store is not None and Here.left is None:
        Here.left = reason
        _write()


def publish() -> None:
    """Write this rank's record now, not at the writer's next turn (a failure path)."""
    if Here.store is not None:
        _write()


def forget() -> None:
    """Stop publishing (the process group and its store are gone); the next collective on a
    new one starts again."""
    Here.store = None


def _loop() -> None:
    while Here.left is None:
        time.sleep(INTERVAL)
        _write()


def _snapshot() -> tuple:
    last = Here.source() if Here.source is not None else None
    waiting = Here.waiting
    words = Here.describe(*waiting) if waiting is not None and Here.describe else None
    return (last, words, Here.left, Here.call)


def _write() -> None:
    """Write the record if it changed (a store round trip): on the writer thread, or at
    once on a rank that starts, leaves or falls out of step."""
    now = _snapshot()
    if now == Here.written:
        return
    Here.written, Here.changed = now, time.time()
    last, waiting, left, call = now
    record = {
        "call": call,
        "count": last[0] if last else 0,
        "last": last[1] if last else "none yet",
        "waiting": waiting,
        "left": left,
        "since": Here.changed,
        "pid": os.getpid(),
        "host": _HOST,
    }
    with contextlib.suppress(Exception):  # the store went with the rank hosting it
        Here.store.set(_key(Here.rank), json.dumps(record))


def _key(rank: int | None) -> str:
    # per elastic restart: torchrun's store outlives a round
    return f"funcshard/progress/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def report(ranks: list[int], count: int) -> str:
    """Where each of `ranks` (other than this one) is, in words, one line each, read from
    the store without waiting for a missing record; `count` is this rank's last count."""
    store, lines = Here.store, []
    if store is None:
        return ""
    for rank in ranks:
        if rank == Here.rank:
            continue
        lines.append(f"rank {rank}: {_where(store, rank, count)}")
    return "\n".join(lines)


def _where(store: Any, rank: int, count: int) -> str:
    try:
        key = _key(rank)
        if not store.check([key]):
            return "no progress record (it never got this far, or the store is gone)"
        record = json.loads(store.get(key))
    except Exception:
        return "no progress record readable (the store went with the rank hosting it?)"
    ago = f"{max(0.0, time.time() - record['since']):.0f} s ago"
    if record["left"]:
        return f"left ({record['left']}) {ago}; its last collective: {record['last']}"
    process = _process_state(record)
    if process is not None:  # it writes no more: its record may lag its last INTERVAL
        return (
            f"its process {record['pid']} {process}; the last collective it recorded "
            f"(records lag up to {INTERVAL:.0f} s): {record['last']}"
        )
    inside = f" inside {record['call']}" if record.get("call") else ""
    if record["waiting"]:
        state = f"waiting in {record['waiting']}{inside} since {ago}"
    elif inside:
        state = f"{inside.strip()}, not in any funcshard collective since {ago}"
    else:
        state = f"not in any funcshard collective since {ago} (in user code, or gone)"
    behind = ", behind this rank" if record["count"] < count else ""
    return f"last collective {record['last']}{behind}; {state}"


def _here() -> str:
    """This machine and process-id namespace: a pid means the same process only where this
    matches (containers on one host share its name, not their pids)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{socket.gethostname()}/{boot.read().strip()}/{namespace}"
    except OSError:
        return socket.gethostname()


_HOST = _here()


def _process_state(record: dict) -> str | None:
    """Why a rank on this host writes no more: its process "has exited (killed by a
    signal?)" or "is stopped (SIGSTOP, or a debugger)"; None when it runs, or runs on
    another host or in another pid namespace (where only its record's age tells)."""
    pid = record.get("pid")
    if record.get("host") != _HOST or not isinstance(pid, int):
        return None
    gone = "has exited (killed by a signal?)"
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return gone
    except OSError:  # no /proc (macOS): only whether the process exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return gone
        except OSError:
            return None
        return None
    return {"T": "is stopped (SIGSTOP, or a debugger)", "t": "is stopped (a debugger)"}.get(
        state, gone if state in "ZX" else None
    )


def absent(text: str) -> bool:
    """Whether a `report` says some rank's process exited or is stopped."""
    return " has exited (" in text or " is stopped (" in text


atexit.register(leaving, "the process exited")
