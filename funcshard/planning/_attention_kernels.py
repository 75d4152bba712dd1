"""Which attention kernel a device would run for `F.scaled_dot_product_attention`, and what
it keeps, decided without that device (the dry run of `funcshard.estimate`).

[Note: attention kernels without the device]
On the meta device `F.scaled_dot_product_attention` takes the math decomposition, which
keeps every (S x S) attention matrix for backward; a GPU's fused kernels keep only their
output and a float32 log-sum-exp per query row, so a dry run that followed meta's path would
plan a Llama 3.1 8B step at 681 GiB instead of ~70. The dry run therefore decides per call
which kernel the target device would pick, and runs that kernel's own aten op on the meta
tensors (`_scaled_dot_product_{flash,efficient,cudnn}_attention`): torch's meta kernels give
their outputs and autograd their saved tensors and backward, exactly as they are shaped on
the device. Math is left to the meta decomposition (the device's math path keeps the same).

How the kernel is picked, for `device="cuda"` (no GPU needed): torch's rules, as written in
its `sdp_utils.cpp` (`select_sdp_backend`): the backends in torch's priority order
(`torch._C._get_sdp_priority_order()`, which the `torch.nn.attention.sdpa_kernel` context
sets), each taken if enabled (`torch.backends.cuda.*_sdp_enabled()`, which `sdpa_kernel`
sets too) and its constraints hold for these shapes and dtypes on the assumed GPU:
- flash: fp16/bf16; no `attn_mask`; q, k and v head sizes equal and at most 256; sm80 to
  sm121 (training with a head size in (192, 224] refused on sm86-89 and sm120-121);
  `is_causal` only with as many queries as keys;
- memory-efficient: sm50 to sm121; fp16, bf16 (sm80 on) or fp32; head sizes a multiple of
  the GEMM alignment (8 for 16-bit on sm70 on, 4 for fp32 on sm80 on); masks allowed;
- cuDNN: fp16/bf16; sm80 to sm121; head size a multiple of 8 and at most 128 (256 with a
  cuDNN past 9.22 on sm90/sm100, not assumed); dropout a multiple of 1/16; more than one key;
  q, k and v laid out as (batch, seq, heads, dim) transposed (what a projection gives);
- all: as many key as value heads and, with fewer key/value heads than query heads
  (grouped-query attention), `enable_gqa=True` and a whole number of query heads per key
  head. Flash and cuDNN take k and v as they are; for memory-efficient attention the dry
  run repeats them per query head (assumed: the upper bound).
Assumed, not read from a device: the GPU (sm90, an H100, unless `capability=` names
another), a torch built with flash, memory-efficient and cuDNN attention, no deterministic
algorithms, and torch's default priority order: flash, memory-efficient, math, cuDNN. (A CUDA
build with a cuDNN newer than 9.15 puts cuDNN first on sm90/sm100; cuDNN keeps what flash
keeps, so the estimate is the same.) `attention="flash"|"efficient"|"cudnn"|"math"` skips the
choice. For `device="cpu"` torch is asked directly (`torch._fused_sdp_choice` on tiny CPU
tensors of the same heads, head size and dtypes), and the CPU flash kernel is run on meta.

Not counted: the workspace a fused backward allocates and frees inside the kernel (flash's
float32 dq accumulator, (batch, seq, heads, dim), and with GQA its per-query-head dk and dv
before they are summed per key head): about 2x the query's bytes, for one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

KERNELS = ("flash", "efficient", "cudnn", "math")
_BACKENDS = {
    SDPBackend.FLASH_ATTENTION.value: "flash",
    SDPBackend.EFFICIENT_ATTENTION.value: "efficient",
    SDPBackend.CUDNN_ATTENTION.value: "cudnn",
    SDPBackend.MATH.value: "math",
}
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Target:
    """The device a dry run plans for: its type, the GPU assumed for "cuda" (a compute
    capability: (9, 0) is sm90, an H100), and an attention kernel named instead of torch's
    choice (None: torch's choice)."""

    device: str = "cuda"
    capability: tuple[int, int] = (9, 0)
    attention: str | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(
                f"funcshard.estimate: device must be 'cuda' or 'cpu', got {self.device!r}. "
                f"Name the device type the step will run on."
            )
        cap = self.capability
        if not (isinstance(cap, tuple) and len(cap) == 2 and all(isinstance(c, int) for c in cap)):
            raise TypeError(
                f"funcshard.estimate: capability must be (major, minor), e.g. (9, 0) for an "
                f"H100 or (8, 0) for an A100, got {cap!r}."
            )
        if self.attention is not None and self.attention not in KERNELS:
            raise ValueError(
                f"funcshard.estimate: attention must be one of {KERNELS} or None (torch's "
                f"choice), got {self.attention!r}."
            )


@dataclass(frozen=True)
class _Call:
    """One attention call's shapes and options, as the kernel rules read them."""

    query: Tensor  # (B, H, S, D)
    key: Tensor  # (B, Hkv, S_kv, D)
    value: Tensor  # (B, Hkv, S_kv, Dv)
    mask: bool
    dropout_p: float
    is_causal: bool
    enable_gqa: bool

    @property
    def grad(self) -> bool:
        return any(t.requires_grad for t in (self.query, self.key, self.value))


def choose(target: Target, call: _Call) -> str:
    """The kernel `target` would run for `call`: "flash", "efficient", "cudnn" or "math"."""
    if target.attention is not None:
        return target.attention
    if target.device == "cpu":
        return _cpu_choice(call)
    enabled = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
    }
    rules = {"flash": _flash_ok, "efficient": _efficient_ok, "cudnn": _cudnn_ok}
    for backend in torch._C._get_sdp_priority_order():
        name = _BACKENDS.get(int(backend))
        if name is None or not enabled[name]:
            continue
        if name == "math" or rules[name](call, target.capability):
            return name
    raise ValueError(
        f"funcshard.estimate: no attention kernel enabled on sm{target.capability[0]}"
        f"{target.capability[1]} runs query {tuple(call.query.shape)} {call.query.dtype}, key "
        f"{tuple(call.key.shape)}, mask {call.mask} (torch would fail there too). Enable the "
        f"math kernel or pass attention= to name one."
    )


def _heads_ok(call: _Call) -> bool:
    """Equal batch sizes, and equal heads or grouped-query attention that torch accepts."""
    q, k, v = call.query, call.key, call.value
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return False
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hq == hk == hv:
        return True
    return call.enable_gqa and hk == hv and hq % hk == 0


def _in(cap: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= cap <= high


def _flash_ok(call: _Call, cap: tuple[int, int]) -> bool:
    q, k, v = call.query, call.key, call.value
    d = q.shape[-1]
    if call.mask or q.dtype not in _HALF or not d == k.shape[-1] == v.shape[-1] or d > 256:
        return False
    if not _in(cap, (8, 0), (12, 1)):
        return False
    consumer = _in(cap, (8, 6), (8, 9)) or _in(cap, (12, 0), (12, 1))
    if call.grad and consumer and not (d <= 192 or (call.dropout_p == 0 and d > 224)):
        return False
    if call.is_causal and q.shape[-2] != k.shape[-2]:
        return False
    return _heads_ok(call) and min(q.shape[-2], k.shape[-2]) > 0


def _alignment(dtype: torch.dtype, cap: tuple[int, int]) -> int:
    """The GEMM alignment of memory-efficient attention's head size (torch's
    `minimum_gemm_alignment`)."""
    half = dtype in _HALF
    tensor_cores = cap[0] >= 8 or (cap[0] >= 7 and half)
    alignment = 4 if cap[0] >= 8 else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _efficient_ok(call: _Call, cap: tuple[int, int]) -> bool:
    q, k, v = call.query, call.key, call.value
    if not _in(cap, (5, 0), (12, 1)) or q.shape[-1] != k.shape[-1]:
        return False
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if cap[0] >= 8 else (
        torch.float16, torch.float32,
    )  # fmt: skip
    align = _alignment(q.dtype, cap)
    if q.dtype not in dtypes or q.shape[-1] % align or v.shape[-1] % align:
        return False
    return _heads_ok(call) and min(q.shape[-2], k.shape[-2]) > 0


def _cudnn_ok(call: _Call, cap: tuple[int, int]) -> bool:
    q, k, v = call.query, call.key, call.value
    if q.dtype not in _HALF or not _in(cap, (8, 0), (12, 1)):
        return False
    if call.dropout_p * 16 != int(call.dropout_p * 16) or max(q.shape[0], q.shape[1]) > 65535:
        return False
    if max(q.shape[-1], v.shape[-1]) > 128 or q.shape[-1] % 8 or v.shape[-1] % 8:
        return False
    if k.shape[-2] == 1 or not all(_projected_layout(t) for t in (q, k, v)):
        return False
    return _heads_ok(call)


def _projected_layout(t: Tensor) -> bool:
    """(B, S, H, D) contiguous, seen as (B, H, S, D): what cuDNN takes unpacked."""
    _, h, s, d = t.shape
    return t.stride() == (s * h * d, d, h * d, 1)


def _cpu_choice(call: _Call) -> str:
    """Ask torch which kernel the CPU runs, on tiny CPU tensors of the same heads, head size
    and dtype (the choice does not depend on the sequence length there)."""

    def tiny(t: Tensor) -> Tensor:
        return torch.zeros((*t.shape[:-2], 1, t.shape[-1]), dtype=t.dtype)

    mask = torch.ones((1, 1, 1, 1)) if call.mask else None
    choice = torch._fused_sdp_choice(
        tiny(call.query), tiny(call.key), tiny(call.value), mask, call.dropout_p,
        call.is_causal, enable_gqa=call.enable_gqa,
    )  # fmt: skip
    return "flash" if choice == SDPBackend.FLASH_ATTENTION.value else "math"


def attention(
    target: Target,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor | None:
    """`F.scaled_dot_product_attention` on meta tensors as `target` would run it, or None
    where that is the math path (the meta decomposition then runs as usual)."""
    if query.device.type != "meta" or query.dim() != 4:
        return None
    call = _Call(query, key, value, attn_mask is not None, dropout_p, is_causal, enable_gqa)
    kernel = choose(target, call)
    ops = torch.ops.aten
    if kernel == "flash" and target.device == "cpu":
        return ops._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )[0]
    if kernel == "flash":
        return ops._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    if kernel == "efficient":
        key, value = _repeat_heads(query, key, value)  # assumed: repeated per query head
        bias = None if attn_mask is None else _bias(attn_mask, query)
        return ops._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, dropout_p, is_causal, scale=scale
        )[0]
    if kernel == "cudnn":
        bias = None if attn_mask is None else _bias(attn_mask, query)
        return ops._scaled_dot_product_cudnn_attention(
            query, key, value, bias, True, dropout_p, is_causal, False, scale=scale
        )[0]
    return None


def _bias(mask: Tensor, query: Tensor) -> Tensor:
    """A boolean mask as the additive bias the fused kernels take (torch converts it)."""
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=query.dtype)
    return mask


def _repeat_heads(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    groups = query.shape[-3] // key.shape[-3]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)


class DeviceKernels(TorchFunctionMode):
    """Run `F.scaled_dot_product_attention` as `target` would (see [Note: attention kernels
    without the device])."""

    def __init__(self, target: Target) -> None:
        super().__init__()
        self.target = target

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            out = attention(self.target, *args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
