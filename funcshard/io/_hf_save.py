"""Export a state as a Hugging Face safetensors checkpoint: see [Note: Hugging Face
checkpoints] in funcshard/io/_hf.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from funcshard.comm import _process_groups as process_groups
from funcshard.comm import _waits as waits
from funcshard.core._state import ShardedState, ensure_live
from funcshard.io._hf import INDEX, SAVE, SHARD_FILE, WEIGHTS, agree_on_failure, check_state
from funcshard.step._unsharding import unshard


def save_hf(
    path: str | os.PathLike,
    state: ShardedState,
    config: Any = None,
    max_shard_size: int | str = "5GB",  # transformers 4's default; 5's is 50GB
) -> str:
    """Write `state` as a safetensors checkpoint that `from_pretrained` and
    `safetensors.torch.load_file` read, from any mesh; returns `path`.

    `config` (a transformers PretrainedConfig, or a dict) is written as `config.json`.
    Past `max_shard_size` bytes (an int, or "500MB", "2GiB") the weights are split into
    `model-0000k-of-0000n.safetensors` files with `model.safetensors.index.json`, as
    `save_pretrained` splits them. Files are renamed into place only once all are written
    (see [Note: Hugging Face checkpoints]). The mesh's first rank writes, holding one file
    and one unit at most; every rank raises if it fails.

    While the first rank writes a file, the others wait for it for at most `WRITE_TIMEOUT`
    (one hour a file), not the mesh's timeout: through the process group's store (see
    [Note: waits long by nature]), before their next collective.

    Communicates: one all-gather per flat buffer, one unit at a time, a wait through the
    store after each unit that completes a file and at the end, and two all-gathers of a
    flag over the mesh.
    """
    check_state(state, "state", SAVE)
    ensure_live(state, "checkpoint.save_hf")
    limit = _size_in_bytes(max_shard_size)
    config_text = _config_text(config)
    root = os.fspath(path)
    layout = state.layout
    group = layout.mesh.group
    order = _write_order(state)
    files = _plan_files(order, limit)
    writer = _Writer(root, files, dict(order)) if process_groups.group_rank(group) == 0 else None
    if writer is not None:
        writer.prepare(config, config_text)
    agree_on_failure(writer.report() if writer else None, group, SAVE)
    writes = _writes_after(state, files)
    for unit, writes_a_file in zip(layout.units, writes, strict=True):
        gathered = unshard(state, units=[unit])
        if writer is not None:
            writer.add(gathered)
        del gathered  # the next unit's gather may reuse its memory
        if writes_a_file:
            _wait_for_the_writer(group)
    if writer is not None:
        persistent = set(layout.state_dict_keys or state.buffers)
        writer.add({f: state.replicated[f] for f in layout.replicated})
        writer.add({n: b for n, b in state.buffers.items() if n in persistent})
        writer.commit()
    _wait_for_the_writer(group)
    agree_on_failure(writer.report() if writer else None, group, SAVE)
    return root


WRITE_TIMEOUT = timedelta(hours=1)  # one file of max_shard_size bytes (5 GB: 1.4 MB/s)


def _writes_after(state: ShardedState, files: dict[str, list[str]]) -> list[bool]:
    """For each unit, in order: whether the first rank writes a file once it has that
    unit's parameters (the same on every rank: the files are planned alike everywhere)."""
    layout = state.layout
    have: set[str] = set()
    done: set[str] = set()
    writes = []
    for unit in layout.units:
        have.update(f for flat in layout.flats if flat.unit == unit for f in flat.fqns)
        complete = {name for name, keys in files.items() if have.issuperset(keys)}
        writes.append(bool(complete - done))
        done |= complete
    return writes


def _wait_for_the_writer(group: Any) -> None:
    """Wait, with a bound of its own, while the mesh's first rank writes (see
    [Note: waits long by nature]); a collective would wait only the mesh's timeout."""
    waits.every_rank_arrives(
        "save_hf",
        process_groups.group_ranks(group),
        WRITE_TIMEOUT,
        SAVE,
        "The first rank of the mesh writes the files; one that has not arrived is still "
        "writing (a slow file system) or gone.",
    )


def _size_in_bytes(size: int | str) -> int:
    """`max_shard_size` in bytes: an int, or a number and a unit (KB = 1000, KiB = 1024)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B\s*", str(size), re.IGNORECASE)
    if not isinstance(size, str) or match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"{SAVE}: max_shard_size must be a positive int (bytes) or a size such as "
            f"'500MB' or '2GiB', got {size!r}."
        )
    number, prefix, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** "_KMGT".index(prefix.upper() or "_"))


def _config_text(config: Any) -> str | None:
    """config.json's text for a dict (checked before any collective), else None."""
    if config is None or hasattr(config, "save_pretrained"):
        return None
    if not isinstance(config, Mapping):
        raise TypeError(
            f"{SAVE}: config must be a transformers PretrainedConfig or a dict, got "
            f"{type(config).__name__}."
        )
    try:
        return json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
    except TypeError as e:
        raise TypeError(f"{SAVE}: config must be JSON-serializable, got {e}.") from e


def _write_order(state: ShardedState) -> list[tuple[str, int]]:
    """(key, bytes) of each tensor the export writes, in the order the ranks gather them."""
    layout = state.layout
    order = [
        (fqn, numel * flat.dtype.itemsize)
        for unit in layout.units
        for flat in layout.flats
        if flat.unit == unit
        for fqn, numel in zip(flat.fqns, flat.numels, strict=True)
    ]
    order += [(f, state.replicated[f].nbytes) for f in layout.replicated]
    persistent = set(layout.state_dict_keys or state.buffers)
    order += [(n, b.nbytes) for n, b in state.buffers.items() if n in persistent]
    return order


def _plan_files(order: list[tuple[str, int]], limit: int) -> dict[str, list[str]]:
    """File name -> its keys: consecutive runs of `order` of at most `limit` bytes each (a
    tensor larger than that alone in its file), named as save_pretrained names them."""
    runs: list[list[str]] = [[]]
    size = 0
    for key, nbytes in order:
        if runs[-1] and size + nbytes > limit:
            runs.append([])
            size = 0
        runs[-1].append(key)
        size += nbytes
    if len(runs) == 1:
        return {WEIGHTS: runs[0]}
    return {f"model-{i:05d}-of-{len(runs):05d}.safetensors": r for i, r in enumerate(runs, 1)}


class _Writer:
    """The first rank's side of `save_hf`: collects gathered tensors on the CPU and writes
    each file once complete; remembers its first failure instead of raising, so that it
    keeps taking part in the other ranks' gathers (see `agree_on_failure`)."""

    def __init__(self, root: str, files: dict[str, list[str]], sizes: dict[str, int]) -> None:
        self.root, self.files, self.sizes = root, files, sizes
        self.file_of = {key: name for name, keys in files.items() for key in keys}
        self.pending: dict[str, Tensor] = {}
        self.written: list[str] = []
        self.failure: Exception | None = None

    def prepare(self, config: Any, config_text: str | None) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
            for name in os.listdir(self.root):  # what an export that died left behind
                if name.endswith(".tmp") and name.startswith("model"):
                    os.remove(os.path.join(self.root, name))
            if config_text is not None:
                _replace_with(os.path.join(self.root, "config.json"), config_text)
            elif config is not None:
                config.save_pretrained(self.root)
        except Exception as e:
            self.failure = e

    def add(self, tensors: Mapping[str, Tensor]) -> None:
        if self.failure is not None:
            return
        try:
            for key, t in tensors.items():  # own CPU copies: views would share storage
                self.pending[key] = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
            for name, keys in self.files.items():
                if name not in self.written and all(k in self.pending for k in keys):
                    self._write(name, {k: self.pending.pop(k) for k in keys})
        except Exception as e:
            self.failure = e

    def _write(self, name: str, tensors: dict[str, Tensor]) -> None:
        from safetensors.torch import save_file

        save_file(tensors, os.path.join(self.root, name + ".tmp"), metadata={"format": "pt"})
        self.written.append(name)

    def commit(self) -> None:
        """Rename the files into place, write the index, delete stale files of earlier saves."""
        try:
            if self.failure is None:
                unwritten = [n for n in self.files if n not in self.written]
                if unwritten:  # a bug, not a user error: every key belongs to some unit
                    raise RuntimeError(f"{SAVE}: files {unwritten} were never completed.")
                for name in self.written:
                    os.replace(
                        os.path.join(self.root, name + ".tmp"), os.path.join(self.root, name)
                    )
                if len(self.files) > 1:
                    _replace_with(os.path.join(self.root, INDEX), self._index())
                self._delete_stale()
        except Exception as e:
            self.failure = e
        if self.failure is not None:
            for name in self.files:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.root, name + ".tmp"))

    def report(self) -> OSError | None:
        """The first failure, in words for every rank (None if there was none)."""
        if self.failure is None:
            return None
        error = self.failure
        return OSError(f"{SAVE}: writing {self.root!r} failed: {type(error).__name__}: {error}")

    def _index(self) -> str:
        index = {
            "metadata": {"total_size": sum(self.sizes.values())},
            "weight_map": dict(sorted(self.file_of.items())),
        }
        return json.dumps(index, indent=2, sort_keys=True) + "\n"

    def _delete_stale(self) -> None:
        ours = set(self.files)
        sharded = len(self.files) > 1
        for name in os.listdir(self.root):
            stale = (
                (SHARD_FILE.fullmatch(name) is not None and name not in ours)
                or (name == WEIGHTS and sharded)
                or (name == INDEX and not sharded)
            )
            if stale:
                os.remove(os.path.join(self.root, name))


def _replace_with(target: str, text: str) -> None:
    """Write `text` to `target` atomically (a temporary file, then os.replace)."""
    with open(target + ".tmp", "w") as f:
        f.write(text)
    os.replace(target + ".tmp", target)
