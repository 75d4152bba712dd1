"""Host memory a CPU step frees, kept by the C allocator for the next step instead of handed
back to the kernel.

[Note: host memory kept between steps]
On the CPU every tensor comes from the C library's `malloc`. glibc's defaults hand large
blocks back to the kernel: a block above the mmap threshold (128 KiB at first, raised to the
largest block freed so far, at most 32 MiB) is a mapping of its own, unmapped when freed,
and free space at the top of the heap beyond twice that threshold is trimmed. Memory handed
back costs a page fault per 4 KiB page the next time it is touched: the kernel maps and
zeroes every page again, about 1.5 us a page here.

A sharded step frees and reallocates tens of megabytes: each unit's gathered buffer, its
regathered buffer in backward, the flat gradient its reduce-scatter sends, and whatever the
model's own backward allocates. So the heap shrinks and grows by more than the trim
threshold every step, and the faults come back every step. DDP takes fewer: its gradient
buckets live as long as the model.

So once the first funcshard step on the CPU is through (`value_and_grad` on a CPU state, or
a step compiled with `fs.compile`), funcshard asks glibc to keep what the process frees: no
block gets a mapping of its own (`M_MMAP_MAX` 0), and the heap is trimmed only beyond 2 GiB
of free space at its top (`M_TRIM_THRESHOLD`). CUDA's caching allocator does the same on a
GPU: memory a step allocated stays with the process.

Measured with `python -m benchmarks.host_memory`: the training benchmark's GPT (13.8M
parameters) on 2 gloo ranks, funcshard FSDP and DDP in interleaved rounds, 6 processes with
glibc's defaults alternating with 6 keeping memory; medians per process:

| | faults per step, funcshard | faults per step, DDP | funcshard / DDP step time |
|---|---|---|---|
| glibc's defaults | 12,970-15,517 | 548-7,344 | 1.009-1.141 (mean 1.077) |
| memory kept | 2-4 | 0 | 0.982-1.095 (mean 1.025) |

In 5 of the 6 pairs the kept process had the lower ratio (the sixth overlapped with other
work on the machine).

The cost: the process's resident memory stays at its high-water mark between steps, as a
GPU's reserved memory does, instead of falling back, and since every block now comes from
the heap, free holes in its middle can raise that mark above the peak of live tensors.
`release()` hands the free part back (`malloc_trim`), e.g. between training and evaluation;
FUNCSHARD_KEEP_HOST_MEMORY=0 leaves glibc's defaults alone. It is a setting of the whole
process, made once and never undone: every framework in the process (a benchmark's DDP too)
allocates under it from then on, and processes forked after it (DataLoader workers) inherit
it. Other C libraries (musl, macOS's) are left as they are; under an allocator preloaded in
glibc's place (jemalloc, tcmalloc) glibc's settings change nothing, though `kept()` says
True. A block is not always reused by the next of its size: torch asks for 64-byte aligned
blocks, and glibc's per-thread cache (tcache) may hold a small chunk carved from one's slack,
so the block freed beside it cannot merge back to the size an aligned request needs (2 of 3
runs of tests/scripts/host_memory_probe.py on 2026-12-07; none with
GLIBC_TUNABLES=glibc.malloc.tcache_count=0, which only a process's start can set).
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from typing import Any

import torch

ENV = "FUNCSHARD_KEEP_HOST_MEMORY"
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB free at the heap's top


class _Kept:
    """Whether this process asked glibc to keep freed memory (None: not decided yet)."""

    kept: bool | None = None


def keep_for(device_type: str | None) -> None:
    """`keep` after a step on `device_type` if it allocates from the host ("cpu"); not
    while dynamo traces (`fs.compile`'s wrapper calls it after the compiled step)."""
    if device_type == "cpu" and not torch.compiler.is_dynamo_compiling():
        keep()


def keep() -> bool:
    """Ask glibc's malloc to keep the memory the process frees (see [Note: host memory kept
    between steps]); decided once per process. Returns whether memory is kept: False where
    the C library is not glibc or FUNCSHARD_KEEP_HOST_MEMORY=0."""
    if _Kept.kept is None:
        _Kept.kept = os.environ.get(ENV, "1") != "0" and _ask_glibc_to_keep()
    return _Kept.kept


def kept() -> bool:
    """Whether `keep` made glibc keep freed memory in this process."""
    return bool(_Kept.kept)


def release() -> bool:
    """Hand the memory the process has freed back to the kernel now (`malloc_trim`).
    Returns whether any was handed back; False without glibc."""
    trim = _glibc_function("malloc_trim")
    return trim is not None and bool(trim(0))


def _ask_glibc_to_keep() -> bool:
    mallopt = _glibc_function("mallopt")
    return mallopt is not None and bool(
        mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )


@functools.cache
def _glibc_function(name: str) -> Any:
    """glibc's function `name` as the process has it loaded, or None (another C library, no
    ctypes, or a Python linked statically without it)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        import ctypes  # here: a Python built without ctypes still imports funcshard

        return getattr(ctypes.CDLL(None), name, None)  # the process's own symbols
    except (ImportError, OSError):
        return None
