"""Eager all-gathers and reduce-scatters on gloo as point-to-point exchanges: each rank sends
every peer its part directly, under tags every rank of the group counts alike.

[Note: gloo collectives as exchanges]
torch's gloo backend runs an all-gather or a reduce-scatter through its collective
algorithms on the process group's worker threads, and composes the reduce-scatter from a
full all-reduce: on 2 ranks of one machine a 7 MB all-gather took 6.0 ms and a 7 MB
reduce-scatter 8.2 ms, where each rank sending every peer its part directly (gloo's `send`
and `recv`, which run on its transport threads) took 3.1 ms for the all-gather, and the
same pattern for the reduce-scatter (through `all_to_all_single`, then a local sum) 4.9
ms. Both move the bytes a ring does, (n - 1) / n of the buffer per rank, and the
reduce-scatter no longer moves the all-reduce's second half; in a 14M-parameter GPT step
on 2 ranks they took funcshard from 298 to 265 ms. So eager all-gathers and
reduce-scatters on gloo are exchanges:

- all-gather: a rank copies its shard into its own chunk of the output, sends the shard to
  every peer and receives each peer's shard into that peer's chunk;
- reduce-scatter: a rank sends chunk p of its input to rank p and receives its own chunk
  from every peer (the first peer's straight into the output, the others' into a buffer
  each), then adds them up, in one fixed order, at `wait`: its own chunk into the output,
  the other buffers into the first of them, that into the output. In place, so the sum
  makes no temporary: `others.sum(0)` made one of the chunk's size, and at an owned step's
  peak (10M GPT, 4 ranks, `benchmarks.muon`) that was 2.25 MiB beside the input it was
  summed from. The same order as that sum for up to 4 ranks, so the same bits.

Every exchange on a group takes the next tag of that group's counter, which every rank of
the group advances alike, since they issue the same collectives in the same order: a
message can only meet the receive posted for it, however many exchanges are in flight.
A peer that never sends surfaces as the receive's timeout (the process group's), raised at
`wait`.

[Note: the exchange's header in its tag]
Ranks that are not in the same collective (a forward on rank 0 alone, an evaluation only
the first rank runs) still pair their exchanges by count: rank 0's all-gather of one unit
met rank 1's reduce-scatter of another, and gloo aborted the process on the sizes (signal
6, no Python traceback), or, with equal sizes, the ranks silently read each other's
buffers. So a tag also holds a header: a 10-bit checksum of the exchange's op, unit, numel
and dtype. Exchanges that differ in any of those are under different tags, so a message
never meets the other collective's receive; each rank's receive waits out the group's
timeout instead and raises a CollectiveError naming its own collective and where the other
ranks are (their progress records). It costs nothing per exchange (a dictionary lookup);
two different exchanges alike in their checksums (1 in 1024) fail as before. A tag is
(epoch: 5 bits, header: 10, count: 16): counts wrap after 65,536 exchanges on a group, far
beyond any in flight.

Each direction between two ranks has a connection of its own: a rank sends to higher ranks
through the group and to lower ranks through the group's twin (`_carrier`), a second gloo
group of the same ranks, made by the group's ranks at their first exchange on it. gloo
holds a pair's lock while its transport thread moves a payload, so with one connection a
rank's `send` waited behind the peer's data arriving on the same pair: 3-8 ms per forward
of the 14M-parameter GPT on 2 ranks. There, funcshard FSDP's step against DDP's went from
1.009-1.031 (mean 1.020) to 0.986-1.024 (mean 0.996) in 4 pairs of alternating processes,
and `python -m benchmarks.training` gave 0.97-0.99 in 5 runs of 5 (0.96-1.06 before).

[Note: the uneven exchange]
An owned unit's buffer is split evenly, but rank r's shard holds only `loads[r]` elements
of whole parameters, then zero padding up to the largest rank's load (see [Note: owned
placement] in funcshard/core/_placement.py). Its callers pass the layout's `loads` down,
and on gloo the exchange sends no padding:

- all-gather: rank r sends its peers `shard[:loads[r]]`; it receives `loads[p]` elements
  into the start of peer p's chunk and zeroes the rest of that chunk (a memset: a gathered
  buffer's padding is never read for a parameter, but zero keeps it what the padded
  all-gather gave, so nothing downstream can tell). Its own chunk is its whole shard.
- reduce-scatter: rank j sends peer p only `parts[p][:loads[p]]`; the owner sums the first
  `loads[me]` elements and zeroes the rest of its result, which the padded sum of zero
  gradients gave as well.

A pair where the sender's part is empty (a rank owning nothing) exchanges no message; both
sides know it from the same layout. The header keeps the padded numel (the same on every
rank), and so do the trail and the collective checks; a `collectives.record()` entry
carries what this rank sent (see [Note: recorded sizes of an uneven exchange] in
funcshard/comm/_records.py). Each rank sends a different amount: over a step, rank r
sends `(n - 1) * loads[r]` per all-gather and `total - loads[r]` per reduce-scatter, so
the ranks together send what an even split of the unpadded buffer sends.

Everywhere else an owned unit keeps the padded collective. NCCL's all-gather and
reduce-scatter take equal sizes per rank; the alternative is grouped send/recv
(`batch_isend_irecv`), which moves the real bytes but runs as n - 1 point-to-point kernels
per rank instead of one ring or tree kernel, loses NCCL's collective algorithms (NVLS,
rings over NVLink), and costs a launch per peer. With padding at most the largest rank's
load less the mean (a few percent of a block in practice, +25% of the gathered bytes of
the 10M GPT at 4 ranks), the padded collective is the one to keep until a GPU run shows
otherwise. The fake group communicates nothing, so padding costs it nothing. Traced steps
(make_fx, `fs.compile`) issue functional collectives, which have no uneven all-gather the
compiler could place, so their graphs keep the padded ops. On gloo too, three paths still
send padding: a user's `Comm` (it is given the padded shard), the regather from k-rank
slices (`reshard_after_forward=k`, over a group whose ranks hold slices, not loads), and
HSDP's all-reduce across replicas (of the shard, padding included).
"""

from __future__ import annotations

import contextlib
import itertools
import zlib
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

_TAGS: dict[str, Iterator[int]] = {}
_COUNT_BITS, _HEADER_BITS, _EPOCH_BITS = 16, 10, 5  # a tag, below gloo's 31 bits: see
# [Note: the exchange's header in its tag]
_epoch = 0


class Exchange:
    """The sends and receives of one exchange in flight; `wait()` waits for all of them and
    then runs what finishes the result (the reduce-scatter's sum)."""

    __slots__ = ("_finish", "_group", "_timeout", "_works")

    def __init__(
        self,
        group: ProcessGroup,
        works: list[dist.Work],
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._group = group
        self._works = works
        self._timeout = _timeout(group)  # gloo's point-to-point waits default to forever
        self._finish = finish

    def __del__(self) -> None:
        if self._works:  # dropped unwaited (a prefetch nobody used): see `_wait_orphans`
            _ORPHANS.append((self._group, self._works, self._timeout))
            del _ORPHANS[:-_ORPHANS_KEPT]  # those of groups destroyed since go unwaited

    def wait(self) -> None:
        for work in self._works:
            work.wait(self._timeout)
        self._works = []  # they hold the buffers
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


def all_gather(
    shard: Tensor, group: ProcessGroup, what: str | None = None, loads: tuple[int, ...] = ()
) -> tuple[Tensor, Exchange]:
    """Start gathering every rank's 1-D `shard` in rank order; returns the output (read it
    only after the exchange's `wait`) and the exchange. `what` (the unit) goes into the
    header (see [Note: the exchange's header in its tag]). `loads`: each rank's real
    elements; only those are sent (see [Note: the uneven exchange])."""
    _wait_orphans(group)
    n, me = group.size(), group.rank()
    tag = _next_tag(group, header("all_gather", what, shard))
    out = shard.new_empty(shard.numel() * n)
    for observe in _GATHER_OBSERVERS:
        observe(out)
    chunks = out.view(n, -1)
    peers = _peers(n, me)
    load = _loads(loads, n, shard.numel())
    mine = shard[: load[me]]
    works = [_carrier(group, me, peer).send([mine], peer, tag) for peer in peers if load[me]]
    works += [
        _carrier(group, peer, me).recv([chunks[peer][: load[peer]]], peer, tag)
        for peer in peers
        if load[peer]
    ]
    chunks[me].copy_(shard)  # while the transport threads move the peers' parts
    for peer in peers:
        chunks[peer][load[peer] :].zero_()  # padding nobody sent (none when even)
    return out, Exchange(group, works)


def reduce_scatter(
    flat: Tensor,
    group: ProcessGroup,
    op: str,
    what: str | None = None,
    loads: tuple[int, ...] = (),
) -> tuple[Tensor, Exchange]:
    """Start reducing 1-D `flat` (op "avg" or "sum"); rank r's result is chunk r. Returns
    the result (read it only after the exchange's `wait`) and the exchange. Holds `flat`
    until its chunks are sent, and besides the result, a receive buffer for the peers past
    the first (none on 2 ranks)."""
    _wait_orphans(group)
    n, me = group.size(), group.rank()
    tag = _next_tag(group, header("reduce_scatter", what, flat))
    parts = flat.view(n, -1)
    peers = _peers(n, me)
    load = _loads(loads, n, parts.shape[1])
    out = flat.new_empty(parts.shape[1])
    mine = out[: load[me]]  # what the peers send: all of `out` when even
    others = flat.new_empty(n - 2, load[me]) if n > 2 else None
    targets = [mine, *(others.unbind(0) if others is not None else ())][: n - 1]
    works = [
        _carrier(group, me, peer).send([parts[peer][: load[peer]]], peer, tag)
        for peer in peers
        if load[peer]
    ]
    works += [
        _carrier(group, peer, me).recv([into], peer, tag)
        for peer, into in zip(peers, targets, strict=True)
        if load[me]
    ]

    def finish() -> None:
        if n > 1:
            mine.add_(parts[me][: load[me]])
        else:  # one rank, under communicate_alone: nothing was received
            mine.copy_(parts[me][: load[me]])
        if others is not None:  # in place, no temporary: see [Note: gloo collectives as exchanges]
            rest = others[0]
            for row in others[1:]:
                rest.add_(row)
            mine.add_(rest)
        out[load[me] :].zero_()  # the padding nobody sent (none when even)
        if op == "avg":
            mine.div_(n)

    return out, Exchange(group, works, finish)


def _loads(loads: tuple[int, ...], n: int, chunk: int) -> tuple[int, ...]:
    """Each rank's elements to exchange: `loads` (an owned unit's), or whole chunks."""
    return loads or (chunk,) * n


def _carrier(group: ProcessGroup, source: int, destination: int) -> ProcessGroup:
    """The group whose connection carries an exchange's message from group rank `source` to
    `destination`: the group itself upwards, its twin downwards (see [Note: gloo collectives
    as exchanges])."""
    if source < destination:
        return group
    entry = _TWINS.get(group.group_name)
    if entry is None or entry[0] is not group:  # (a name reused by a later group: a new twin)
        twin = dist.new_group(
            dist.get_process_group_ranks(group),
            timeout=_timeout(group),
            backend="gloo",
            use_local_synchronization=True,  # made by the group's ranks alone
        )
        entry = _TWINS[group.group_name] = (group, twin)
    return entry[1]


_TWINS: dict[str, tuple[ProcessGroup, ProcessGroup]] = {}  # group name -> (group, its twin)


def _peers(n: int, me: int) -> list[int]:
    """The other ranks, starting after this one (so that on more than 2 ranks, rank pairs
    do not all start with rank 0)."""
    return [(me + k) % n for k in range(1, n)]


_ORPHANS: list[tuple[ProcessGroup, list[dist.Work], timedelta]] = []
_ORPHANS_KEPT = 64
_GATHER_OBSERVERS: list[Callable[[Tensor], None]] = []


@contextlib.contextmanager
def observe_gathers(observe: Callable[[Tensor], None]) -> Iterator[None]:
    """Call `observe(output)` with the output of every gloo exchange all-gather issued inside
    the block: no all-gather op is dispatched for it, so memory probes that watch for one
    (funcshard.testing.probes.GatheredBytes) learn of it here."""
    _GATHER_OBSERVERS.append(observe)
    try:
        yield
    finally:
        _GATHER_OBSERVERS.remove(observe)


def _wait_orphans(group: ProcessGroup) -> None:
    """Finish the exchanges on `group` dropped before their wait. Unlike a collective, which
    completes once every rank issued it, a send or receive dropped half done leaves its
    peer's partner waiting, and gloo's pair with it; so a dropped exchange's works are kept
    and waited here, before the group's next exchange is issued. Every rank of the group
    issued the dropped one before this point (same collectives, same order), so its
    messages are on their way."""
    mine = [entry for entry in _ORPHANS if entry[0] is group]
    if not mine:
        return
    _ORPHANS[:] = [entry for entry in _ORPHANS if entry[0] is not group]
    for _, works, timeout in mine:
        for work in works:
            work.wait(timeout)


def _timeout(group: ProcessGroup) -> timedelta:
    """The group's collective timeout (looked up once per group)."""
    timeout = _TIMEOUTS.get(group.group_name)
    if timeout is None:
        backend = group._get_backend(torch.device("cpu"))
        timeout = _TIMEOUTS[group.group_name] = backend.options._timeout
    return timeout


_TIMEOUTS: dict[str, timedelta] = {}


def described(op: str, what: str | None, numel: int, dtype: torch.dtype) -> int:
    """A collective's op, unit, element count and dtype as a 32-bit checksum, the same on
    every rank (the exchange's header, and the collectives' trail in comm/_trail.py)."""
    key = (op, what, numel, dtype)
    found = _DESCRIBED.get(key)
    if found is None:
        found = _DESCRIBED[key] = zlib.crc32(f"{op}|{what}|{numel}|{dtype}".encode())
    return found


_DESCRIBED: dict[tuple[str, str | None, int, torch.dtype], int] = {}


def header(op: str, what: str | None, tensor: Tensor) -> int:
    """The exchange's header: its description's checksum, cut to the tag's bits."""
    return described(op, what, tensor.numel(), tensor.dtype) % (1 << _HEADER_BITS)


def _next_tag(group: ProcessGroup, checksum: int) -> int:
    counter = _TAGS.get(group.group_name)
    if counter is None:
        counter = _TAGS[group.group_name] = itertools.count()
    epoch = _epoch % (1 << _EPOCH_BITS)
    count = next(counter) % (1 << _COUNT_BITS)
    return (epoch << _HEADER_BITS | checksum) << _COUNT_BITS | count


def new_epoch() -> None:
    """Count every group's exchanges from 0 again, under tags no earlier epoch used: for a
    test runner whose processes run task after task on the same groups. Every rank must
    call it at the same point; a task that failed with exchanges half done then leaves
    neither diverged counts nor stale messages a later task could receive."""
    global _epoch
    _epoch += 1
    _TAGS.clear()
    _TIMEOUTS.clear()  # a group of the same name may come with another timeout
    _ORPHANS.clear()  # a failed task's: its peers may never finish them


def backend_of(group: ProcessGroup) -> str:
    """The group's backend name ("gloo", "nccl", ...), looked up once per group."""
    name = group.group_name
    backend = _BACKENDS.get(name)
    if backend is None:
        backend = _BACKENDS[name] = str(dist.get_backend(group))
    return backend


def is_gloo(group: ProcessGroup) -> bool:
    """Whether the group's eager all-gathers and reduce-scatters are exchanges (gloo)."""
    return "gloo" in backend_of(group)


_BACKENDS: dict[str, str] = {}


def forget_groups() -> None:
    """Drop every group's backend and twin (their names may be reused once the groups are
    destroyed)."""
    _BACKENDS.clear()
    _TWINS.clear()
