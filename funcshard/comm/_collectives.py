"""Every call funcshard makes into torch.distributed's collectives.

[Note: one collective path for eager and traced steps]
Callers issue a collective early and `wait()` on its `Pending` where they need the result,
and never learn what carries it. Eagerly that is the process group's own asynchronous
method, returning at once with the collective in flight and a Work to wait on (see [Note:
eager collectives through Work objects]); under `make_fx` or torch.compile it is torch's
functional collective ops (`torch.ops._c10d_functional.*`, called directly rather than
through the wrappers that return AsyncCollectiveTensor subclasses), which become graph
nodes, `wait_tensor` among them. A whole step under torch.compile (funcshard/step/_compiled.py)
uses `gathered`, `reduced_scattered` and `all_reduced`: the functional ops, waited at once,
since the compiler places the waits.

A size-1 group communicates nothing: gathering or reducing over it returns the input, which
is how one code path serves FSDP (shard axis > 1), DDP (shard axis 1) and HSDP. The
test-only switch `communicate_alone()` sends them through the process group anyway, so that
NCCL at world size 1 runs real kernels on the collective streams (see [Note: collectives
on their own streams] in comm/_streams.py). Over a `MetaGroup` (the estimate's dry run) each
returns a new meta tensor of its result's size (see [Note: collectives on a meta group]).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed import ProcessGroup
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from funcshard.comm import _chaos as chaos
from funcshard.comm import _collective_checks as collective_checks
from funcshard.comm import _exchange as exchange
from funcshard.comm import _failures as failures
from funcshard.comm import _fp16_mean as fp16_mean
from funcshard.comm import _meta_groups as meta_groups
from funcshard.comm import _progress as progress
from funcshard.comm import _records as records
from funcshard.comm import _streams as streams
from funcshard.comm import _trail as trail
from funcshard.comm._records import Record as Record
from funcshard.comm._records import bytes_sent as bytes_sent
from funcshard.comm._records import record as record

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


class Pending:
    """A collective in flight; `wait()` returns its result (and is cheap to call again).

    `work`: what carries a collective issued eagerly, a torch.distributed Work or a gloo
    `exchange.Exchange` (see [Note: eager collectives through Work objects]);
    without one, `tensor` came from a functional op (traced) and `wait_tensor` waits for it."""

    __slots__ = ("_done", "_group", "_input", "_op", "_post", "_tensor", "_what", "_work")

    def __init__(
        self,
        tensor: Tensor,
        done: bool = False,
        op: str = "",
        group: ProcessGroup | None = None,
        what: str | None = None,
        work: dist.Work | exchange.Exchange | None = None,
        input: Tensor | None = None,
        post: float | None = None,
    ) -> None:
        self._tensor = tensor
        self._done = done
        self._post = post  # the divisor left for after the sum (comm/_fp16_mean.py)
        self._op, self._group, self._what = op, group, what
        self._work = work
        self._input = input  # held until the wait (see [Note: collectives on their own
        # streams] in comm/_streams.py)

    def wait(self) -> Tensor:
        if not self._done:
            eager = self._work is not None
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
                raise failures.failed(self._op, self._group, self._what, e) from e
            if self._post is not None:  # (eagerly the result is ours: divided in place)
                with _below_autograd():
                    post = self._post
                    self._tensor = self._tensor.div_(post) if eager else self._tensor.div(post)
            self._done = True
        return self._tensor

    def result(self) -> Tensor:
        """The tensor the result lands in, not yet waited for: hand it on only to code that
        passes it to `wait` before reading it."""
        return self._tensor


def all_gather(
    shard: Tensor, group: ProcessGroup, what: str | None = None, loads: tuple[int, ...] = ()
) -> Pending:
    """Concatenate every rank's 1-D `shard` in rank order: (numel * group size,).

    `what` (e.g. the unit's name) only labels the error if the collective fails. `loads`:
    an owned unit's real elements per rank (`FlatLayout.loads`); on gloo only those are
    sent, and the rest of each rank's chunk comes out zero (see [Note: the uneven exchange]
    in comm/_exchange.py).
    """
    if alone(group) or meta_groups.is_meta(group):
        return Pending(meta_groups.result("all_gather", shard, group), done=True)
    loads = _uneven(loads, shard, group)
    sent = (group.size() - 1) * loads[group.rank()] if loads else None
    _before("all_gather", group, shard, what, sent=sent)
    return _gathering(shard, group, "all_gather", what, loads)


def _gathering(
    shard: Tensor, group: ProcessGroup, op: str, what: str | None, loads: tuple[int, ...] = ()
) -> Pending:
    """Issue the all-gather itself (no count, record or check: `_agree` uses it too)."""
    eager = _eager(shard)
    work: dist.Work | exchange.Exchange
    if eager and exchange.is_gloo(group):
        with _below_autograd():
            # a check's own gather compares what differs, so its header must not
            header_what = what if op == "all_gather" else None
            out, work = exchange.all_gather(shard.detach(), group, header_what, loads)
        return Pending(out, op=op, group=group, what=what, work=work)
    if eager:
        out = shard.new_empty(shard.numel() * group.size())  # on the compute stream
        with _below_autograd(), streams.on_stream("all_gather", shard.device):
            work = group._allgather_base(_real(out), _real(shard))
        return Pending(out, op=op, group=group, what=what, work=work, input=shard)
    with _below_autograd():
        out = _ops.all_gather_into_tensor(shard, group.size(), group.group_name)
    return Pending(out, op=op, group=group, what=what)


def reduce_scatter(
    flat: Tensor,
    group: ProcessGroup,
    op: str = "avg",
    what: str | None = None,
    owned: bool = False,
    loads: tuple[int, ...] = (),
) -> Pending:
    """Reduce 1-D `flat` over the group (op "avg" or "sum"); rank r keeps chunk r.

    `owned`: the caller hands `flat` over (it is read until the collective completes and
    never written); otherwise gloo's exchange reads a copy, so the caller may write `flat`
    at once, as after any other collective's issue. `loads`: as for `all_gather`; on gloo
    only each chunk's first `loads[r]` elements are sent and summed, the rest is zero.
    """
    if alone(group) or meta_groups.is_meta(group):
        return Pending(meta_groups.result("reduce_scatter", flat, group), done=True)
    loads = _uneven(loads, flat, group)
    sent = sum(loads) - loads[group.rank()] if loads else None
    _before("reduce_scatter", group, flat, what, sent=sent)
    eager = _eager(flat)
    divided, op, post = fp16_mean.divided(flat, op, group.size(), owned)
    owned, flat = owned or divided is not flat, divided  # (a divided copy is ours)
    work: dist.Work | exchange.Exchange
    if eager and exchange.is_gloo(group):
        with _below_autograd():
            out, work = exchange.reduce_scatter(
                flat if owned else flat.clone(), group, op, what, loads
            )
        return Pending(out, op="reduce_scatter", group=group, what=what, work=work, post=post)
    if eager:
        out = flat.new_empty(flat.numel() // group.size())  # on the compute stream
        with _below_autograd(), streams.on_stream("reduce_scatter", flat.device):
            work = group._reduce_scatter_base(_real(out), _real(flat), _REDUCE_SCATTER_OPTIONS[op])
        return Pending(
            out, op="reduce_scatter", group=group, what=what, work=work, input=flat, post=post
        )
    with _below_autograd():
        out = _ops.reduce_scatter_tensor(flat, op, group.size(), group.group_name)
    return Pending(out, op="reduce_scatter", group=group, what=what, post=post)


# [Note: eager collectives through Work objects]
# An eager collective goes through its process group's own asynchronous methods
# (`_allgather_base`, `_reduce_scatter_base`, `allreduce`), the ones torch.distributed's
# `async_op=True` functions call, and its Pending holds the Work until it is waited; on
# gloo, all-gathers and reduce-scatters are point-to-point exchanges instead (see [Note:
# gloo collectives as exchanges] in comm/_exchange.py). Traced steps keep the functional ops,
# which graphs need.
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


def _uneven(loads: tuple[int, ...], tensor: Tensor, group: ProcessGroup) -> tuple[int, ...]:
    """`loads` where the collective runs as a gloo exchange (eager), else (): NCCL, the fake
    group and traced steps send the padded buffer (see [Note: the uneven exchange])."""
    if not loads or not _eager(tensor) or not exchange.is_gloo(group):
        return ()
    assert len(loads) == group.size(), (loads, group.size())  # the layout's, of this group
    return loads


def _eager(tensor: Tensor) -> bool:
    """Whether to issue through the process group's Work API rather than the functional
    ops: anything not being traced."""
    return not streams.traced(tensor)


def _real(tensor: Tensor) -> Tensor:
    """A complex tensor as its real view (backends take real dtypes only, as the
    torch.distributed functions do for them); any other as it is."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


_ALL_REDUCE_OPTIONS: dict[str, dist.AllreduceOptions] = {}
_REDUCE_SCATTER_OPTIONS: dict[str, dist.ReduceScatterOptions] = {}
for _name, _op in (("avg", dist.ReduceOp.AVG), ("sum", dist.ReduceOp.SUM)):
    _ALL_REDUCE_OPTIONS[_name] = dist.AllreduceOptions()
    _ALL_REDUCE_OPTIONS[_name].reduceOp = dist.ReduceOp(_op)
    _REDUCE_SCATTER_OPTIONS[_name] = dist.ReduceScatterOptions()
    _REDUCE_SCATTER_OPTIONS[_name].reduceOp = dist.ReduceOp(_op)
_ALL_REDUCE_OPTIONS["max"] = dist.AllreduceOptions()  # (an inf-norm's: all-reduce only)
_ALL_REDUCE_OPTIONS["max"].reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)


def tracing(tensors: Iterable[Tensor] = ()) -> bool:
    """Whether the collectives issued now become graph nodes (torch.compile or make_fx is
    tracing, or `tensors` are fake) rather than run: a caller then reads nothing back from
    them in Python (see [Note: bookkeeping outside compiled graphs])."""
    return (
        torch.compiler.is_compiling()
        or get_proxy_mode() is not None
        or any([isinstance(t, FakeTensor) for t in tensors])
    )


def all_reduce(
    tensor: Tensor,
    group: ProcessGroup,
    op: str = "avg",
    inplace: bool = False,
    what: str | None = None,
) -> Pending:
    """Reduce `tensor` over the group (op "avg", "sum" or "max"); every rank gets the result.

    `inplace=True` reduces into `tensor` itself (the caller owns it and reads it only after
    `wait()`), saving an output buffer of the same size.
    """
    if alone(group) or meta_groups.is_meta(group):
        return Pending(tensor if inplace else meta_groups.result("-", tensor, group), done=True)
    _before("all_reduce", group, tensor, what)
    divided, op, post = fp16_mean.divided(tensor, op, group.size(), owned=inplace)
    inplace, tensor = inplace or divided is not tensor, divided  # (a divided copy is ours)
    if _eager(tensor):
        out = tensor if inplace else tensor.clone(memory_format=torch.contiguous_format)
        with _below_autograd(), streams.on_stream("all_reduce", tensor.device):
            work = group.allreduce([_real(out)], _ALL_REDUCE_OPTIONS[op])
        return Pending(out, op="all_reduce", group=group, what=what, work=work, post=post)
    reduce = _ops.all_reduce_ if inplace else _ops.all_reduce
    with _below_autograd():
        out = reduce(tensor, op, group.group_name)
    return Pending(out, op="all_reduce", group=group, what=what, post=post)


def all_to_all(tensor: Tensor, group: ProcessGroup, what: str | None = None) -> Pending:
    """Split `tensor` along dim 0 into group-size equal chunks; chunk j goes to rank j, and
    the result holds every rank's chunk for this rank, in rank order (same shape)."""
    if alone(group) or meta_groups.is_meta(group):
        return Pending(meta_groups.result("all_to_all", tensor, group), done=True)
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
    if alone(group) or meta_groups.is_meta(group):
        return Pending(meta_groups.result("all_to_all", tensor, group, sum(receive)), done=True)
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
    (funcshard/step/_compiled.py): no record, no cross-rank check, no error wrapping."""
    if alone(group):
        return shard
    return _ops.wait_tensor(_ops.all_gather_into_tensor(shard, group.size(), group.group_name))


def reduced_scattered(flat: Tensor, group: ProcessGroup, op: str = "avg") -> Tensor:
    """`reduce_scatter(...).wait()` as plain graph nodes (see `gathered`)."""
    if alone(group):
        return flat
    flat, op, post = fp16_mean.divided(flat, op, group.size())
    out = _ops.wait_tensor(_ops.reduce_scatter_tensor(flat, op, group.size(), group.group_name))
    return out if post is None else out / post


def all_reduced(tensor: Tensor, group: ProcessGroup, op: str = "avg") -> Tensor:
    """`all_reduce(...).wait()` as plain graph nodes (see `gathered`)."""
    if alone(group):
        return tensor
    tensor, op, post = fp16_mean.divided(tensor, op, group.size())
    out = _ops.wait_tensor(_ops.all_reduce(tensor, op, group.group_name))
    return out if post is None else out / post


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


def _before(
    op: str,
    group: ProcessGroup,
    tensor: Tensor,
    what: str | None,
    agreed: int | None = None,
    sent: int | None = None,
) -> None:
    """Count the collective as the last issued, record it for `record()` (with `sent`, the
    elements an uneven exchange sends) and, on a checked group, compare it across ranks (its
    size, or `agreed` where sizes differ by rank). None of it while torch compiles (see
    [Note: bookkeeping outside compiled graphs])."""
    if torch.compiler.is_compiling():
        return
    failures.check_in_step(op, what)
    chaos.point()
    failures.count_as_issued(op, group, tensor, what)
    numel = tensor.numel() if agreed is None else agreed
    trail.follow(op, numel, tensor.dtype, what, group.group_name)  # [Note: the collectives' trail]
    if records.recording:
        ranks = tuple(dist.get_process_group_ranks(group))
        entry = Record(op, ranks, numel, tensor.dtype, sent)
        for log in records.recording:
            log.append(entry)
    if collective_checks.checked(group):
        _agree(op, group, tensor, what, agreed)


def _agree(
    op: str, group: ProcessGroup, tensor: Tensor, what: str | None, agreed: int | None = None
) -> None:
    """Compare the collective about to be issued across the group's ranks, through an
    all-gather of its own (see `collective_checks`)."""
    mine = collective_checks.described(op, tensor, what, agreed)
    local = collective_checks.code(mine, tensor.device)
    check = _gathering(local, group, f"collective check before {op}", what)
    rows = check.wait().view(group.size(), local.numel())  # a failure raises naming the check
    collective_checks.agree(rows, mine, group)


def broadcast(tensor: Tensor, group: ProcessGroup, src_rank: int) -> Tensor:
    """Return `tensor` as held by global rank `src_rank` (the input is not written)."""
    if alone(group) or meta_groups.is_meta(group):
        return meta_groups.result("broadcast", tensor, group)
    out = tensor.detach().clone()
    dist.broadcast(out, src=src_rank, group=group)
    return out


def barrier(group: ProcessGroup, timeout: timedelta) -> None:
    """Wait for every rank of the group; on gloo a rank that is gone fails it within
    `timeout` instead of hanging."""
    if exchange.is_gloo(group):
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
        if "nccl" in exchange.backend_of(group)
        else torch.device("cpu")
    )
