"""Waits for other ranks through the process group's store, bounded by a timeout of their own.

[Note: waits long by nature]
A funcshard collective waits for the other ranks at most its group's timeout (`Mesh.timeout`,
10 minutes unless set). Some waits are long by nature, and a collective there would be cut by
that bound: while the first rank of a mesh writes a `save_hf` file (up to `max_shard_size`
bytes) the others have nothing to do. Such a wait goes through the default process group's
store instead (`Store.wait`, with a bound given by the caller), which holds no connection of
the process group and costs one store round trip per rank. Each rank's arrival is a key of
its own, so a wait that runs out names the ranks that never arrived. A waiting rank polls the
store (backing off to 4 checks a second), never `Store.wait` with a short timeout, whose every
expiry logs a socket warning.

The same wait lets `fs.shutdown` return or raise within its own timeout: gloo's monitored
barrier bounds only the first rank's wait by the timeout it is given, the other ranks wait
out the group's (10 minutes, or gloo's 30), so a rank that left its loop while another was
still in it waited that long in `shutdown` without a word.

While it waits, a rank looks every few seconds for a failure another rank recorded with
`fs.fail_fast` and raises naming it at once.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from funcshard.comm import _failures as failures

_POLL_S = 5.0  # how often a long wait looks for a failure recorded by fail_fast
_ROUNDS: dict[tuple[str, tuple[int, ...]], int] = {}  # (name, ranks) -> completed waits


def every_rank_arrives(
    name: str, ranks: Sequence[int], timeout: timedelta, where: str, advice: str
) -> None:
    """Return once every global rank in `ranks` has called this with the same `name`, or
    raise `CollectiveError` after `timeout`, naming the ranks that did not arrive (`advice`
    says how to fix it). Every rank in `ranks` must call it the same number of times.

    Communicates: through the default process group's store only (one key per rank), never
    through a process group, so the wait is bounded by `timeout` alone.
    """
    ranks = tuple(ranks)
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    rounds = _ROUNDS.get((name, ranks), 0)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    among = zlib.crc32(repr(ranks).encode())  # a short key whatever the number of ranks
    prefix = f"funcshard/waits/{restart}/{name}/{len(ranks)}-{among:08x}/{rounds}"
    keys = [f"{prefix}/{r}" for r in ranks]
    mine = f"{prefix}/{rank}"
    store.set(mine, "1")
    now = time.monotonic()
    deadline, failures_read, pause = now + timeout.total_seconds(), now, 0.001
    while not _all_there(store, keys, where, ranks):
        now = time.monotonic()
        first = None
        if now - failures_read > _POLL_S or now >= deadline:
            first, failures_read = failures.first_failure(), now
        if first is not None or now >= deadline:
            missing = [r for r, key in zip(ranks, keys, strict=True) if not store.check([key])]
            if not missing:
                break
            store.delete_key(mine)  # not arrived: a later call waits in this round again
            recorded = f" First failure (recorded by fs.fail_fast): {first}." if first else ""
            raise failures.CollectiveError(
                f"{where}: every rank of {list(ranks)} within {_seconds(timeout)}, got "
                f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} not there "
                f"(rank {rank} waited).{recorded} {advice}"
            )
        # polled, not Store.wait: a wait that runs out logs a socket warning each time
        time.sleep(min(pause, max(0.0, deadline - now)))
        pause = min(2 * pause, 0.25)
    _ROUNDS[(name, ranks)] = rounds + 1


def _all_there(store: dist.Store, keys: list[str], where: str, ranks: tuple[int, ...]) -> bool:
    """Whether every rank's key is in the store (one round trip)."""
    try:
        return store.check(keys)
    except Exception as e:  # the store went with the rank that hosted it
        raise failures.CollectiveError(
            f"{where}: rank {dist.get_rank()} could not reach the process group's store while "
            f"waiting for ranks {list(ranks)}: {e}. The rank that hosted it has probably ended."
        ) from e


def _seconds(timeout: timedelta) -> str:
    return f"{timeout.total_seconds():g} s"


SETTLE = timedelta(seconds=3)  # how long a rank that left a step looks for the others there


def left_step(where: str, error: BaseException, start: int, ranks: Sequence[int]) -> None:
    """`where` raised `error` on this rank in a step that began at collective count `start`:
    unless every rank of `ranks` left at the same count within `SETTLE` (the same error on
    every rank), this rank is out of step (see [Note: a rank out of step] in
    comm/_failures.py). Costs nothing unless the step raised after issuing collectives."""
    reason = failures.interruption(error, start)
    if reason is None:
        return
    try:
        every_rank_arrives(
            f"left-step-at-{failures.count_issued()}", ranks, SETTLE, where, "(settling)"
        )
    except failures.CollectiveError:
        failures.out_of_step(f"{where} raised {reason}")
