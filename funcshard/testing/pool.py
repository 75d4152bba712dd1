"""A pool of ranks kept across calls, from the parent's side: it starts them, sends each task
to every rank, collects the replies, and reports ranks that die, hang or raise.

[Note: the worker pool]
Starting gloo ranks costs seconds (a fresh interpreter imports torch, then a rendezvous), and a
test suite makes hundreds of multi-rank calls, so ranks are started once per world size and
kept: each waits for a pickled function, runs `fn(rank)`, and sends back a pickled result or
exception. The parent hosts the TCPStore (port 0, so no port can clash) and stays outside the
process group.

Workers start from a forkserver that has already imported torch: forking it is ~0.1 s, against
~2 s for a spawned interpreter, and it is safe where forking the caller is not (the caller may
have started OpenMP or CUDA threads). It imports torch._dynamo too: building any module on the
meta device reaches a dynamo-disabled function (nn.init's normal_), whose first call imports
dynamo and sympy, 1.1-1.4 s of CPU in every rank that was forked without them. Everything
crosses the pipe as plain pickle bytes, so tensors travel by value, never through shared-memory
file descriptors.

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

import contextlib
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch.distributed as dist

from funcshard.testing.rank_errors import (
    RankDied,
    RemoteTraceback,
    raised_before,
    rank_exception,
    waiting_in,
    with_rank_cause,
)
from funcshard.testing.worker import (
    QUIT,
    UNGUARDED,
    UNGUARDED_EXIT,
    dumps_task,
    task_name,
    worker_main,
)

if TYPE_CHECKING:  # the contexts of the start methods (BaseContext itself has no Process)
    from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext

    _Context = SpawnContext | ForkServerContext | ForkContext

T = TypeVar("T")


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
                target=worker_main,
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
        payload = dumps_task(fn)
        for conn in self._conns:
            # a rank already gone (one that died starting up) is reported by _collect
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.send_bytes(payload)
        replies = self._collect(task_name(fn), timeout)
        errors = {r: reply for r, reply in replies.items() if reply[0] == "error"}
        if errors:
            error = rank_exception(errors, task_name(fn), self.world_size)
            if any(reply[3] for reply in errors.values()):  # a rank's state changed: not
                self.quit()  # reusable, the next call starts a fresh pool
            raise error
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
            f"starts a fresh one.\n{where}{raised_before(replies)}"
        )
        return with_rank_cause(error, replies, name, self.world_size)

    def _stranded(
        self, name: str, pending: list[int], replies: dict[int, tuple[Any, ...]]
    ) -> BaseException:
        """The first rank exception, once the ranks still running had `ERROR_GRACE` seconds to
        finish after it: they are usually waiting in a collective that the raising rank never
        entered, which only the timeout would end. The note says where each was waiting; the
        pool is killed (their process group is stuck)."""
        where = self._where_and_kill(pending)
        errors = {r: reply for r, reply in replies.items() if reply[0] == "error"}
        error = rank_exception(errors, name, self.world_size)
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
                f"start: {UNGUARDED}"
            )
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        finished = sorted(replies)
        error = RankDied(
            f"testing.run({name}, world_size={self.world_size}): rank {rank} died with {how} "
            f"(finished before it: {finished}). {_why_it_died(code)}The pool was killed; the "
            f"next call starts a fresh one.{raised_before(replies)}"
        )
        return with_rank_cause(error, replies, name, self.world_size)

    def _where_and_kill(self, pending: list[int]) -> str:
        """Where each unfinished rank was waiting (its last collective and Python stack), for
        a report; then the pool is killed (their process group is stuck)."""
        try:
            return waiting_in(pending, self._last_collectives(pending), self._stacks(pending))
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
        asked = []
        for r in ranks:
            pid = self._procs[r].pid
            if pid is not None and self._procs[r].is_alive():
                os.kill(pid, signal.SIGUSR1)
                asked.append(os.path.join(self._stack_dir, f"rank{r}.stack"))
        _wait_for_stacks(asked)
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
                    conn.send_bytes(QUIT)
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


DEATH_GRACE = 10.0  # seconds the surviving ranks get to report after one dies
# Seconds the other ranks get to finish after one raises: ranks that raise the same error do
# so within milliseconds, and a rank still running later is usually waiting on the one that
# raised. Long enough for a loaded 2-core machine, short against a hypothesis shrink.
ERROR_GRACE = 2.0


def _context(start_method: str | None) -> _Context:
    """Forkserver with torch preloaded where the platform has it, else spawn."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = cast("_Context", mp.get_context(start_method))  # the named method's context
    if start_method == "forkserver":
        preload = ["torch", "torch.distributed", "torch._dynamo", "funcshard.testing.worker"]
        ctx.set_forkserver_preload(preload)  # (see [Note: the worker pool])
    return ctx


QUIT_GRACE = 5.0  # seconds an idle worker gets to exit normally; a busy one is then killed
STACK_WAIT = 0.5  # seconds the asked ranks get to write their stacks, at most
STACK_POLL = 0.02  # seconds between looks at the stack files


def _wait_for_stacks(paths: list[str]) -> None:
    """Wait until each file in `paths` holds a stack that stopped growing, or `STACK_WAIT`.

    faulthandler writes a rank's stacks from its signal handler, within milliseconds of the
    signal, so waiting the whole `STACK_WAIT` every time (as a plain sleep did) cost each
    timeout report, and each test that waits for one on purpose, half a second for nothing.
    A file is done when it is not empty and its size did not change over one poll.
    """
    deadline = time.monotonic() + STACK_WAIT
    last: dict[str, int] = {}
    while time.monotonic() < deadline:
        time.sleep(STACK_POLL)
        sizes = {p: _size(p) for p in paths}
        if all(sizes[p] > 0 and sizes[p] == last.get(p) for p in paths):
            return
        last = sizes


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _why_it_died(code: int | None) -> str:
    """What a worker's exit code suggests, in words: only an abort (signal 6) is what gloo
    does on mismatched collectives, and only a kill (9) is the out-of-memory killer's."""
    if code == -signal.SIGABRT:
        return (
            "gloo aborts a process on mismatched collective shapes (or a C++ assertion "
            "failed); see the rank's stderr above. "
        )
    if code == -signal.SIGKILL:
        return "SIGKILL: the out-of-memory killer, or a kill -9 from outside. "
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else "a signal"
        return f"{name} from outside, or a crash; see its stderr above. "
    return "See the rank's stderr above. "
