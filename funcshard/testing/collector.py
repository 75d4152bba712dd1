"""The garbage collector in pool workers: what a worker keeps for good is frozen, so that the
collections its tasks cause walk only what the tasks made.

[Note: a worker's long-lived objects are frozen]
A pool worker holds about 300k objects once it has compiled (torch, dynamo, inductor, sympy).
Each full collection walks all of them: about 0.5 s, on every rank. `fs.testing.dynamo`'s
reset collects after each compiled task, and dynamo's tracing allocates enough to start
full collections by itself. `gc.freeze()` moves every object alive into the permanent
generation, which no collection walks and `gc.get_objects()` does not list.

So a worker freezes once started (torch's objects, `worker_main`), and again after each
isolated compiled task's reset (dynamo's and inductor's modules, the first time; `collect`).
Each time a collection runs first (`freeze_survivors`), so only reachable objects are
frozen: what survived a collection between tasks, the worker's own state. A frozen cycle that
later becomes garbage is never freed; between tasks that is none of a task's objects. A
test's own process (an isolated function called there) only collects, as before.

Leak tests walk only the objects their task makes (`only_new_objects`). They used to freeze
at their start and `gc.unfreeze()` at their end, which thawed the worker's frozen set too.
Now the end thaws only if nothing was frozen before: in a worker, what was alive at the
task's start stays frozen (after a collection, cheap here, so no garbage is frozen).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_survivors() -> None:
    """Collect, then freeze every object left (see [Note: a worker's long-lived objects are
    frozen]). The collection walks only what is not frozen yet."""
    gc.collect()
    gc.freeze()


def collect() -> None:
    """Collect; in a process that froze its long-lived objects (a pool worker), freeze what
    is left too. Elsewhere (a test's own process) only collect, as before: what a test keeps
    alive there may become cyclic garbage later, which a freeze would never free."""
    if gc.get_freeze_count():
        freeze_survivors()
    else:
        gc.collect()


@contextlib.contextmanager
def only_new_objects() -> Iterator[None]:
    """Inside the block, `gc.collect()` and `gc.get_objects()` see only objects made inside
    it: every object alive at its start is frozen. At its end they are thawed if nothing was
    frozen before it; otherwise (a pool worker) they stay frozen with the worker's own."""
    thaw = gc.get_freeze_count() == 0
    if thaw:
        gc.freeze()  # no collection first: it would walk every object alive
    else:
        freeze_survivors()
    try:
        yield
    finally:
        if thaw:
            gc.unfreeze()
