"""Run a function on every rank of a pool of worker processes that outlives the call.

[Note: the worker pool]
Starting gloo ranks costs seconds (a fresh interpreter imports torch, then a rendezvous), and a
test suite makes hundreds of multi-rank calls, so ranks are started once per world size and
kept: each waits for a pickled function, runs `fn(rank)`, and sends back a pickled result or
exception. The parent hosts the TCPStore (port 0, so no port can clash) and stays outside the
process group.

Workers start from a forkserver that has already imported torch: forking it is ~0.1 s, against
~2 s for a spawned interpreter, and it is safe where forking the caller is not (the caller may
have started OpenMP or CUDA threads). Everything crosses the pipe as plain pickle bytes, so
tensors travel by value, never through shared-memory file descriptors.

A call fails loudly and never waits forever: a rank that dies is reported with its exit code
as soon as its process ends; a call that outlives `timeout` asks each unfinished rank for its
Python stack (faulthandler on SIGUSR1), so the error says what every rank was waiting on, and
the pool is killed; the next call starts a fresh one. A rank that raises leaves the pool usable
when the other ranks finish too; ranks still running `ERROR_GRACE` seconds after it are
usually waiting in a collective it never entered, so its exception is reported then, with
their stacks, and the pool is killed, instead of after the whole `timeout` (which every
hypothesis shrink step of such a bug would pay).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import multiprocessing as mp
import multiprocessing.spawn
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from funcshard import collectives
from funcshard.mesh import shutdown

T = TypeVar("T")


def run(
    fn: Callable[[int], T],
    world_size: int = 2,
    backend: str = "gloo",
    timeout: float = 60.0,
    fresh: bool = False,
) -> list[T]:
    """Run `fn(rank)` on every rank of a `world_size` process group; return the results by rank.

    `fn` must pickle by reference (a module-level function, or `functools.partial` of one with
    picklable arguments). Draw hypothesis examples in the caller and bind them with partial, so
    every rank sees the same example. A rank's exception is re-raised here with its rank and
    remote traceback, within `ERROR_GRACE` seconds even while other ranks wait for it (their
    stacks become a note on it and the pool is recycled); a hang past `timeout` seconds raises
    TimeoutError naming the ranks that did not finish, where each was waiting and the last
    collective each issued. Under pytest with pytest-timeout, `timeout` is capped to end a few
    seconds before the test's, so this report is what fails a hung test (see
    funcshard/testing/pytest_plugin.py).

    `fresh=True` runs on ranks of their own, ended afterwards: for tests that break process
    groups on purpose (timeouts, faults) and must not leave them to later calls.
    """
    if world_size < 1:
        raise ValueError(f"testing.run: world_size must be at least 1, got {world_size}.")
    _check_main_can_be_rerun()
    timeout = _within_test_deadline(timeout)
    if fresh:
        pool = WorkerPool(world_size, backend)
        try:
            return pool.run(fn, timeout)
        finally:
            pool.quit()
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is None or not pool.alive():
        pool = _POOLS[key] = WorkerPool(world_size, backend)
    try:
        return pool.run(fn, timeout)
    except (TimeoutError, RankDied):
        _POOLS.pop(key, None)
        raise
    except BaseException:
        if not pool.alive():
            _POOLS.pop(key, None)
        raise


DEADLINE: float | None = None  # when the running test's pytest-timeout fires (pytest_plugin)
DEADLINE_MARGIN = 5.0  # seconds left for the report: ask for the stacks, kill the pool


def _within_test_deadline(timeout: float) -> float:
    """`timeout`, capped to end `DEADLINE_MARGIN` seconds before the running test's
    pytest-timeout, so that the runner's report (every rank's stack and last collective)
    reaches the user instead of pytest-timeout's."""
    if DEADLINE is None:
        return timeout
    left = DEADLINE - time.monotonic() - DEADLINE_MARGIN
    return max(min(timeout, left), min(timeout, 1.0))


class RankDied(RuntimeError):
    """A worker process ended while running a function (gloo aborts on mismatched collectives)."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised on another rank, attached as its `__cause__`."""

    def __str__(self) -> str:
        return self.args[0]


class WorkerPool:
    """`world_size` ranks in one process group, each waiting for functions to run."""

    def __init__(self, world_size: int, backend: str = "gloo", start_method: str | None = None):
        self.world_size = world_size
        self.backend = backend
        self._store = dist.TCPStore(
            "127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False
        )
        self._stack_dir = tempfile.mkdtemp(prefix="funcshard-ranks-")
        ctx = _context(start_method)
        self._conns: list[Connection] = []
        self._probes: list[Connection] = []  # ask a rank for its last collective
        self._procs: list[mp.process.BaseProcess] = []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            probe_end, probe_child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    world_size,
                    backend,
                    self._store.port,
                    child_end,
                    probe_child,
                    self._stack_dir,
                ),
                name=f"funcshard-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()
            probe_child.close()
            self._conns.append(parent_end)
            self._probes.append(probe_end)
            self._procs.append(proc)

    def alive(self) -> bool:
        """True while every worker process is running."""
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[[int], T], timeout: float) -> list[T]:
        """Send `fn` to every rank and collect the results; see `funcshard.testing.run`."""
        payload = _dumps_task(fn)
        for conn in self._conns:
            # a rank already gone (one that died starting up) is reported by _collect
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.send_bytes(payload)
        replies = self._collect(_name(fn), timeout)
        errors = {r: reply for r, reply in replies.items() if reply[0] == "error"}
        if errors:
            raise _rank_exception(errors, _name(fn), self.world_size)
        return [pickle.loads(replies[r][1]) for r in range(self.world_size)]

    def _collect(self, name: str, timeout: float) -> dict[int, tuple[Any, ...]]:
        """Wait for every rank's reply; raise on a dead rank or when `timeout` runs out.

        After a rank dies the others get `DEATH_GRACE` seconds more to report, so the error
        also says how the survivors noticed (their exception becomes its cause). After a rank
        raises they get `ERROR_GRACE` seconds to finish (see `_stranded`).
        """
        replies: dict[int, tuple[Any, ...]] = {}
        dead: list[int] = []
        deadline = time.monotonic() + timeout
        grace: float | None = None  # when the others' time to finish ends, once a rank raised
        while pending := [r for r in range(self.world_size) if r not in replies and r not in dead]:
            waitables = [self._conns[r] for r in pending] + [
                self._procs[r].sentinel for r in pending
            ]
            until = deadline if grace is None else min(deadline, grace)
            ready = wait(waitables, timeout=max(0.0, until - time.monotonic()))
            if not ready:
                if dead:
                    break
                if grace is not None and grace < deadline:
                    raise self._stranded(name, pending, replies)
                raise self._timeout(name, timeout, pending, replies)
            for r in pending:
                if self._conns[r] in ready or self._procs[r].sentinel in ready:
                    reply = self._receive(r)
                    if reply is None:
                        dead.append(r)
                        deadline = min(deadline, time.monotonic() + DEATH_GRACE)
                    else:
                        replies[r] = reply
                        if reply[0] == "error" and grace is None:
                            grace = time.monotonic() + ERROR_GRACE
        if dead:
            raise self._died(name, dead[0], replies)
        return replies

    def _receive(self, rank: int) -> tuple | None:
        """Read a rank's reply; None when the pipe closed, i.e. the rank died before answering."""
        try:
            if self._conns[rank].poll():
                return pickle.loads(self._conns[rank].recv_bytes())
        except (EOFError, ConnectionResetError):
            pass
        return None

    def _timeout(
        self, name: str, timeout: float, pending: list[int], replies: dict[int, tuple[Any, ...]]
    ) -> TimeoutError:
        where = self._where_and_kill(pending)
        finished = [r for r in range(self.world_size) if r not in pending]
        error = TimeoutError(
            f"testing.run({name}, world_size={self.world_size}): ranks {pending} did not finish "
            f"within {timeout:g} s (finished: {finished}). A rank is usually stuck in a "
            f"collective that another rank never entered. The pool was killed; the next call "
            f"starts a fresh one.\n{where}{_raised_before(replies)}"
        )
        return _with_rank_cause(error, replies, name, self.world_size)

    def _stranded(
        self, name: str, pending: list[int], replies: dict[int, tuple[Any, ...]]
    ) -> BaseException:
        """The first rank exception, once the ranks still running had `ERROR_GRACE` seconds to
        finish after it: they are usually waiting in a collective that the raising rank never
        entered, which only the timeout would end. The note says where each was waiting; the
        pool is killed (their process group is stuck)."""
        where = self._where_and_kill(pending)
        errors = {r: reply for r, reply in replies.items() if reply[0] == "error"}
        error = _rank_exception(errors, name, self.world_size)
        note = (
            f"testing.run({name}, world_size={self.world_size}): ranks {pending} had not "
            f"finished {ERROR_GRACE:g} s after rank {min(errors)} raised; a rank is usually "
            f"waiting in a collective that the raising rank never entered. The pool was "
            f"killed; the next call starts a fresh one.\n{where}"
        )
        if hasattr(error, "add_note"):
            error.add_note(note)
        else:  # Python 3.10: no notes; the remote traceback carries it
            error.__cause__ = RemoteTraceback(f"{error.__cause__}\n{note}")
        return error

    def _died(self, name: str, rank: int, replies: dict[int, tuple[Any, ...]]) -> RankDied:
        self._procs[rank].join(1.0)
        code = self._procs[rank].exitcode
        self.close(kill=True)
        if code == UNGUARDED_EXIT:
            return RankDied(
                f"testing.run({name}, world_size={self.world_size}): rank {rank} could not "
                f"start: {_UNGUARDED}"
            )
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        finished = sorted(replies)
        error = RankDied(
            f"testing.run({name}, world_size={self.world_size}): rank {rank} died with {how} "
            f"(finished before it: {finished}). gloo aborts a process on mismatched collective "
            f"shapes; see the rank's stderr above. The pool was killed; the next call starts "
            f"a fresh one.{_raised_before(replies)}"
        )
        return _with_rank_cause(error, replies, name, self.world_size)

    def _where_and_kill(self, pending: list[int]) -> str:
        """Where each unfinished rank was waiting (its last collective and Python stack), for
        a report; then the pool is killed (their process group is stuck)."""
        try:
            return _waiting_in(pending, self._last_collectives(pending), self._stacks(pending))
        finally:
            self.close(kill=True)

    def _last_collectives(self, ranks: list[int]) -> dict[int, str]:
        """Ask each rank which collective it issued last (a thread of the rank answers while
        its main thread waits)."""
        for r in ranks:
            with contextlib.suppress(OSError):
                self._probes[r].send_bytes(b"?")
        last = {}
        deadline = time.monotonic() + 2.0
        for r in ranks:
            try:
                answered = self._probes[r].poll(max(0.0, deadline - time.monotonic()))
                last[r] = self._probes[r].recv_bytes().decode() if answered else "(no answer)"
            except (OSError, EOFError):
                last[r] = "(no answer: the rank is gone)"
        return last

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask each rank for its Python stack (faulthandler on SIGUSR1) and read it back."""
        for r in ranks:
            if self._procs[r].pid is not None and self._procs[r].is_alive():
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
        stacks = {}
        for r in ranks:
            path = os.path.join(self._stack_dir, f"rank{r}.stack")
            try:
                with open(path) as f:
                    stacks[r] = f.read().strip() or "(no stack: the rank did not answer)"
            except FileNotFoundError:
                stacks[r] = "(no stack: the rank had not started yet)"
        return stacks

    def quit(self) -> None:
        """End the workers at once, without leaving a process group the call may have broken,
        but through a normal exit, so that multiprocessing's finalizers run in them.

        A killed worker leaves the semaphores it made (torch.compile's compile workers make
        some) registered with the resource tracker, which warns about "leaked semaphore
        objects" when the caller exits. A worker still running a function `QUIT_GRACE` seconds
        later is killed.
        """
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(OSError):  # gone meanwhile: close() reaps it
                    conn.send_bytes(_QUIT)
        deadline = time.monotonic() + QUIT_GRACE
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.close(kill=True)

    def close(self, kill: bool = False) -> None:
        """Stop the workers: politely (they leave the process group), or at once with `kill`."""
        if kill:  # before closing the pipes, which would start a polite shutdown
            for proc in self._procs:
                proc.kill()
        for conn in self._conns + self._probes:
            conn.close()
        for proc in self._procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        shutil.rmtree(self._stack_dir, ignore_errors=True)


_POOLS: dict[tuple[int, str], WorkerPool] = {}
DEATH_GRACE = 10.0  # seconds the surviving ranks get to report after one dies
# Seconds the other ranks get to finish after one raises: ranks that raise the same error do
# so within milliseconds, and a rank still running later is usually waiting on the one that
# raised. Long enough for a loaded 2-core machine, short against a hypothesis shrink.
ERROR_GRACE = 2.0


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def _context(start_method: str | None) -> mp.context.BaseContext:
    """Forkserver with torch preloaded where the platform has it, else spawn."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "funcshard.testing.runner"])
    return ctx


def _name(fn: Callable[..., Any]) -> str:
    inner = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(inner, "__qualname__", repr(inner))


def _dumps_task(fn: Callable[..., Any]) -> bytes:
    inner = fn.func if isinstance(fn, functools.partial) else fn
    main = sys.modules["__main__"]
    main_path = getattr(main, "__file__", None) if inner.__module__ == "__main__" else None
    if inner.__module__ == "__main__" and main_path is None:
        raise TypeError(
            f"testing.run: {_name(fn)} is defined in an interactive session, where the ranks "
            f"cannot import it. Define it in a .py file and import it from there."
        )
    try:
        return pickle.dumps((list(sys.path), main_path, pickle.dumps(fn)))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"testing.run: cannot send {_name(fn)} to the ranks ({e}). Pass a module-level "
            f"function, or functools.partial(fn, *args) with picklable arguments; lambdas and "
            f"nested functions do not pickle."
        ) from e


def _waiting_in(pending: list[int], last: dict[int, str], stacks: dict[int, str]) -> str:
    """Each unfinished rank's last funcshard collective and Python stack, for a report."""
    return "\n".join(
        f"--- rank {r} (last funcshard collective issued: {last[r]}) was waiting in:\n{stacks[r]}"
        for r in pending
    )


def _raised_before(replies: dict[int, tuple[Any, ...]]) -> str:
    """Name the ranks that raised before the call failed otherwise (their error is the cause)."""
    raised = sorted(r for r, reply in replies.items() if reply[0] == "error")
    return f"\nRanks {raised} raised first; see the cause above." if raised else ""


def _with_rank_cause(
    error: BaseException, replies: dict[int, tuple[Any, ...]], name: str, world_size: int
) -> BaseException:
    """Chain the first rank exception already received as the cause of a timeout or death."""
    errors = {r: reply for r, reply in replies.items() if reply[0] == "error"}
    if errors:
        error.__cause__ = _rank_exception(errors, name, world_size)
    return error


def _rank_exception(
    errors: dict[int, tuple[Any, ...]], name: str, world_size: int
) -> BaseException:
    """Rebuild the lowest failing rank's exception, its remote traceback as the cause."""
    rank = min(errors)
    _, exc_bytes, tb = errors[rank]
    try:
        exc = pickle.loads(exc_bytes) if exc_bytes is not None else None
    except Exception:
        exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"rank {rank} raised an exception that does not unpickle:\n{tb}")
    others = [r for r in sorted(errors) if r != rank]
    header = f"raised on rank {rank} of {world_size} in testing.run({name})"
    if others:
        header += f"; ranks {others} raised too"
    exc.__cause__ = RemoteTraceback(f"{header}:\n{tb}")
    if hasattr(exc, "add_note"):
        exc.add_note(header)
    return exc


# What WorkerPool.quit sends a worker instead of a task (a pickled task starts with b"\x80").
_QUIT = b"quit"
QUIT_GRACE = 5.0  # seconds an idle worker gets to exit normally; a busy one is then killed


UNGUARDED_EXIT = 71  # a worker found the script calling testing.run while it re-ran it
_UNGUARDED = (
    "worker processes start by re-running your main script, and it calls "
    "funcshard.testing.run at import time. Put the calls that start ranks under "
    '`if __name__ == "__main__":`, as multiprocessing requires.'
)


def _check_main_can_be_rerun() -> None:
    """Refuse what would kill every worker as it starts: a main script it cannot re-run
    (read from stdin), or this very call made while a worker re-runs the script."""
    if getattr(mp.current_process(), "_inheriting", False):
        sys.stderr.write(f"funcshard.testing.run: {_UNGUARDED}\n")
        sys.stderr.flush()
        os._exit(UNGUARDED_EXIT)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is not None and not os.path.isfile(main_file):
        raise RuntimeError(
            f"funcshard.testing.run: the main script is {main_file!r}, not a file, and worker "
            f"processes start by re-running it. Save it to a file and run that, with the calls "
            f'that start ranks under `if __name__ == "__main__":`.'
        )


def _worker_main(
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
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:
            break
        if payload == _QUIT:  # see WorkerPool.quit
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
            answer = collectives.last_issued()
        except Exception as e:  # never let the thread die: the next report would be empty
            answer = f"(unknown: {type(e).__name__}: {e})"
        with contextlib.suppress(OSError):
            probe.send_bytes(answer.encode())


def _run_task(rank: int, payload: bytes) -> bytes:
    collectives.reset_issued()  # numbered per task, so the ranks' numbers compare
    collectives.new_exchange_epoch()  # gloo exchanges tagged per task (see the function)
    try:
        result = _loads_task(payload)(rank)
        return pickle.dumps(("ok", pickle.dumps(result)))
    except BaseException as e:
        tb = traceback.format_exc()
        try:
            exc_bytes = pickle.dumps(e)
        except Exception:
            exc_bytes = None
        return pickle.dumps(("error", exc_bytes, tb))


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
