"""What a rank's collectives did, for the reports when one fails: the last collective issued
(numbered), whether the rank left a step mid-way, the first failure any rank recorded in the
store, and the CollectiveError that says all of it.

[Note: a rank out of step]
Every rank issues the same collectives in the same order. A rank whose step raises after
it issued some of the step's collectives (a bad batch, a bug on that rank alone) and
that carries on (the exception caught, the loop going on) is no longer in that order: the
others are still in the step's later collectives, and its next collective, of the next
step, would pair with one of theirs (gloo then aborts the process on mismatched shapes, in
about 2.5 s; with equal shapes the ranks would silently mix steps). So `value_and_grad`
and `call` note an exception escaping them after this rank's count of collectives moved
(`interruption`), and unless every rank of the mesh left the step at the same count
(the same error everywhere: they meet in the store within `waits.SETTLE`,
`waits.left_step`), the rank's next collective raises instead of being issued, naming
the interrupted step. Errors that funcshard raises on every rank together
(`NonFiniteError`, a `pmean` of trees that differ: marked `on_every_rank`) leave the
ranks in step, and a collective's own failure is already an error on every rank.
`fs.testing.run` starts each task in step.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from funcshard.comm import _progress as progress


class CollectiveError(RuntimeError):
    """A collective failed or timed out; says which one, for which unit, over which ranks."""


class _Issued:
    """The last collective this process issued, numbered: (count, op, unit, numel, dtype,
    group), one tuple so a reader on another thread never sees half of an update; for the
    collectives of a call of a compiled step (see [Note: bookkeeping outside compiled
    graphs] in comm/_collectives.py), op is "compiled", unit is (the step's name, the call's
    number) and numel how many collectives it issued (None if uncounted). `inside`: (name,
    call number) of the compiled call running now (None between calls), read apart from
    `last`."""

    last: tuple[int, str, Any, int | None, torch.dtype | None, ProcessGroup | None] | None = None
    inside: tuple[str, int] | None = None


def unit_words(what: str | None, preposition: str = "of") -> str:
    """ " of unit 'blocks.0'" for a collective's label (the root unit's name is empty), or
    nothing for an unlabelled collective."""
    if what is None:
        return ""
    return f" {preposition} the root unit" if what == "" else f" {preposition} unit {what!r}"


def last_issued() -> str:
    """The last collective funcshard issued in this process, numbered, in words ("none yet"
    before the first): compared across ranks, it shows where their sequences parted."""
    last, inside = _Issued.last, _Issued.inside
    words = "none yet" if last is None else _issued_words(*last)
    if inside is not None:
        name, call = inside
        words += f"; then call {call} of compiled step {name!r}, which has not returned"
    return words


def _issued_words(
    count: int,
    op: str,
    what: Any,
    numel: int | None,
    dtype: torch.dtype | None,
    group: ProcessGroup | None,
) -> str:
    if op == "compiled":
        name, call = what
        n = "its collectives (uncounted)" if numel is None else f"its {numel} collectives"
        return f"#{count}, the last of {n} in call {call} of compiled step {name!r}"
    try:
        ranks = f" over ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # the group was destroyed since
        ranks = ""
    return f"#{count}, {op}{unit_words(what)}{ranks}: {numel} x {dtype}"


def reset_issued() -> None:
    """Number collectives from 1 again (the test runner does, per task, so that the ranks'
    numbers compare), and forget a step this rank left mid-way (a new task, a new start)."""
    _Issued.last = None
    _Issued.inside = None
    _OutOfStep.reason = None


class _OutOfStep:
    """Why this rank is out of step with the others (None while in step)."""

    reason: str | None = None


def count_issued() -> int:
    """How many collectives this process issued (what `interruption` compares against)."""
    last = _Issued.last
    return last[0] if last is not None else 0


def interruption(error: BaseException, start: int) -> str | None:
    """What `error`, escaping a step that began at count `start`, did to this rank's order of
    collectives, in words, or None when it cannot have left it out of step: no collective
    of the step was issued, the error is a collective's own, or funcshard raised it on
    every rank together (see [Note: a rank out of step])."""
    if _OutOfStep.reason is not None or count_issued() == start:
        return None
    if isinstance(error, CollectiveError) or getattr(error, "on_every_rank", False):
        return None
    words = str(error).splitlines()[0][:300] if str(error) else ""
    return (
        f"{type(error).__name__}: {words} after this rank issued {count_issued() - start} "
        f"collective(s) of its step (the last: {last_issued()})"
    )


def out_of_step(reason: str) -> None:
    """Refuse this rank's next collectives, saying `reason` (see [Note: a rank out of step]),
    and tell the other ranks at once through its progress record."""
    _OutOfStep.reason = reason
    progress.publish()


def _refuse_out_of_step(op: str, what: str | None) -> None:
    raise CollectiveError(
        f"rank {dist.get_rank()}: {op}{unit_words(what)} was not issued: this rank left a "
        f"step mid-way. {_OutOfStep.reason}. The other ranks are still in that step's "
        f"collectives, so this one would pair with one of theirs. Let the exception end the "
        f"rank (fs.fail_fast() ends every rank together), or restart all ranks."
    )


def entering_compiled(name: str, call: int) -> None:
    """Mark call number `call` of the compiled step `name` as running (until
    `left_compiled`): a rank stuck inside its graph then says so in `last_issued`."""
    _Issued.inside = (name, call)


def left_compiled(name: str, call: int, issued: int | None) -> None:
    """Count call `call` of the compiled step `name` as returned, having issued `issued`
    collectives inside its graphs (None: not known) after the ones counted before it."""
    count = count_issued() + (issued or 0)
    if issued != 0:
        _Issued.last = (count, "compiled", (name, call), issued, None, None)
    _Issued.inside = None


def check_in_step(op: str, what: str | None) -> None:
    """Raise instead of issuing `op` if this rank left a step mid-way (see [Note: a rank out
    of step])."""
    if _OutOfStep.reason is not None:
        _refuse_out_of_step(op, what)


def count_as_issued(op: str, group: ProcessGroup, tensor: Tensor, what: str | None) -> None:
    """Count the collective as the last issued; the first starts publishing progress."""
    count = _Issued.last[0] + 1 if _Issued.last is not None else 1
    _Issued.last = (count, op, what, tensor.numel(), tensor.dtype, group)
    if progress.Here.store is None:
        _publish_progress()


def failed(
    op: str, group: ProcessGroup | None, what: str | None, cause: BaseException
) -> CollectiveError:
    """The error for `op` over `group` that did not complete (`cause`): with the first failure
    any rank recorded, this rank's last collective and where the other ranks are."""
    progress.Here.waiting = None
    ranks = dist.get_process_group_ranks(group) if group is not None else "?"
    unit = unit_words(what)
    first = first_failure()
    first = f"First failure (recorded by fs.fail_fast): {first}.\n" if first else ""
    if any(mark in str(cause).lower() for mark in ("reset by peer", "connection closed")):
        time.sleep(0.5)  # a killed peer's sockets close before its process is gone
    others = progress.report(ranks, count_issued()) if isinstance(ranks, list) else ""
    others = f"Where the other ranks are (their progress records):\n{others}\n" if others else ""
    return CollectiveError(
        f"rank {dist.get_rank()}: {op}{unit} over ranks {ranks} did not complete: {cause}\n"
        f"{first}The last funcshard collective this rank issued: {last_issued()}.\n{others}"
        f"{_why_not_joined(others)}"
    )


def _why_not_joined(others: str) -> str:
    """The likely causes, given where the other ranks are: a process gone or stopped says
    it all; otherwise they hung, or took another path."""
    if progress.absent(others):
        return (
            "Another rank's process has exited or is stopped (above), so the collective "
            "cannot complete; restart the job (funcshard.checkpoint.load resumes it)."
        )
    return (
        "The other ranks of the group did not join it in time: one died or hung, or the "
        "ranks took different paths (e.g. batch shapes that change which units run, or a "
        "forward or an evaluation run on some ranks only). Mesh(timeout=...) bounds the "
        "wait; Mesh(check_collectives=True) (or FUNCSHARD_CHECK_COLLECTIVES=1) compares "
        "every collective across ranks first and names the first that differs."
    )


@contextlib.contextmanager
def every_rank_calls(call: str, ranks: list[int]) -> Iterator[None]:
    """Mark the block as `call` (e.g. "funcshard.checkpoint.save"), which every rank of
    `ranks` must make at the same point: the other ranks' reports name it while this rank
    is inside, and a collective failing inside it (torch's own, as DCP's, or funcshard's)
    raises a CollectiveError that names it, says where the other ranks are and that every
    rank calls it. A rank that calls it alone thus fails within the group's timeout, with
    funcshard's error, and so do the ranks it left waiting elsewhere."""
    outer, progress.Here.call = progress.Here.call, call
    try:
        yield
    except CollectiveError as e:
        raise CollectiveError(f"{e}\n{_alone_words(call)}") from e
    except Exception as e:
        if isinstance(e, OSError) or not is_failure(e):  # (a disk's error is not a peer's)
            raise
        progress.Here.waiting = None
        others = progress.report(ranks, count_issued())
        others = (
            f"Where the other ranks are (their progress records):\n{others}\n" if others else ""
        )
        raise CollectiveError(
            f"rank {dist.get_rank()}: {call} did not complete: {e}\nThe last funcshard "
            f"collective this rank issued: {last_issued()}.\n{others}{_alone_words(call)}"
        ) from e
    finally:
        progress.Here.call = outer


def _alone_words(call: str) -> str:
    return (
        f"This rank was inside {call}, which every rank of the mesh calls at the same point "
        f"(not under `if rank == 0:`): if the other ranks above are not inside it, this "
        f"rank called it alone, and they wait in their next collective."
    )


def _publish_progress() -> None:
    """Start publishing this rank's progress in the default store (see [Note: naming the
    rank that is behind]); the first collective does, once per process group."""
    with contextlib.suppress(Exception):  # no default group or store: nothing to publish to
        progress.start(_default_store(), dist.get_rank())


def _progress_source() -> tuple[int, str] | None:
    """The last collective's count and words, for the progress writer."""
    last, out = _Issued.last, _OutOfStep.reason
    if last is None:
        return None
    return (last[0], last_issued() + (f"; then it left that step: {out}" if out else ""))


def _collective_words(op: str, what: str | None) -> str:
    return f"{op}{unit_words(what)}"


progress.watch(_progress_source, _collective_words)


def record_failure(what: str) -> str | None:
    """Record this rank's failure (`what`, in words) in the default process group's store
    unless another rank's is there already; return the one recorded first (None without a
    reachable store). One store round trip, for the failure path only (funcshard.failfast)."""
    try:
        first = _default_store().compare_set(_failure_key(), "", what)
    except Exception:  # no process group, or its store went with the rank that hosted it
        return None
    return first.decode(errors="replace")


def first_failure() -> str | None:
    """The failure a rank recorded first with `record_failure`, if any; never waits for one."""
    try:
        store, key = _default_store(), _failure_key()
        return store.get(key).decode(errors="replace") if store.check([key]) else None
    except Exception:
        return None


def _default_store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _failure_key() -> str:
    # Per elastic restart: torchrun's store outlives a round, and its failure is not the next's.
    return f"funcshard/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


_FAILURE_MARKS = ("gloo", "nccl", "connection closed", "timed out waiting")


def is_failure(error: BaseException) -> bool:
    """Whether `error` came from a collective: torch's distributed errors, or gloo's and
    NCCL's plain RuntimeErrors (which name the library or the transport's wait)."""
    if isinstance(error, dist.DistError):
        return True
    message = str(error).lower()
    return any(mark in message for mark in _FAILURE_MARKS)
