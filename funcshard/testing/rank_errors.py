"""What a call raises when ranks fail: the failing rank's exception rebuilt with its remote
traceback, `RankDied` for a rank that ended, and where each unfinished rank was waiting."""

from __future__ import annotations

import pickle
from typing import Any, TypeVar


class RankDied(RuntimeError):
    """A worker process ended while running a function (gloo aborts on mismatched collectives)."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised on another rank, attached as its `__cause__`."""

    def __str__(self) -> str:
        return self.args[0]


def waiting_in(pending: list[int], last: dict[int, str], stacks: dict[int, str]) -> str:
    """Each unfinished rank's last funcshard collective and Python stack, for a report."""
    return "\n".join(
        f"--- rank {r} (last funcshard collective issued: {last[r]}) was waiting in:\n{stacks[r]}"
        for r in pending
    )


def raised_before(replies: dict[int, tuple[Any, ...]]) -> str:
    """Name the ranks that raised before the call failed otherwise (their error is the cause)."""
    raised = sorted(r for r, reply in replies.items() if reply[0] == "error")
    return f"\nRanks {raised} raised first; see the cause above." if raised else ""


_E = TypeVar("_E", bound=BaseException)


def with_rank_cause(
    error: _E, replies: dict[int, tuple[Any, ...]], name: str, world_size: int
) -> _E:
    """Chain the first rank exception already received as the cause of a timeout or death."""
    errors = {r: reply for r, reply in replies.items() if reply[0] == "error"}
    if errors:
        error.__cause__ = rank_exception(errors, name, world_size)
    return error


def rank_exception(errors: dict[int, tuple[Any, ...]], name: str, world_size: int) -> BaseException:
    """Rebuild the lowest failing rank's exception, its remote traceback as the cause."""
    rank = min(errors)
    exc_bytes, tb = errors[rank][1:3]  # a 4th item: whether it left its state changed
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
