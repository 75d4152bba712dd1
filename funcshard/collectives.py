"""Every call funcshard makes into torch.distributed's collectives.

[Note: one collective path for eager and traced steps]
Callers issue a collective early and `wait()` on its `Pending` where they need the result,
and never learn what carries it. Eagerly that is the process group's own asynchronous
method, returning at once with the collective in flight and a Work to wait on (see [Note:
eager collectives through Work objects]); under `make_fx` or torch.compile it is torch's
functional collective ops (`torch.ops._c10d_functional.*`, called directly rather than
through the wrappers that return AsyncCollectiveTensor subclasses), which become graph
nodes, `wait_tensor` among them. A whole step under torch.compile (funcshard/compiled.py)
uses `gathered`, `reduced_scattered` and `all_reduced`: the functional ops, waited at once,
since the compiler places the waits.

A size-1 group communicates nothing: gathering or reducing over it returns the input, which
is how one code path serves FSDP (shard axis > 1), DDP (shard axis 1) and HSDP. The
test-only switch `communicate_alone()` sends them through the process group anyway, so that
NCCL at world size 1 runs real kernels on the streams below (see [Note: collectives on
their own streams]).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed import ProcessGroup
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from funcshard import chaos, progress

_ops = torch.ops._c10d_functional

_COMMUNICATE_ALONE = [os.environ.get("FUNCSHARD_COMMUNICATE_ALONE") == "1"]


def alone(group: ProcessGroup) -> bool:
    """Whether collectives over `group` are skipped: it has one rank, and the test-only
    switch (`communicate_alone`) is off."""
    return group.size() == 1 and not _COMMUNICATE_ALONE[0]


@contextlib.contextmanager
def communicate_alone(on: bool = True) -> Iterator[None]:
    """Test-only: inside the block, collectives over one-rank groups go through the process
    group rather than returning their input (the environment variable
    FUNCSHARD_COMMUNICATE_ALONE=1 sets it for a whole process). NCCL at world size 1 then
    launches its kernels on the collective streams, as on many GPUs."""
    was, _COMMUNICATE_ALONE[0] = _COMMUNICATE_ALONE[0], on
    try:
        yield
    finally:
        _COMMUNICATE_ALONE[0] = was


def _below_autograd() -> contextlib.AbstractContextManager:
    """Collectives are never differentiated through directly (the gather and the reduce are
    autograd functions of their own), so their calls skip the autograd keys: the functional
    ops carry a Python autograd kernel (~200 redispatches a step on a 32-unit model), and a
    backend's in-place writes into chunks of an output would meet autograd's view checks
    when the input requires grad. (Nothing to skip while dynamo traces, which cannot enter
    the guard.)"""
    if torch.compiler.is_dynamo_compiling():
        return contextlib.nullcontext()
    return torch._C._AutoDispatchBelowAutograd()


@dataclass(frozen=True)
class Record:
    """One collective as issued: for tests that check communication against a formula."""

    op: str
    ranks: tuple[int, ...]
    numel: int
    dtype: torch.dtype


_recording: list[list[Record]] = []


def bytes_sent(records: list[Record]) -> int:
    """Bytes one rank sends for these collectives with ring algorithms: an all-gather sends its
    shard to the group's other ranks, a reduce-scatter (size - 1) of its chunks, an all-reduce
    2 (size - 1) / size of its buffer."""
    sent = 0
    for r in records:
        size, item = len(r.ranks), r.dtype.itemsize
        if r.op == "all_gather":
            sent += (size - 1) * r.numel * item
        elif r.op in ("reduce_scatter", "all_to_all"):
            sent += (size - 1) * (r.numel // size) * item
        else:
            sent += 2 * (size - 1) * r.numel * item // size
    return sent


@contextlib.contextmanager
def record() -> Iterator[list[Record]]:
    """Collect every collective issued inside the block (size-1 groups issue none), eagerly
    or under make_fx; not those inside a torch.compile'd graph (see [Note: bookkeeping
    outside compiled graphs])."""
    log: list[Record] = []
    _recording.append(log)
    try:
        yield log
    finally:
        _recording.remove(log)


class CollectiveError(RuntimeError):
    """A collective failed or timed out; says which one, for which unit, over which ranks."""


class Pending:
    """A collective in flight; `wait()` returns its result (and is cheap to call again).

    `work`: what carries a collective issued eagerly, a torch.distributed Work or a gloo
    `Exchange` (see [Note: eager collectives through Work objects]);
    without one, `tensor` came from a functional op (traced) and `wait_tensor` waits for it."""

    __slots__ = ("_done", "_group", "_input", "_op", "_tensor", "_what", "_work")

    def __init__(
        self,
        tensor: Tensor,
        done: bool = False,
        op: str = "",
        group: ProcessGroup | None = None,
        what: str | None = None,
        work: dist.Work | Exchange | None = None,
        input: Tensor | None = None,
    ) -> None:
        self._tensor = tensor
        self._done = done
        self._op, self._group, self._what = op, group, what
        self._work = work
        self._input = input  # held until the wait: see [Note: collectives on their own streams]

    def wait(self) -> Tensor:
        if not self._done:
            try:  # a collective's failure (timeout, a peer gone) surfaces here
                if self._work is not None:
                    chaos.point()  # eager only: see [Note: bookkeeping outside compiled graphs]
                    progress.Here.waiting = (self._op, self._what)
                    self._work.wait()
                    progress.Here.waiting = None
                    self._work = self._input = None  # they hold the collective's tensors
                else:
                    with _below_autograd():
                        self._tensor = _ops.wait_tensor(self._tensor)
            except RuntimeError as e:
                raise _failed(self._op, self._group, self._what, e) from e
            self._done = True
        return self._tensor

    def result(self) -> Tensor:
        """The tensor the result lands in, not yet waited for: hand it on only to code that
        passes it to `wait` before reading it."""
        return self._tensor


def all_gather(shard: Tensor, group: ProcessGroup, what: str | None = None) -> Pending:
    """Concatenate every rank's 1-D `shard` in rank order: (numel * group size,).

    `what` (e.g. the unit's name) only labels the error if the collective fails.
    """
    if alone(group):
        return Pending(shard, done=True)
    _before("all_gather", group, shard, what)
    return _gathering(shard, group, "all_gather", what)


def _gathering(shard: Tensor, group: ProcessGroup, op: str, what: str | None) -> Pending:
    """Issue the all-gather itself (no count, record or check: `_agree` uses it too)."""
    eager = _eager(shard)
    if eager and _is_gloo(group):
        with _below_autograd():
            out, work = _exchange_all_gather(shard.detach(), group)
        return Pending(out, op=op, group=group, what=what, work=work)
    if eager:
        out = shard.new_empty(shard.numel() * group.size())  # on the compute stream
        with _below_autograd(), on_stream("all_gather", shard.device):
            work = group._allgather_base(_real(out), _real(shard))
        return Pending(out, op=op, group=group, what=what, work=work, input=shard)
    with _below_autograd():
        out = _ops.all_gather_into_tensor(shard, group.size(), group.group_name)
    return Pending(out, op=op, group=group, what=what)


def reduce_scatter(
    flat: Tensor, group: ProcessGroup, op: str = "avg", what: str | None = None, owned: bool = False
) -> Pending:
    """Reduce 1-D `flat` over the group (op "avg" or "sum"); rank r keeps chunk r.

    `owned`: the caller hands `flat` over (it is read until the collective completes and
    never written); otherwise gloo's exchange reads a copy, so the caller may write `flat`
    at once, as after any other collective's issue.
    """
    if alone(group):
        return Pending(flat, done=True)
    _before("reduce_scatter", group, flat, what)
    eager = _eager(flat)
    if eager and _is_gloo(group):
        with _below_autograd():
            out, work = _exchange_reduce_scatter(flat if owned else flat.clone(), group, op)
        return Pending(out, op="reduce_scatter", group=group, what=what, work=work)
    if eager:
        out = flat.new_empty(flat.numel() // group.size())  # on the compute stream
        with _below_autograd(), on_stream("reduce_scatter", flat.device):
            work = group._reduce_scatter_base(_real(out), _real(flat), _REDUCE_SCATTER_OPTIONS[op])
        return Pending(out, op="reduce_scatter", group=group, what=what, work=work, input=flat)
    with _below_autograd():
        out = _ops.reduce_scatter_tensor(flat, op, group.size(), group.group_name)
    return Pending(out, op="reduce_scatter", group=group, what=what)


# [Note: eager collectives through Work objects]
# An eager collective goes through its process group's own asynchronous methods
# (`_allgather_base`, `_reduce_scatter_base`, `allreduce`), the ones torch.distributed's
# `async_op=True` functions call, and its Pending holds the Work until it is waited; on
# gloo, all-gathers and reduce-scatters are point-to-point exchanges instead (see [Note:
# gloo collectives as exchanges]). Traced steps keep the functional ops, which graphs need.
# Two reasons. torch's gloo backend under the functional ops (`_c10d_functional.*` then
# `wait_tensor`) now and then corrupts the heap of a process when collectives overlap on a
# loaded machine: glibc's "malloc(): unaligned tcache chunk detected" or a segmentation
# fault inside `wait_tensor`;
# scripts/gloo_heap_repro.py reproduces it with torch alone (no funcshard) and runs the
# same stream of collectives through the Work API, which never crashed (figures there).
# And the functional ops cost more CPU per call: on torch's fake group, a 32-block step
# spent ~3 ms in them, a third of funcshard's overhead above plain PyTorch, against ~1 ms
# through the process group's methods (benchmarks/overhead_matrix.py). Same collectives,
# same order, same results; on NCCL, `Work.wait()` makes the current stream wait, as
# `wait_tensor` does.


# [Note: collectives on their own streams]
# On a GPU, an eager collective is issued from a stream of its kind, one per device:
# all-gather (with the copy-in before it: the cast to the gather dtype, the host-to-device
# copy of an offloaded shard), reduce-scatter and all-reduce. FSDP2 splits its streams the
# same way. Three rules order them against the compute stream with events alone, with no
# `record_stream` and no synchronize:
#
# 1. Every buffer a collective writes (its output, the copy-in's result) is allocated on
#    the compute stream before the collective is issued, so the caching allocator
#    hands its memory back on the stream that reads it last;
# 2. entering the collective's stream first makes it wait for the compute stream
#    (`wait_stream`: an event recorded there), so the copy-in reads finished inputs and
#    writes memory that no earlier compute kernel still reads; NCCL's own stream in turn
#    waits for the collective's stream when the collective is issued;
# 3. `Pending.wait()` makes the compute stream wait for the collective (NCCL's
#    `Work.wait()`), and the Pending holds the collective's input until then, so nothing
#    reads a result, or frees an input, before the collective is through with it.
#
# The overlap comes from issue order: a unit's prefetched all-gather is issued before the
# compute of the unit before it, and a unit's reduce-scatter runs while backward computes
# the units before it. On CPU tensors none of this applies and nothing changes.


_STREAM_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_STREAMS: dict[torch.device, dict[str, Any]] = {}


def collective_stream(kind: str, device: torch.device) -> Any:
    """The stream collectives of `kind` ("all_gather", "reduce_scatter", "all_reduce") are
    issued from on `device` (a GPU; made on first use, one per kind and device)."""
    streams = _STREAMS.get(device)
    if streams is None:
        module = torch.get_device_module(device.type)
        streams = {kind: module.Stream(device) for kind in _STREAM_KINDS}
        _STREAMS[device] = streams
    return streams[kind]


_ON_THE_HOST = contextlib.nullcontext()  # stateless, so one serves every collective


def on_stream(kind: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Run the block on `kind`'s collective stream, after what the compute stream has
    queued so far (see [Note: collectives on their own streams]); on the CPU, as it is."""
    if device.type == "cpu" or device.type == "meta":
        return _ON_THE_HOST
    module = torch.get_device_module(device.type)
    stream = collective_stream(kind, device)
    stream.wait_stream(module.current_stream(device))
    return module.stream(stream)


def copy_in(tensor: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """`tensor` on `device` in `dtype`, the copy (a cast, or a host-to-device copy of an
    offloaded shard) made on the all-gather stream into memory of the compute stream (see
    [Note: collectives on their own streams]); `tensor` itself when nothing changes."""
    if tensor.device == device and tensor.dtype == dtype:
        return tensor
    if device.type == "cpu" or _traced(tensor):
        return tensor.to(device, dtype)
    out = torch.empty(tensor.shape, dtype=dtype, device=device)
    with on_stream("all_gather", device):
        out.copy_(tensor, non_blocking=tensor.is_pinned())
    return out


# [Note: gloo collectives as exchanges]
# torch's gloo backend runs an all-gather or a reduce-scatter through its collective
# algorithms on the process group's worker threads, and composes the reduce-scatter from a
# full all-reduce: on 2 ranks of one machine a 7 MB all-gather took 6.0 ms and a 7 MB
# reduce-scatter 8.2 ms, where each rank sending every peer its part directly (gloo's `send`
# and `recv`, which run on its transport threads) took 3.1 ms for the all-gather, and the
# same pattern for the reduce-scatter (through `all_to_all_single`, then a local sum) 4.9
# ms. Both move the bytes a ring does, (n - 1) / n of the buffer per rank, and the
# reduce-scatter no longer moves the all-reduce's second half; in a 14M-parameter GPT step
# on 2 ranks they took funcshard from 298 to 265 ms. So eager all-gathers and
# reduce-scatters on gloo are exchanges:
#
# - all-gather: a rank copies its shard into its own chunk of the output, sends the shard to
#   every peer and receives each peer's shard into that peer's chunk;
# - reduce-scatter: a rank sends chunk p of its input to rank p and receives its own chunk
#   from every peer (the first peer's straight into the output), then adds them up, in one
#   fixed order, at `wait`.
#
# Every exchange on a group takes the next tag of that group's counter, which every rank of
# the group advances alike, since they issue the same collectives in the same order: a
# message can only meet the receive posted for it, however many exchanges are in flight.
# A peer that never sends surfaces as the receive's timeout (the process group's), raised at
# `wait`.
#
# Each direction between two ranks has a connection of its own: a rank sends to higher ranks
# through the group and to lower ranks through the group's twin (`_carrier`), a second gloo
# group of the same ranks, made by the group's ranks at their first exchange on it. gloo
# holds a pair's lock while its transport thread moves a payload, so with one connection a
# rank's `send` waited behind the peer's data arriving on the same pair: 3-8 ms per forward
# of the 14M-parameter GPT on 2 ranks. There, funcshard FSDP's step against DDP's went from
# 1.009-1.031 (mean 1.020) to 0.986-1.024 (mean 0.996) in 4 pairs of alternating processes,
# and `python -m benchmarks.training` gave 0.97-0.99 in 5 runs of 5 (0.96-1.06 before).


_TAGS: dict[str, Iterator[int]] = {}
_TAG_BITS = 20  # a tag is (epoch, count): counts wrap after 1M exchanges, epochs after 256
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


def _exchange_all_gather(shard: Tensor, group: ProcessGroup) -> tuple[Tensor, Exchange]:
    """Start gathering every rank's 1-D `shard` in rank order; returns the output (read it
    only after the exchange's `wait`) and the exchange."""
    _wait_orphans(group)
    n, me, tag = group.size(), group.rank(), _next_tag(group)
    out = shard.new_empty(shard.numel() * n)
    for observe in _GATHER_OBSERVERS:
        observe(out)
    chunks = out.view(n, -1)
    peers = _peers(n, me)
    works = [_carrier(group, me, peer).send([shard], peer, tag) for peer in peers]
    works += [_carrier(group, peer, me).recv([chunks[peer]], peer, tag) for peer in peers]
    chunks[me].copy_(shard)  # while the transport threads move the peers' parts
    return out, Exchange(group, works)


def _exchange_reduce_scatter(flat: Tensor, group: ProcessGroup, op: str) -> tuple[Tensor, Exchange]:
    """Start reducing 1-D `flat` (op "avg" or "sum"); rank r's result is chunk r. Returns
    the result (read it only after the exchange's `wait`) and the exchange. Holds `flat`
    until its chunks are sent, and besides the result, a receive buffer for the peers past
    the first (none on 2 ranks)."""
    _wait_orphans(group)
    n, me, tag = group.size(), group.rank(), _next_tag(group)
    parts = flat.view(n, -1)
    peers = _peers(n, me)
    out = flat.new_empty(parts.shape[1])
    others = flat.new_empty(n - 2, parts.shape[1]) if n > 2 else None
    targets = [out, *(others.unbind(0) if others is not None else ())][: n - 1]
    works = [_carrier(group, me, peer).send([parts[peer]], peer, tag) for peer in peers]
    works += [
        _carrier(group, peer, me).recv([into], peer, tag)
        for peer, into in zip(peers, targets, strict=True)
    ]

    def finish() -> None:
        if n > 1:
            out.add_(parts[me])
        else:  # one rank, under communicate_alone: nothing was received
            out.copy_(parts[me])
        if others is not None:
            out.add_(others.sum(0))
        if op == "avg":
            out.div_(n)

    return out, Exchange(group, works, finish)


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


def _next_tag(group: ProcessGroup) -> int:
    counter = _TAGS.get(group.group_name)
    if counter is None:
        counter = _TAGS[group.group_name] = itertools.count()
    return (_epoch % 256) << _TAG_BITS | next(counter) % (1 << _TAG_BITS)


def new_exchange_epoch() -> None:
    """Count every group's exchanges from 0 again, under tags no earlier epoch used: for a
    test runner whose processes run task after task on the same groups. Every rank must
    call it at the same point; a task that failed with exchanges half done then leaves
    neither diverged counts nor stale messages a later task could receive."""
    global _epoch
    _epoch += 1
    _TAGS.clear()
    _TIMEOUTS.clear()  # a group of the same name may come with another timeout
    _ORPHANS.clear()  # a failed task's: its peers may never finish them


def _eager(tensor: Tensor) -> bool:
    """Whether to issue through the process group's Work API rather than the functional
    ops: anything not being traced."""
    return not _traced(tensor)


def _real(tensor: Tensor) -> Tensor:
    """A complex tensor as its real view (backends take real dtypes only, as the
    torch.distributed functions do for them); any other as it is."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


_ALL_REDUCE_OPTIONS: dict[str, dist.AllreduceOptions] = {}
_REDUCE_SCATTER_OPTIONS: dict[str, dist.ReduceScatterOptions] = {}
for _name, _op in (("avg", dist.ReduceOp.AVG), ("sum", dist.ReduceOp.SUM)):
    _ALL_REDUCE_OPTIONS[_name] = dist.AllreduceOptions()
    _ALL_REDUCE_OPTIONS[_name].reduceOp = _op
    _REDUCE_SCATTER_OPTIONS[_name] = dist.ReduceScatterOptions()
    _REDUCE_SCATTER_OPTIONS[_name].reduceOp = _op


def _traced(tensor: Tensor) -> bool:
    """Whether dynamo, make_fx or fake tensors are tracing (graphs keep the functional op)."""
    return (
        torch.compiler.is_dynamo_compiling()
        or get_proxy_mode() is not None
        or isinstance(tensor, FakeTensor)
    )


def tracing(tensors: Iterable[Tensor] = ()) -> bool:
    """Whether the collectives issued now become graph nodes (torch.compile or make_fx is
    tracing, or `tensors` are fake) rather than run: a caller then reads nothing back from
    them in Python (see [Note: bookkeeping outside compiled graphs])."""
    return (
        torch.compiler.is_compiling()
        or get_proxy_mode() is not None
        or any([isinstance(t, FakeTensor) for t in tensors])
    )


def _backend(group: ProcessGroup) -> str:
    """The group's backend name ("gloo", "nccl", ...), looked up once per group."""
    name = group.group_name
    backend = _BACKENDS.get(name)
    if backend is None:
        backend = _BACKENDS[name] = str(dist.get_backend(group))
    return backend


def _is_gloo(group: ProcessGroup) -> bool:
    return "gloo" in _backend(group)


_BACKENDS: dict[str, str] = {}


def all_reduce(
    tensor: Tensor,
    group: ProcessGroup,
    op: str = "avg",
    inplace: bool = False,
    what: str | None = None,
) -> Pending:
    """Reduce `tensor` over the group (op "avg" or "sum"); every rank gets the result.

    `inplace=True` reduces into `tensor` itself (the caller owns it and reads it only after
    `wait()`), saving an output buffer of the same size.
    """
    if alone(group):
        return Pending(tensor, done=True)
    _before("all_reduce", group, tensor, what)
    if _eager(tensor):
        out = tensor if inplace else tensor.clone(memory_format=torch.contiguous_format)
        with _below_autograd(), on_stream("all_reduce", tensor.device):
            work = group.allreduce([_real(out)], _ALL_REDUCE_OPTIONS[op])
        return Pending(out, op="all_reduce", group=group, what=what, work=work)
    reduce = _ops.all_reduce_ if inplace else _ops.all_reduce
    with _below_autograd():
        out = reduce(tensor, op, group.group_name)
    return Pending(out, op="all_reduce", group=group, what=what)


def all_to_all(tensor: Tensor, group: ProcessGroup, what: str | None = None) -> Pending:
    """Split `tensor` along dim 0 into group-size equal chunks; chunk j goes to rank j, and
    the result holds every rank's chunk for this rank, in rank order (same shape)."""
    if alone(group):
        return Pending(tensor, done=True)
    _before("all_to_all", group, tensor, what)
    if _eager(tensor):
        out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        with _below_autograd():
            work = dist.all_to_all_single(out, tensor.contiguous(), group=group, async_op=True)
        return Pending(out, op="all_to_all", group=group, what=what, work=work)
    splits = [tensor.shape[0] // group.size()] * group.size()
    with _below_autograd():
        out = _ops.all_to_all_single(tensor, splits, splits, group.group_name)
    return Pending(out, op="all_to_all", group=group, what=what)


def all_to_all_v(
    tensor: Tensor,
    send: list[int],
    receive: list[int],
    group: ProcessGroup,
    total: int,
    what: str | None = None,
) -> Pending:
    """Uneven all-to-all: this rank sends `tensor`'s consecutive pieces of `send[j]`
    elements to rank j and gets `receive[r]` elements from rank r, concatenated in rank
    order. Sizes differ by rank, so it is recorded and compared across ranks as an even
    all-to-all of the group's mean buffer, `total // size`, where `total` (the elements the
    whole group sends) is what every rank derives from one shared plan."""
    if alone(group):
        return Pending(tensor, done=True)
    _before("all_to_all", group, tensor, what, agreed=total // group.size())
    if _eager(tensor):
        out = tensor.new_empty(sum(receive))
        with _below_autograd():
            work = dist.all_to_all_single(
                out, tensor.contiguous(), receive, send, group=group, async_op=True
            )
        return Pending(out, op="all_to_all", group=group, what=what, work=work)
    with _below_autograd():
        out = _ops.all_to_all_single(tensor, receive, send, group.group_name)
    return Pending(out, op="all_to_all", group=group, what=what)


def all_to_alled(tensor: Tensor, group: ProcessGroup) -> Tensor:
    """`all_to_all(...).wait()` as plain graph nodes (see `gathered`)."""
    if alone(group):
        return tensor
    splits = [tensor.shape[0] // group.size()] * group.size()
    return _ops.wait_tensor(_ops.all_to_all_single(tensor, splits, splits, group.group_name))


def gathered(shard: Tensor, group: ProcessGroup) -> Tensor:
    """`all_gather(...).wait()` as plain graph nodes, for steps dynamo traces
    (funcshard/compiled.py): no record, no cross-rank check, no error wrapping."""
    if alone(group):
        return shard
    return _ops.wait_tensor(_ops.all_gather_into_tensor(shard, group.size(), group.group_name))


def reduced_scattered(flat: Tensor, group: ProcessGroup, op: str = "avg") -> Tensor:
    """`reduce_scatter(...).wait()` as plain graph nodes (see `gathered`)."""
    if alone(group):
        return flat
    return _ops.wait_tensor(_ops.reduce_scatter_tensor(flat, op, group.size(), group.group_name))


def all_reduced(tensor: Tensor, group: ProcessGroup, op: str = "avg") -> Tensor:
    """`all_reduce(...).wait()` as plain graph nodes (see `gathered`)."""
    if alone(group):
        return tensor
    return _ops.wait_tensor(_ops.all_reduce(tensor, op, group.group_name))


# [Note: bookkeeping outside compiled graphs]
# Every eager collective is counted (`_Issued`), recorded for `record()` and, on a checked
# group, compared across ranks (`_agree`), all in Python beside the collective. Dynamo would
# trace that Python once and guard the graph on what it read: on `_Issued.last[0]`, which
# every collective advances, the guard failed on every call, so a compiled step that issued
# one of these collectives itself (`fs.global_norm`, clipping, `fs.pmean`, check_finite)
# was recompiled on every call, and after torch's recompile limit ran eagerly (or, with
# fullgraph=True, raised). And what it did was true only of the trace, not of the runs: in
# a compiled graph the collectives are the compiler's nodes, and no Python runs beside them.
# So while torch compiles (`torch.compiler.is_compiling()`) none of it runs (nor the chaos
# point of an eager wait): no counter, log or checked-group set is read or written while
# a graph is traced, and nothing is guarded on them. (`alone` reads the test switch of
# `communicate_alone` on purpose: it decides what the graph communicates, so a guard on it
# is right.) The compiled call itself is counted instead, from outside the graph:
# `funcshard.compile` marks its entry and exit (`entering_compiled`, `left_compiled`),
# counting the collectives its graphs issued by the backend's sequence numbers. A
# collective inside a compiled graph is thus neither in a `record()` log nor checked by
# Mesh(check_collectives=True): run the step eagerly for those.


class _Issued:
    """The last collective this process issued, numbered: (count, op, unit, numel, dtype,
    group), one tuple so a reader on another thread never sees half of an update; for the
    collectives of a call of a compiled step (see [Note: bookkeeping outside compiled
    graphs]), op is "compiled", unit is (the step's name, the call's number) and numel how
    many collectives it issued (None if uncounted). `inside`: (name, call number) of the
    compiled call running now (None between calls), read apart from `last`."""

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


# [Note: a rank out of step]
# Every rank issues the same collectives in the same order. A rank whose step raises after
# it issued some of the step's collectives (a bad batch, a bug on that rank alone) and
# that carries on (the exception caught, the loop going on) is no longer in that order: the
# others are still in the step's later collectives, and its next collective, of the next
# step, would pair with one of theirs (gloo then aborts the process on mismatched shapes, in
# about 2.5 s; with equal shapes the ranks would silently mix steps). So `value_and_grad`
# and `call` note an exception escaping them after this rank's count of collectives moved
# (`interruption`), and unless every rank of the mesh left the step at the same count
# (the same error everywhere: they meet in the store within `waits.SETTLE`,
# `waits.left_step`), the rank's next collective raises instead of being issued, naming
# the interrupted step. Errors that funcshard raises on every rank together
# (`NonFiniteError`, a `pmean` of trees that differ: marked `on_every_rank`) leave the
# ranks in step, and a collective's own failure is already an error on every rank.
# `fs.testing.run` starts each task in step.


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


def _before(
    op: str, group: ProcessGroup, tensor: Tensor, what: str | None, agreed: int | None = None
) -> None:
    """Count the collective as the last issued, record it for `record()` and, on a checked
    group, compare it across ranks (its size, or `agreed` where sizes differ by rank). None
    of it while torch compiles (see [Note: bookkeeping outside compiled graphs])."""
    if torch.compiler.is_compiling():
        return
    if _OutOfStep.reason is not None:
        _refuse_out_of_step(op, what)
    chaos.point()
    count = _Issued.last[0] + 1 if _Issued.last is not None else 1
    _Issued.last = (count, op, what, tensor.numel(), tensor.dtype, group)
    if progress.Here.store is None:
        _publish_progress()
    if _recording:
        numel = tensor.numel() if agreed is None else agreed
        entry = Record(op, tuple(dist.get_process_group_ranks(group)), numel, tensor.dtype)
        for log in _recording:
            log.append(entry)
    if group.group_name in _checked_groups:
        _agree(op, group, tensor, what, agreed)


def _failed(
    op: str, group: ProcessGroup | None, what: str | None, cause: BaseException
) -> CollectiveError:
    progress.Here.waiting = None
    ranks = dist.get_process_group_ranks(group) if group is not None else "?"
    unit = unit_words(what)
    first = first_failure()
    first = f"First failure (recorded by fs.fail_fast): {first}.\n" if first else ""
    others = progress.report(ranks, count_issued()) if isinstance(ranks, list) else ""
    others = f"Where the other ranks are (their progress records):\n{others}\n" if others else ""
    return CollectiveError(
        f"rank {dist.get_rank()}: {op}{unit} over ranks {ranks} did not complete: {cause}\n"
        f"{first}The last funcshard collective this rank issued: {last_issued()}.\n{others}"
        f"The other ranks of the group did not join it in time: one died or hung, or the "
        f"ranks took different paths (e.g. batch shapes that change which units run). "
        f"Mesh(timeout=...) bounds the wait; Mesh(check_collectives=True) (or "
        f"FUNCSHARD_CHECK_COLLECTIVES=1) compares every collective across ranks first and "
        f"names the first that differs."
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


_checked_groups: set[str] = set()
_OP_CODES = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "all_to_all": 4}


def check_group(group: ProcessGroup) -> None:
    """Compare every later collective on `group` across its ranks before issuing it
    (op, element count, dtype, unit): a mismatch raises on every rank instead of corrupting
    data or hanging in gloo. One small all-gather per collective: for debugging."""
    if group.size() > 1:
        _checked_groups.add(group.group_name)


def forget_checked_groups() -> None:
    """Drop every group's check and backend (their names may be reused once the groups are
    destroyed)."""
    _checked_groups.clear()
    _BACKENDS.clear()
    _TWINS.clear()


def _agree(
    op: str, group: ProcessGroup, tensor: Tensor, what: str | None, agreed: int | None = None
) -> None:
    numel = tensor.numel() if agreed is None else agreed
    mine = (op, numel, str(tensor.dtype), what)
    code = [_OP_CODES[op], numel, zlib.crc32(f"{tensor.dtype}|{what}".encode())]
    local = torch.tensor(code, dtype=torch.int64, device=tensor.device)
    check = _gathering(local, group, f"collective check before {op}", what)
    rows = check.wait().view(group.size(), len(code))  # a failure raises naming the check
    if bool((rows == rows[0]).all()):
        return
    ranks = dist.get_process_group_ranks(group)
    theirs = all_gather_object(mine, group)
    lines = "\n".join(
        f"  rank {r}: {o} of {n} x {d}" + unit_words(w, "for")
        for r, (o, n, d, w) in zip(ranks, theirs, strict=True)
    )
    raise CollectiveError(
        f"rank {dist.get_rank()}: the ranks of group {ranks} are about to issue different "
        f"collectives:\n{lines}\nEvery rank must run the same units in the same order with "
        f"the same shapes and dtypes: check that every rank built the same model and plan and "
        f"that batch shapes do not change which modules run."
    )


def broadcast(tensor: Tensor, group: ProcessGroup, src_rank: int) -> Tensor:
    """Return `tensor` as held by global rank `src_rank` (the input is not written)."""
    if alone(group):
        return tensor
    out = tensor.detach().clone()
    dist.broadcast(out, src=src_rank, group=group)
    return out


def barrier(group: ProcessGroup, timeout: timedelta) -> None:
    """Wait for every rank of the group; on gloo a rank that is gone fails it within
    `timeout` instead of hanging."""
    if _is_gloo(group):
        dist.monitored_barrier(group=group, timeout=timeout)
    else:
        dist.barrier(group=group)


def all_gather_ints(values: list[int], group: ProcessGroup) -> list[list[int]]:
    """Every rank's list of int64 values (all lists the same length), in rank order."""
    local = torch.tensor(values, dtype=torch.int64, device=_device_of(group))
    gathered = all_gather(local, group).wait()
    return gathered.view(group.size(), len(values)).tolist()


def all_gather_object(obj: Any, group: ProcessGroup) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (for error reports, not the hot path)."""
    out: list[Any] = [None] * group.size()
    dist.all_gather_object(out, obj, group=group)
    return out


def _device_of(group: ProcessGroup) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if "nccl" in _backend(group)
        else torch.device("cpu")
    )


def global_rank() -> int:
    """This process's rank in the default group (0 when there is none)."""
    return dist.get_rank() if dist.is_initialized() else 0


def issued_count(group: ProcessGroup) -> int | None:
    """How many collectives this rank has issued on `group` (the backend's sequence number,
    gloo's and NCCL's alike), or None where the backend keeps none."""
    try:
        return group._get_sequence_number_for_group()
    except (RuntimeError, AttributeError):
        return None


def group_ranks(group: ProcessGroup) -> list[int]:
    """The global ranks of the group's members, in group order."""
    return dist.get_process_group_ranks(group)


_FAILURE_MARKS = ("gloo", "nccl", "connection closed", "timed out waiting")


def is_failure(error: BaseException) -> bool:
    """Whether `error` came from a collective: torch's distributed errors, or gloo's and
    NCCL's plain RuntimeErrors (which name the library or the transport's wait)."""
    if isinstance(error, dist.DistError):
        return True
    message = str(error).lower()
    return any(mark in message for mark in _FAILURE_MARKS)


def group_rank(group: ProcessGroup) -> int:
    """This process's rank within `group`."""
    return dist.get_rank(group)


@contextlib.contextmanager
def _quiet_sharded_tensor() -> Iterator[None]:
    """Silence torch's "we are deprecating ShardedTensor" FutureWarning, which it gives for
    every ShardedTensor made, saved and loaded (on every rank, for every parameter).

    funcshard keeps ShardedTensor on purpose: a parameter's pieces on a rank are wherever
    the flat buffers cut it (uneven, possibly several or none per rank), which a DTensor's
    placements cannot describe, and DCP reshards ShardedTensors across world sizes. Only
    that message is silenced, only around funcshard's own calls into it.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Please use DTensor instead", category=FutureWarning
        )
        yield


def sharded_tensor(pieces: list[tuple[int, Tensor]], numel: int, group: ProcessGroup) -> Any:
    """A 1-D tensor of `numel` elements sharded as (start, values) pieces across the group,
    in the form torch.distributed.checkpoint saves and reshards (a ShardedTensor)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata

    rank = dist.get_rank()  # placements name global ranks, whatever the group
    shards = [
        Shard(
            values.reshape(-1),
            ShardMetadata([start], [values.numel()], f"rank:{rank}/{values.device}"),
        )
        for start, values in pieces
    ]
    with _quiet_sharded_tensor():
        return ShardedTensor._init_from_local_shards(shards, [numel], process_group=group)


def local_pieces(tensor: Any) -> list[tuple[int, Tensor]]:
    """The (start, values) pieces of a sharded tensor that this rank holds."""
    with _quiet_sharded_tensor():
        return [(s.metadata.shard_offsets[0], s.tensor) for s in tensor.local_shards()]


def global_size(tensor: Any) -> tuple[int, ...]:
    """The full shape of a plain or sharded tensor."""
    with _quiet_sharded_tensor():
        return tuple(tensor.size())


def dcp_save(
    state_dict: dict[str, Any], directory: str, group: ProcessGroup | None = None
) -> None:
    """Save through torch.distributed.checkpoint; every rank of `group` (the default group
    when None) writes its own pieces."""
    import torch.distributed.checkpoint as dcp

    with _quiet_sharded_tensor():
        dcp.save(state_dict, checkpoint_id=directory, process_group=group)


class CheckpointReadError(RuntimeError):
    """DCP could not read a checkpoint's files (raised on every rank: DCP gathers the
    ranks' read errors)."""


def dcp_load(
    state_dict: dict[str, Any], directory: str, group: ProcessGroup | None = None
) -> None:
    """Load in place into `state_dict`'s tensors, reading whichever saved pieces overlap
    (collective over `group`, the default group when None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_sharded_tensor():
            dcp.load(state_dict, storage_reader=_safe_reader(directory), process_group=group)
    except CheckpointException as e:
        raise CheckpointReadError(str(e)) from e


def dcp_sizes(directory: str) -> dict[str, tuple[int, ...]]:
    """The saved tensors' names and full shapes, from a checkpoint's metadata."""
    metadata = _safe_reader(directory).read_metadata()
    return {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}


def dcp_dtypes(directory: str) -> dict[str, torch.dtype]:
    """The saved tensors' dtypes, from a checkpoint's metadata."""
    metadata = _safe_reader(directory).read_metadata()
    return {
        k: v.properties.dtype
        for k, v in metadata.state_dict_metadata.items()
        if hasattr(v, "properties")
    }


def global_dtype(tensor: Any) -> torch.dtype:
    """The dtype of a plain or sharded tensor."""
    with _quiet_sharded_tensor():
        if isinstance(tensor, Tensor) and not hasattr(tensor, "local_shards"):
            return tensor.dtype
        return tensor.metadata().tensor_properties.dtype


def dcp_storage(directory: str) -> list[tuple[str, tuple[int, ...], str, int, int]]:
    """Where DCP wrote each chunk: (FQN, chunk offset, file, byte offset, byte length)."""
    metadata = _safe_reader(directory).read_metadata()
    return [
        (index.fqn, tuple(index.offset or ()), info.relative_path, info.offset, info.length)
        for index, info in metadata.storage_data.items()
    ]


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata file and nothing else: weights_only semantics for metadata.

    Tensor data is already read with `torch.load(weights_only=True)`; DCP reads its
    `.metadata` with plain pickle, which would run whatever a crafted file names.
    """

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint")
            or (module == "torch" and name in _TORCH_NAMES)
            or (module, name) in _OTHER_NAMES
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"funcshard.checkpoint: refusing to load {module}.{name} from checkpoint "
                f"metadata; only torch.distributed.checkpoint's own types are allowed."
            )
        return super().find_class(module, name)


_TORCH_NAMES = frozenset(
    {"Size", "device", "layout", "strided", "contiguous_format", "preserve_format"}
    | {str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
)
_OTHER_NAMES = frozenset(
    {("collections", "OrderedDict"), ("builtins", "slice"), ("torch.serialization", "_get_layout")}
    | {("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
)


def _safe_reader(directory: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """A FileSystemReader whose metadata is read by `_MetadataUnpickler`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(directory)
