"""The process-wide state a task or a test must leave as it found it, and how to name a change.

[Note: a task leaves its process as it found it]
Pool workers outlive the tasks they run, and a test process outlives its tests. A task that
sets torch's default dtype to float64, turns grad mode off, leaves a mode on torch's function
or dispatch stack, sets an environment variable, changes the thread count or the working
directory, or destroys the process group, makes a later, unrelated test fail (or pass for the
wrong reason), far from the cause. So the worker takes a `snapshot` before each task and
compares after it: a difference fails that task with `ProcessStateChanged`, naming each
change and the rank, and the pool is recycled (quit, so the next call starts fresh ranks)
rather than repaired, since not everything here can be put back (a mode left on the stack, a
destroyed group). The test suite's conftest applies the same check to the test process
itself, around each test's setup, call and teardown, and puts back what it can there.
A snapshot reads a dozen values and copies the environment: microseconds, paid per task.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist


class ProcessStateChanged(RuntimeError):
    """A task (or a test) left process-wide state changed; the message names each change."""


def _process_group() -> str:
    if not dist.is_initialized():
        return "none"
    return f"{dist.get_backend()} world {dist.get_world_size()} rank {dist.get_rank()}"


# (what, how to read it): each read is cheap and has no side effect.
_READS: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("torch's default dtype", torch.get_default_dtype),
    ("grad mode", torch.is_grad_enabled),
    ("inference mode", torch.is_inference_mode_enabled),
    ("anomaly detection", torch.is_anomaly_enabled),
    ("deterministic algorithms", torch.are_deterministic_algorithms_enabled),
    ("modes on torch's function stack", torch._C._len_torch_function_stack),
    ("modes on torch's dispatch stack", torch._C._len_torch_dispatch_stack),
    ("torch's intra-op threads", torch.get_num_threads),
    ("the working directory", os.getcwd),
    ("the default process group", _process_group),
)


# Variables others own: pytest sets PYTEST_CURRENT_TEST per phase; torch and the compilers it
# drives write their own on first use, for the rest of the process (inductor's cache
# directory and _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR, triton's paths, OpenMP's and cuBLAS's
# settings: the `os.environ[...] =` lines under torch/_inductor).
_OWNED_NAMES = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "TORCHINDUCTOR_CACHE_DIR",
        "TORCH_WARM_POOL",
        "KMP_DUPLICATE_LIB_OK",
        "CUBLAS_WORKSPACE_CONFIG",
        "CUDA_HOME",
    }
)
_OWNED_PREFIXES = ("_TORCH", "TRITON_")


def _owned_by_others(name: str) -> bool:
    return name in _OWNED_NAMES or name.startswith(_OWNED_PREFIXES)


def snapshot() -> dict[str, Any]:
    """The values a task must leave unchanged, by what they are, plus a copy of the environment."""
    state = {what: read() for what, read in _READS}
    state["environment"] = dict(os.environ)
    return state


def changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Each difference between two snapshots, in words ("grad mode: True, now False")."""
    found = [
        f"{what}: {before[what]!r}, now {after[what]!r}"
        for what, _ in _READS
        if before[what] != after[what]
    ]
    old, new = before["environment"], after["environment"]
    for name in sorted(n for n in old.keys() | new.keys() if not _owned_by_others(n)):
        if old.get(name) != new.get(name):
            was = repr(old[name]) if name in old else "unset"
            now = repr(new[name]) if name in new else "unset"
            found.append(f"environment variable {name}: {was}, now {now}")
    return found


def restore(before: Mapping[str, Any]) -> None:
    """Put back what can be put back from outside (the test process uses this between tests):
    the default dtype, grad mode, anomaly detection, thread count, working directory and
    environment. Modes on torch's stacks, inference mode and the process group are not."""
    torch.set_default_dtype(before["torch's default dtype"])
    torch.set_grad_enabled(before["grad mode"])
    torch.set_anomaly_enabled(before["anomaly detection"])
    torch.set_num_threads(before["torch's intra-op threads"])
    os.chdir(before["the working directory"])
    os.environ.clear()
    os.environ.update(before["environment"])


def changed_error(where: str, found: list[str], fix: str) -> ProcessStateChanged:
    """The error for the changes `found` in `where` (a rank's task, a test)."""
    listed = "\n".join(f"  - {c}" for c in found)
    return ProcessStateChanged(f"{where} left process-wide state changed:\n{listed}\n{fix}")
