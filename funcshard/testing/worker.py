"""A rank's side of the pool: a worker joins the process group, then runs the tasks the parent
sends (each pickled with the caller's import path and script) and answers the parent's probes
for the collective it issued last; and the check that the main script lets workers start.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import multiprocessing as mp
import multiprocessing.spawn
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from funcshard.comm import _exchange as exchange
from funcshard.comm import _failures as failures
from funcshard.comm import _trail as trail
from funcshard.comm._mesh import shutdown
from funcshard.testing import collector, process_state


def task_name(fn: Callable[..., Any]) -> str:
    inner = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(inner, "__qualname__", repr(inner))


def dumps_task(fn: Callable[..., Any]) -> bytes:
    inner = fn.func if isinstance(fn, functools.partial) else fn
    main = sys.modules["__main__"]
    main_path = getattr(main, "__file__", None) if inner.__module__ == "__main__" else None
    if inner.__module__ == "__main__" and main_path is None:
        raise TypeError(
            f"testing.run: {task_name(fn)} is defined in an interactive session, where the ranks "
            f"cannot import it. Define it in a .py file and import it from there."
        )
    try:
        return pickle.dumps((list(sys.path), main_path, pickle.dumps(fn)))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"testing.run: cannot send {task_name(fn)} to the ranks ({e}). Pass a module-level "
            f"function, or functools.partial(fn, *args) with picklable arguments; lambdas and "
            f"nested functions do not pickle."
        ) from e


# What WorkerPool.quit sends a worker instead of a task (a pickled task starts with b"\x80").
QUIT = b"quit"


UNGUARDED_EXIT = 71  # a worker found the script calling testing.run while it re-ran it
UNGUARDED = (
    "worker processes start by re-running your main script, and it calls "
    "funcshard.testing.run at import time. Put the calls that start ranks under "
    '`if __name__ == "__main__":`, as multiprocessing requires.'
)


def check_main_can_be_rerun() -> None:
    """Refuse what would kill every worker as it starts: a main script it cannot re-run
    (read from stdin), or this very call made while a worker re-runs the script."""
    if getattr(mp.current_process(), "_inheriting", False):
        sys.stderr.write(f"funcshard.testing.run: {UNGUARDED}\n")
        sys.stderr.flush()
        os._exit(UNGUARDED_EXIT)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is not None and not os.path.isfile(main_file):
        raise RuntimeError(
            f"funcshard.testing.run: the main script is {main_file!r}, not a file, and worker "
            f"processes start by re-running it. Save it to a file and run that, with the calls "
            f'that start ranks under `if __name__ == "__main__":`.'
        )


def worker_main(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    conn: Connection,
    probe: Connection,
    stack_dir: str,
) -> None:
    """A rank's life: join the process group, then run functions until the pipe closes."""
    stack_file = open(os.path.join(stack_dir, f"rank{rank}.stack"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(all_threads=True)  # a crash (signal 11) prints every thread's stack
    threading.Thread(target=_answer_probes, args=(probe,), daemon=True).start()
    torch.set_num_threads(1)  # 2 cores shared by all ranks: default threading is 3-10x slower
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(minutes=10)
    )
    collector.freeze_survivors()  # see [Note: a worker's long-lived objects are frozen]
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:
            break
        if payload == QUIT:  # see WorkerPool.quit
            return
        conn.send_bytes(_run_task(rank, payload))
    with contextlib.suppress(RuntimeError):  # a rank already gone: nothing to leave cleanly
        shutdown(timedelta(seconds=5))


def _answer_probes(probe: Connection) -> None:
    """Tell the parent which collective this rank issued last, whenever it asks."""
    while True:
        try:
            probe.recv_bytes()
        except (EOFError, OSError):
            return  # the pool is closing
        try:
            answer = failures.last_issued()
        except Exception as e:  # never let the thread die: the next report would be empty
            answer = f"(unknown: {type(e).__name__}: {e})"
        with contextlib.suppress(OSError):
            probe.send_bytes(answer.encode())


def _run_task(rank: int, payload: bytes) -> bytes:
    """Run one task; its reply, or `ProcessStateChanged` if it left the rank's process-wide
    state changed (see [Note: a task leaves its process as it found it])."""
    failures.reset_issued()  # numbered per task, so the ranks' numbers compare
    trail.forget()  # and their trails (see [Note: the collectives' trail])
    exchange.new_epoch()  # gloo exchanges tagged per task (see the function)
    before = process_state.snapshot()
    task_traceback = ""  # the task's own, when it raised
    reply: tuple[Any, ...]
    try:
        reply = ("ok", pickle.dumps(_loads_task(payload)(rank)))
    except BaseException as e:
        task_traceback = traceback.format_exc()
        reply = _error_reply(e, task_traceback, changed=False)
    found = process_state.changes(before, process_state.snapshot())
    if found:
        fix = (
            "Restore it before the task returns (a `with` block or try/finally); the pool was "
            "quit, so the next call starts fresh ranks."
        )
        if task_traceback:
            fix += f" The task had also raised:\n{task_traceback}"
        error = process_state.changed_error(f"rank {rank}'s task", found, fix)
        reply = _error_reply(error, f"{type(error).__name__}: {error}", changed=True)
    return pickle.dumps(reply)


def _error_reply(e: BaseException, tb: str, changed: bool) -> tuple[str, bytes | None, str, bool]:
    """An error reply: the pickled exception, its traceback, and whether the task left the
    rank's state changed (the pool then quits rather than run another task there)."""
    try:
        exc_bytes = pickle.dumps(e)
    except Exception:
        exc_bytes = None
    return ("error", exc_bytes, tb, changed)


def _loads_task(payload: bytes) -> Callable[[int], Any]:
    """Unpickle a task's function after adopting the caller's import path and script."""
    sys_path, main_path, fn_bytes = pickle.loads(payload)
    sys.path[:] = sys_path
    if (
        main_path is not None
        and getattr(sys.modules.get("__mp_main__"), "__file__", None) != main_path
    ):
        multiprocessing.spawn.import_main_path(
            main_path
        )  # a function defined in the caller's script
    return pickle.loads(fn_bytes)
