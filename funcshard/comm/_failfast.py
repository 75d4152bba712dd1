"""Fail fast: a rank that raises ends at once, so the other ranks' collectives raise too.

[Note: failing fast]
A rank that raises while the others wait in a collective it never enters leaves them waiting
out the mesh's timeout (10 minutes by default). Under torchrun an uncaught exception usually
ends the process and the agent then stops the others, but often the process does not end:
a `finally: fs.shutdown()` waits for ranks that are stuck elsewhere (up to its own timeout,
30 s by default), a non-daemon thread keeps the interpreter alive, or the rank catches the
exception to log it. Measured under torchrun with `Mesh(timeout=60 s)` and
`try: ... finally: fs.shutdown()` (when shutdown still waited in a gloo barrier): rank 1
raised at once, rank 0 raised after the whole 60 s.

Aborting the process group would be the natural way to wake the others, but on gloo
`ProcessGroup.abort()` and `.shutdown()` (torch 2.13) close no connection: a peer blocked in
a collective keeps waiting. What does end its wait is the failing process ending: gloo sees
the connection close and the peer's pending or next collective with it raises within
milliseconds (`fs.CollectiveError`, as for a killed rank). So `fail_fast` ends the failing
process itself, at once, with `os._exit`, after recording its exception in the default
process group's store: a `CollectiveError` on another rank then names the rank that failed
first and why, instead of only "connection closed by peer". Nothing runs on the normal path:
no thread, no store access, no check per collective.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator

from funcshard.comm import _failures as failures
from funcshard.comm import _process_groups as process_groups

EXIT_CODE = 1  # what torchrun's agent and a shell see: the rank failed


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
    """End this process at once when an exception escapes the block, so that the other ranks'
    pending and next collectives with this rank raise `fs.CollectiveError` within a second
    instead of waiting out `Mesh(timeout=...)`.

    Before it leaves, the rank records `rank R raised Type: message` in the default process
    group's store (the first rank to fail is kept), prints its traceback and exits with code 1.
    Nothing after the block runs on it: no `finally` outside the block, no atexit handler (they
    could wait on the other ranks, e.g. `fs.shutdown()`'s wait for every rank). A rank whose
    collective failed because another left says which rank failed first. Wrap a rank's whole work
    (`with fs.fail_fast(): train(...)`, or `@fs.fail_fast()` on its main function) and catch
    inside it the exceptions meant to be handled. KeyboardInterrupt and SystemExit pass through.

    Communicates: nothing unless an exception escapes; then one store round trip.
    """
    try:
        yield
    except Exception as e:
        _leave(e)


def _leave(error: Exception) -> None:
    """Record `error` for the other ranks, print it and end the process (see [Note: failing
    fast])."""
    with contextlib.suppress(Exception):  # leave even if the report fails
        rank = process_groups.global_rank()
        mine = f"rank {rank} raised {type(error).__name__}: {_summary(error)}"
        first = failures.record_failure(mine)
        if first is not None and first != mine and hasattr(error, "add_note"):
            error.add_note(f"fail_fast: {first} first; this rank's error may follow from it.")
        traceback.print_exception(error)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(EXIT_CODE)


def _summary(error: Exception) -> str:
    """The first line of the error's message, at most 200 characters."""
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= 200 else line[:197] + "..."
