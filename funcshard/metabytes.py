"""Counting a computation's memory on the meta device, where nothing is allocated.

`MetaBytes` counts the bytes of the meta tensors alive after every op, as
`funcshard.testing.memory.LiveTensors` counts real ones. `DeviceKernels` makes the few ops
whose meta version would describe other intermediates than the real device keeps take the
device's path: attention, which on the meta device runs the math decomposition.
"""

from __future__ import annotations

import weakref
from typing import Any

import optree
import torch
from torch import Tensor
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class MetaBytes(TorchDispatchMode):
    """Count the live bytes of meta tensors that ops return; `peak` is the largest total.

    A storage counts while any tensor using it is alive (the bookkeeping of LiveTensors).
    """

    def __init__(self) -> None:
        super().__init__()
        self._users: dict[int, int] = {}  # storage identity -> live tensors using it
        self._bytes: dict[int, int] = {}
        self._seen: set[int] = set()  # ids of the tensor objects counted (and alive)
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            if isinstance(t, Tensor) and t.device.type == "meta":
                self._track(t)
        self.peak = max(self.peak, self.live)
        return out

    def restart_peak(self) -> int:
        """The peak so far; from now on the peak counts from what is alive now."""
        peak, self.peak = self.peak, self.live
        return peak

    def _track(self, tensor: Tensor) -> None:
        if id(tensor) in self._seen:  # an in-place op returns its input: counted already
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self._users:
            self._users[key] = 0
            self._bytes[key] = storage.nbytes()
            self.live += storage.nbytes()
        self._users[key] += 1
        self._seen.add(id(tensor))
        weakref.finalize(tensor, self._release, key, id(tensor))

    def _release(self, key: int, tensor_id: int) -> None:
        self._seen.discard(tensor_id)
        self._users[key] -= 1
        if self._users[key] == 0:
            del self._users[key]
            self.live -= self._bytes.pop(key)


class DeviceKernels(TorchFunctionMode):
    """Run attention as the real device would. On the meta device
    `F.scaled_dot_product_attention` takes the math path, which keeps every attention
    matrix for backward; where `device` would pick a fused kernel (flash, memory-efficient,
    cuDNN: each keeps its output and the log-sum-exp), the dry run calls CPU flash
    attention's op, whose meta kernel keeps the same."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            out = _fused_attention(self.device, *args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _fused_attention(
    device: str,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor | None:
    """The fused attention's output on meta tensors, or None where `device` takes the math
    path (asked of tiny tensors of the same heads and head size on that device)."""
    if query.device.type != "meta" or query.dim() != 4:
        return None

    def tiny(t: Tensor) -> Tensor:
        return torch.zeros((*t.shape[:-2], 1, t.shape[-1]), dtype=t.dtype, device=device)

    mask = None
    if attn_mask is not None:
        mask = torch.ones((1,) * attn_mask.dim(), dtype=attn_mask.dtype, device=device)
    choice = torch._fused_sdp_choice(
        tiny(query), tiny(key), tiny(value), mask, dropout_p, is_causal,
        scale=scale, enable_gqa=enable_gqa,
    )  # fmt: skip
    if choice == int(SDPBackend.MATH) or key.shape[-3] != query.shape[-3]:
        return None
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out
