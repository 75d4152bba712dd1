"""The CUDA streams eager collectives are issued from, one per kind of collective and device,
and how they are ordered against the compute stream.

[Note: collectives on their own streams]
On a GPU, an eager collective is issued from a stream of its kind, one per device:
all-gather (with the copy-in before it: the cast to the gather dtype, the host-to-device
copy of an offloaded shard), reduce-scatter and all-reduce. FSDP2 splits its streams the
same way. Three rules order them against the compute stream with events alone, with no
`record_stream` and no synchronize:

1. Every buffer a collective writes (its output, the copy-in's result) is allocated on
   the compute stream before the collective is issued, so the caching allocator
   hands its memory back on the stream that reads it last;
2. entering the collective's stream first makes it wait for the compute stream
   (`wait_stream`: an event recorded there), so the copy-in reads finished inputs and
   writes memory that no earlier compute kernel still reads; NCCL's own stream in turn
   waits for the collective's stream when the collective is issued;
3. `Pending.wait()` makes the compute stream wait for the collective (NCCL's
   `Work.wait()`), and the Pending holds the collective's input until then, so nothing
   reads a result, or frees an input, before the collective is through with it.

The overlap comes from issue order: a unit's prefetched all-gather is issued before the
compute of the unit before it, and a unit's reduce-scatter runs while backward computes
the units before it. On CPU tensors none of this applies and nothing changes.

"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

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
    if device.type == "cpu" or traced(tensor):
        return tensor.to(device, dtype)
    out = torch.empty(tensor.shape, dtype=dtype, device=device)
    with on_stream("all_gather", device):
        out.copy_(tensor, non_blocking=tensor.is_pinned())
    return out


def traced(tensor: Tensor) -> bool:
    """Whether dynamo, make_fx or fake tensors are tracing (graphs keep the functional op)."""
    return (
        torch.compiler.is_dynamo_compiling()
        or get_proxy_mode() is not None
        or isinstance(tensor, FakeTensor)
    )
