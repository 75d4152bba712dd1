"""The eager backward's asynchronous reduce: wait nodes that take its in-flight result and wait
for it once backward is through the call, and the throttle that keeps one reduce in flight (see
"Overlap, eagerly" in [Note: one differentiable gather] in funcshard/step/_gather.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from funcshard.comm import _chaos as chaos
from funcshard.comm import _collectives as collectives
from funcshard.step._autograd_apply import apply_function
from funcshard.step._gather_spec import GatherSpec


class Deferred:
    """A shard behind a wait node whose backward waits for the asynchronous reduce of its
    gradient (see [Note: one differentiable gather]); made by `wait_nodes` when the call
    starts, before any compute, so that the wait runs at the end of backward.

    Only one gather may reduce asynchronously into it: a second gather reading the same
    node would meet the first one's in-flight result in autograd's sum at its input, so both
    reduce synchronously then (`alone`). The node's output is in the reduce dtype, the dtype
    of the in-flight result (autograd would cast a gradient of another dtype at once, reading
    it before it lands); a gather fed by it takes its values from an issued `source`.
    """

    __slots__ = ("gathers", "shard")

    def __init__(self, shard: Tensor) -> None:
        self.shard = shard
        self.gathers = 0

    def alone(self) -> bool:
        return self.gathers == 1


def wait_nodes(
    shards: tuple[Tensor, ...], specs: tuple[GatherSpec, ...], chosen: tuple[bool, ...]
) -> tuple[Deferred | None, ...]:
    """A `Deferred` for each chosen shard (None for the others), all behind one autograd
    node: one node per call rather than per buffer, whose backward waits for every reduce
    in one fixed order (the same on every rank) once backward is through the call."""
    which = [i for i, c in enumerate(chosen) if c]
    if not which:
        return (None,) * len(shards)
    outs = apply_function(_DeferWait, tuple(specs[i] for i in which), *(shards[i] for i in which))
    deferred: list[Deferred | None] = [None] * len(shards)
    for i, out in zip(which, outs, strict=True):
        deferred[i] = Deferred(out)
    return tuple(deferred)


class _DeferWait(torch.autograd.Function):
    @staticmethod
    def forward(specs: tuple[GatherSpec, ...], *shards: Tensor) -> tuple[Tensor, ...]:
        return tuple(
            shard.view_as(shard)
            if shard.dtype == spec.reduce_dtype
            else shard.new_zeros((), dtype=spec.reduce_dtype).expand(shard.shape)  # unread
            for shard, spec in zip(shards, specs, strict=True)
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.shard_dtypes = tuple(shard.dtype for shard in inputs[1:])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        chaos.point()
        synchronous = torch.is_grad_enabled()  # a synchronous backward reduced already
        out = [
            None if g is None else (g if synchronous else THROTTLE.wait(g)).to(dtype)
            for g, dtype in zip(grads, ctx.shard_dtypes, strict=True)
        ]
        return None, *out


class _Throttle:
    """Keeps at most one asynchronous reduce-scatter (or DDP all-reduce) in flight: issuing
    one first finishes the last, which frees its full-size input. On an HSDP mesh the
    finished reduce-scatter's all-reduce across replicas starts then, in place, and its wait
    node waits for it."""

    def __init__(self) -> None:
        # the reduce in flight: (its collective, its result, its spec); the collective keeps
        # its input alive until it completes
        self.last: tuple[collectives.Pending, Tensor, GatherSpec] | None = None
        self.across: dict[int, tuple[Tensor, collectives.Pending]] = {}  # id of a result ->
        # (the result, its all-reduce across replicas in flight)

    def issue(self, grad: Tensor, spec: GatherSpec, writable: bool = True) -> Tensor:
        """Start reducing `grad`; return the tensor the result will be in, to be read only
        after `wait`. A DDP all-reduce writes into `grad` only if `writable` (see [Note:
        reducing in place] in funcshard/step/_gather.py)."""
        self._finish_last()
        mesh, unit = spec.mesh, spec.flat.unit
        if not collectives.alone(mesh.shard_group):
            pending = collectives.reduce_scatter(
                grad, mesh.shard_group, "avg", what=unit, owned=True, loads=spec.flat.loads
            )
        elif spec.across_replicas:  # DDP: reduce in place in the buffer backward just made
            pending = collectives.all_reduce(
                grad, mesh.replicate_group, "avg", inplace=writable, what=unit
            )
        else:
            return grad
        self.last = (pending, pending.result(), spec)
        return self.last[1]

    def settle(self) -> None:
        """Finish the reduce in flight, if any, freeing its input: called by a backward
        before it makes the next one's input (see "Overlap, eagerly" in [Note: one
        differentiable gather] in funcshard/step/_gather.py)."""
        self._finish_last()

    def _finish_last(self) -> None:
        if self.last is None:
            return
        pending, result, spec = self.last
        self.last = None
        pending.wait()
        if not collectives.alone(spec.mesh.shard_group) and spec.across_replicas:
            group, unit = spec.mesh.replicate_group, spec.flat.unit
            across = collectives.all_reduce(result, group, "avg", inplace=True, what=unit)
            self.across[id(result)] = (result, across)

    def wait(self, result: Tensor) -> Tensor:
        """The finished reduce of a tensor `issue` returned; any other tensor as it is."""
        if self.last is not None and self.last[1] is result:
            self._finish_last()
        entry = self.across.pop(id(result), None)
        if entry is not None:
            entry[1].wait()
        return result

    def abandon(self) -> None:
        """Forget what a backward that raised left in flight (every rank raised, or the
        collective itself failed)."""
        self.last = None
        self.across.clear()


THROTTLE = _Throttle()


def abandon_reduces() -> None:
    """Forget the reduces a failed backward left in flight (see `_Throttle.abandon`)."""
    THROTTLE.abandon()
