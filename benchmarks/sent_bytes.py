"""Bytes one rank sends, counted from the collectives it actually hands to torch.distributed.

[Note: counting the real sends]
A benchmark that multiplies a layout's numbers (shard sizes, padding) says what a design
should send, not what the code sends. `SentBytes` is a dispatch mode that sees every c10d
op (gloo's point-to-point `send`, `_allgather_base_`, `alltoall_base_`, ...) and every
functional collective (`_c10d_functional.*`, what DTensor issues), with the tensors handed to
the backend: padding sent is counted, padding not sent is not. A point-to-point send counts
its tensors' bytes exactly. A collective counts what a ring moves per rank for the buffers it
was given: an all-gather (n - 1) times its input, a reduce-scatter and an all-to-all the
parts of its input meant for other ranks, an all-reduce 2 (n - 1) / n of its buffer.

A traceable wrapper subclass's op (a DTensor's; not a FakeTensor's, which DTensor's
sharding propagation runs inside) is handed back (`NotImplemented`) so that its own
dispatch runs with the mode still on and the collectives it issues inside are counted; the
mode is off while it runs an op itself, so an op that issues another collective inside is
counted once. A collective op this file does not know raises, rather than counting zero.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

_FREE = {
    "recv_",
    "recv_any_source_",
    "barrier",
    "wait_tensor",
    "_wrap_tensor_autograd",
    "monitored_barrier_",
}


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _group(obj: Any) -> dist.ProcessGroup:
    return obj if isinstance(obj, dist.ProcessGroup) else dist.ProcessGroup.unbox(obj)


def _named(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


def _ring_all_reduce(nbytes: int, size: int) -> int:
    return 2 * (size - 1) * nbytes // size


def _to_others(flat: torch.Tensor, splits: list[int], group: dist.ProcessGroup) -> int:
    """Bytes of an all-to-all's input meant for the other ranks."""
    size, me = group.size(), group.rank()
    if not splits:
        return _nbytes(flat) * (size - 1) // size
    row = _nbytes(flat) // max(flat.shape[0], 1) if flat.dim() else 0
    return sum(s for r, s in enumerate(splits) if r != me) * row


def _c10d(name: str, args: tuple) -> int:
    """Bytes sent by one `torch.ops.c10d` op (the process group's own methods)."""
    if name == "send":
        return _nbytes(args[0])
    if name == "_allgather_base_":
        out, inp = args[0], args[1]
        return _nbytes(out) - _nbytes(inp)
    if name in ("allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"):
        outs, inps = args[0], args[1]
        return _nbytes(outs) - _nbytes(inps)
    if name == "_reduce_scatter_base_":
        return _nbytes(args[1]) - _nbytes(args[0])
    if name in ("reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        return _nbytes(args[1]) - _nbytes(args[0])
    if name == "allreduce_":
        return _ring_all_reduce(_nbytes(args[0]), _group(args[1]).size())
    if name == "alltoall_base_":
        return _to_others(args[1], list(args[4]), _group(args[2]))
    if name == "broadcast_":
        group, root = _group(args[1]), args[2]
        return _nbytes(args[0]) * (group.size() - 1) if group.rank() == root else 0
    raise NotImplementedError(f"SentBytes: c10d.{name} is not counted; add it to {__name__}")


def _functional(name: str, args: tuple) -> int:
    """Bytes sent by one `torch.ops._c10d_functional` op (DTensor's, traced steps')."""
    if name == "all_gather_into_tensor":
        return _nbytes(args[0]) * (args[1] - 1)
    if name == "reduce_scatter_tensor":
        return _nbytes(args[0]) * (args[2] - 1) // args[2]
    if name == "all_reduce":
        return _ring_all_reduce(_nbytes(args[0]), _named(args[2]).size())
    if name == "all_to_all_single":
        return _to_others(args[0], list(args[2]), _named(args[3]))
    if name == "broadcast":
        group = _named(args[2])
        return _nbytes(args[0]) * (group.size() - 1) if group.rank() == args[1] else 0
    raise NotImplementedError(
        f"SentBytes: _c10d_functional.{name} is not counted; add it to {__name__}"
    )


class SentBytes(TorchDispatchMode):
    """`with SentBytes() as sent:` ... then `sent.bytes`: what this rank sent inside."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a DTensor: its inner collectives are counted
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional"):
            name = func._opname
            if name not in _FREE:
                count = _c10d if namespace == "c10d" else _functional
                self.bytes += count(name, args)
                self.ops[f"{namespace}.{name}"] = self.ops.get(f"{namespace}.{name}", 0) + 1
        return func(*args, **(kwargs or {}))
