"""Hugging Face safetensors checkpoints: pretrained weights straight into shards, and back.

[Note: Hugging Face checkpoints]
`save_pretrained` writes a directory holding `model.safetensors` or, past `max_shard_size`,
files `model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`, whose
`weight_map` names each tensor's file. A safetensors file is an 8-byte length, a JSON header
(each tensor's dtype, shape and byte range) and the tensors' bytes, row-major, so any run of
leading-dim rows of a tensor is one contiguous byte range that can be read alone.

Loading (`load_hf`): every rank reads every file's header (small; safetensors checks it and
that the file is as long as the header says), maps the checkpoint's keys to the model's FQNs
(`rename`, then tied names: a file may hold either name of a tied pair, or both) and checks
them against `like`. A rank's flat shard covers a range of each parameter it overlaps; the
rank opens that tensor as a lazy slice (`get_slice`, a view of the memory-mapped file), takes
the fewest leading-dim rows that cover the range, and copies the range straight into its
new shard, casting to the state's dtype on the way. Nothing is allocated beyond the new
shards; only the pages of those rows are read. Replicated parameters and buffers are read
whole; non-persistent buffers (rotary frequencies) are in no HF file and stay `like`'s
(unless a file has them).

`strict=False` (a pretrained base loaded into a model with new parameters, LoRA adapters):
the tensors the file lacks are copied from `like`'s shards (bitwise, so they keep whatever
initialization `like` was built with), and one warning names them, as
`load_state_dict(strict=False)` reports its missing keys. Unexpected and mis-shaped keys are
still errors (`rename` drops keys the model does not want).

[Note: parameters nothing initialized]
A state built with `init=fs.skip` holds zeros, so a trainable parameter the file lacks
would start training at zero (LoRA's A and B both zero get no gradient: a silent no-op).
The state records no history, so `load_hf` decides it from what it sees: `like` came from
a skip when every parameter of it is all zeros on every rank (any real initialization draws
some nonzero value, so one nonzero element anywhere means `like` was initialized). A
per-parameter test ("this parameter is all zeros") would be wrong: LoRA's B starts at zero
by design, beside a random A. So when `strict=False` keeps trainable parameters, each rank
checks whether any of its shards or replicated parameters holds a nonzero element, one
all-gather of that flag makes every rank agree, and if none does, a second warning names the
kept trainable parameters. Only then is the extra pass and collective paid. A skip-built
`like` whose kept parameters a later load fills (an adapter checkpoint) warns too; that
warning can be filtered.

Every problem (missing, unexpected and mis-shaped keys, an unreadable file) is caught on the
rank that meets it, and one all-gather of a flag tells every rank whether any rank failed;
then all raise the same error. Ranks read different bytes, so a damaged byte range may fail
on one rank only; without the agreement the others would return and hang in their next
collective.

Saving (`save_hf`, in funcshard/io/_hf_save.py): the units are gathered one at a time
(`unshard(state, units=[unit])`, on every rank), and the mesh's first rank copies each
gathered tensor to the CPU and writes an output file as soon as all its tensors are in.
File boundaries are planned from the layout's sizes beforehand, in gather order, so that
rank holds at most one file plus one unit. Tied parameters are written once, under their
first FQN, as `save_pretrained` does (`from_pretrained` ties the other name back). Each
file is written under a `.tmp` name and renamed into place only when all are written (then
the index, then files of an earlier export that this one does not replace are deleted), so
an export that fails while gathering or writing leaves the previous one in place (only a
failure among the renames themselves could leave a mix). The first rank's failure reaches
every rank through the same agreement, which is also where the other ranks wait for the
files to be written."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.comm import _process_groups as process_groups
from funcshard.core._layout import FlatLayout
from funcshard.core._state import ShardedState, ensure_live
from funcshard.core._tree import format_names
from funcshard.io._integrity import CheckpointCorrupted

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
LOAD, SAVE = "funcshard.checkpoint.load_hf", "funcshard.checkpoint.save_hf"


@dataclass(frozen=True)
class _Entry:
    """One tensor of the checkpoint, as its file's header describes it."""

    file: str
    key: str
    shape: tuple[int, ...]


def load_hf(
    path: str | os.PathLike,
    like: ShardedState,
    rename: Callable[[str], str | None] | None = None,
    strict: bool = True,
) -> ShardedState:
    """Load a safetensors checkpoint (a directory `save_pretrained` wrote, sharded or not, or
    one `.safetensors` file) into the layout of `like`, each rank reading only its part.

    `like` may be a meta-built state of zeros (`fs.shard(model, plan, mesh,
    init=fs.skip(model._init_weights))`). `rename(key)` maps a checkpoint key to the model's
    FQN, or to None to drop it. A tied parameter may be stored under either of its names.
    Tensors are cast to the state's dtypes. Peak memory: the new shards, plus whatever pages
    of the mapped files the copy touches (see [Note: Hugging Face checkpoints]).

    `strict=False` loads what the file has and keeps `like`'s values (bitwise) for the
    parameters and persistent buffers it lacks, e.g. new LoRA adapters beside a pretrained
    base: build `like` with the adapters' own initialization and the base's from anywhere
    (it is overwritten). One UserWarning names the kept FQNs. If `like` holds zeros in every
    parameter (`init=fs.skip`), the kept trainable parameters were initialized by nothing,
    and a second UserWarning names them (see [Note: parameters nothing initialized]).

    Raises on every rank, naming them, for missing (with `strict=True`), unexpected and
    mis-shaped keys (ValueError) and for unreadable files (CheckpointCorrupted).
    Communicates: one all-gather of a flag over the mesh (and of the messages, on failure);
    with `strict=False`, when the file lacks trainable parameters, one more of a flag.
    """
    check_state(like, "like", LOAD)
    ensure_live(like, "checkpoint.load_hf")
    if rename is not None and not callable(rename):
        raise TypeError(
            f"{LOAD}: rename must be a function from checkpoint key to FQN (or None to drop "
            f"the key), got {type(rename).__name__}."
        )
    if not isinstance(strict, bool):
        raise TypeError(f"{LOAD}: strict must be True or False, got {strict!r}.")
    root = os.fspath(path)
    loaded, problem = None, None
    kept: list[str] = []
    try:  # reported on every rank below, never a hang
        with ExitStack() as stack:
            handles, entries = _headers(root, stack)
            sources, kept = _sources(root, entries, like, rename, strict)
            loaded = _read(like, sources, handles)
    except Exception as e:
        problem = e
    agree_on_failure(problem, like.layout.mesh.group, LOAD)
    assert loaded is not None
    if kept:  # the same on every rank: every rank read every header
        _warn_kept(root, like, kept)
    return loaded


def _warn_kept(root: str, like: ShardedState, kept: list[str]) -> None:
    """Name the tensors that kept `like`'s values, then the trainable ones among them that
    nothing initialized. See [Note: parameters nothing initialized]."""
    warnings.warn(
        f"{LOAD}(strict=False): {root!r} lacks {len(kept)} of the model's tensors, which "
        f"keep like's values: {format_names(kept, limit=20)}.",
        stacklevel=3,
    )
    trainable = [f for f in kept if f in _trainable(like)]
    if not trainable:
        return
    params = [*like.shards, *like.replicated.values()]
    nonzero = [t.detach().any() for t in params]  # issued together, then read
    mine = int(any(bool(n) for n in nonzero))
    if any(row[0] for row in collectives.all_gather_ints([mine], like.layout.mesh.group)):
        return
    warnings.warn(
        f"{LOAD}(strict=False): trainable parameters {format_names(trainable, limit=20)} "
        f"are all zeros: {root!r} lacks them and like holds zeros in every parameter (built "
        f"with init=fs.skip), so nothing initialized them. Build like with their "
        f"initialization (fs.shard of a model whose new modules initialize themselves, or "
        f"init=fn), or fill them from another checkpoint.",
        stacklevel=3,
    )


def _trainable(like: ShardedState) -> set[str]:
    """The FQNs of `like`'s parameters that get gradients."""
    layout = like.layout
    sharded = {
        f
        for flat in layout.flats
        if not flat.frozen
        for f in flat.fqns
        if f not in flat.frozen_fqns
    }
    return sharded | set(layout.replicated_trainable)


def _files(root: str) -> tuple[list[str], dict[str, str] | None]:
    """The checkpoint's safetensors files, and its index's weight map when it has one (a
    single `model.safetensors` first, as `from_pretrained` looks)."""
    if os.path.isfile(root):
        return [root], None
    if os.path.isfile(os.path.join(root, WEIGHTS)):
        return [os.path.join(root, WEIGHTS)], None
    index = os.path.join(root, INDEX)
    if not os.path.isfile(index):
        raise FileNotFoundError(
            f"{LOAD}: {root!r} holds neither {WEIGHTS} nor {INDEX}. Pass the directory "
            f"save_pretrained wrote (safe_serialization=True), or one .safetensors file."
        )
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
        if any(os.path.basename(n) != n for n in names):
            raise ValueError(f"file names must be plain names in the directory, got {names}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointCorrupted(
            f"{LOAD}: {index} is not a valid index ({type(e).__name__}: {e}). Save or "
            f"download the checkpoint again."
        ) from e
    return [os.path.join(root, n) for n in names], weight_map


def _headers(root: str, stack: ExitStack) -> tuple[dict[str, Any], dict[str, _Entry]]:
    """Open every file of the checkpoint (headers only) and describe every tensor."""
    from safetensors import safe_open

    files, weight_map = _files(root)
    handles: dict[str, Any] = {}
    entries: dict[str, _Entry] = {}
    for file in files:
        try:
            handles[file] = handle = stack.enter_context(safe_open(file, framework="pt"))
        except Exception as e:  # SafetensorError for a damaged or truncated file
            missing = isinstance(e, FileNotFoundError) or not os.path.exists(file)
            raise CheckpointCorrupted(
                f"{LOAD}: {file} "
                + ("is missing, though the index names it" if missing else f"is unreadable: {e}")
                + ". The checkpoint is damaged or incomplete (an interrupted save or "
                "download?); save or download it again."
            ) from e
        for key in handle.keys():  # noqa: SIM118 (a safe_open handle is no dict)
            if key in entries:
                raise CheckpointCorrupted(
                    f"{LOAD}: {key!r} is in both {entries[key].file} and {file}. Save or "
                    f"download the checkpoint again."
                )
            entries[key] = _Entry(file, key, tuple(handle.get_slice(key).get_shape()))
    if weight_map is not None:
        lacking = [
            k
            for k, name in weight_map.items()
            if k not in entries or os.path.basename(entries[k].file) != name
        ]
        if lacking:
            raise CheckpointCorrupted(
                f"{LOAD}: {os.path.join(root, INDEX)} names tensors its files lack: "
                f"{format_names(lacking)}. Save or download the checkpoint again."
            )
    return handles, entries


def _expected(like: ShardedState) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every name the state takes from a checkpoint: FQN -> (shape, required)."""
    layout = like.layout
    out = {
        fqn: (shape, True)
        for flat in layout.flats
        for fqn, shape in zip(flat.fqns, flat.shapes, strict=True)
    }
    out.update({fqn: (tuple(t.shape), True) for fqn, t in like.replicated.items()})
    persistent = set(layout.state_dict_keys or like.buffers)
    out.update({n: (tuple(b.shape), n in persistent) for n, b in like.buffers.items()})
    return out


def _sources(
    root: str,
    entries: dict[str, _Entry],
    like: ShardedState,
    rename: Callable[[str], str | None] | None,
    strict: bool,
) -> tuple[dict[str, _Entry], list[str]]:
    """FQN -> the checkpoint tensor that holds it, and (not `strict`) the required FQNs no
    tensor holds; raises naming every mismatch at once."""
    named: dict[str, _Entry] = {}
    for key, entry in entries.items():
        fqn = key if rename is None else rename(key)
        if fqn is None:
            continue
        if not isinstance(fqn, str):
            raise TypeError(
                f"{LOAD}: rename({key!r}) must return an FQN (str) or None, got {fqn!r}."
            )
        if fqn in named:
            raise ValueError(
                f"{LOAD}: rename maps both {named[fqn].key!r} and {key!r} to {fqn!r}. Map "
                f"each key to its own FQN, or drop one (return None)."
            )
        named[fqn] = entry
    expected = _expected(like)
    aliases = dict(like.layout.aliases)  # second name -> first FQN
    tied = {first: second for second, first in aliases.items()}
    for second, first in aliases.items():
        if first not in named and second in named:  # e.g. only lm_head.weight stored
            named[first] = named[second]

    def described(fqn: str) -> str:
        key = named[fqn].key
        return fqn if key == fqn else f"{key} (as {fqn})"

    lacking = [fqn for fqn, (_, required) in expected.items() if required and fqn not in named]
    missing = [
        fqn + (f" (or its tied name {tied[fqn]})" if fqn in tied else "")
        for fqn in (lacking if strict else [])
    ]
    unexpected = [described(f) for f in named if f not in expected and f not in aliases]
    wrong = [
        f"{described(f)}: checkpoint {named[f].shape}, model {expected[aliases.get(f, f)][0]}"
        for f in named
        if aliases.get(f, f) in expected and named[f].shape != expected[aliases.get(f, f)][0]
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{LOAD}: {root!r} does not match the state: missing "
            f"{format_names(missing) or 'none'}; unexpected {format_names(unexpected) or 'none'}"
            f"; shape differs for {format_names(wrong) or 'none'}. Load a checkpoint of the "
            f"same model configuration; map or drop checkpoint keys with rename=(key -> FQN "
            f"or None)"
            + (
                "; or pass strict=False to keep like's values for what the file lacks (new "
                "adapters)."
                if missing
                else "."
            )
        )
    return {f: named[f] for f in expected if f in named}, ([] if strict else lacking)


def _read(like: ShardedState, sources: dict[str, _Entry], handles: dict[str, Any]) -> ShardedState:
    """The new state: each flat shard built from its covering rows, the rest read whole."""
    layout = like.layout
    rank = layout.mesh.shard_rank
    shards = tuple(
        _read_shard(flat, rank, sources, handles, old)
        for flat, old in zip(layout.flats, like.shards, strict=True)
    )

    def whole(name: str, old: Tensor) -> Tensor:
        entry = sources[name]
        with _reading(entry):
            return torch.empty_like(old).copy_(handles[entry.file].get_tensor(entry.key))

    replicated = {
        f: whole(f, t) if f in sources else t.detach().clone() for f, t in like.replicated.items()
    }
    buffers = {n: whole(n, b) if n in sources else b for n, b in like.buffers.items()}
    return like.replace(shards=shards, replicated=replicated, buffers=buffers)


def _read_shard(
    flat: FlatLayout,
    shard_rank: int,
    sources: dict[str, _Entry],
    handles: dict[str, Any],
    old: Tensor,
) -> Tensor:
    """This rank's shard of `flat`, copied piece by piece from the files, or from `old` (the
    shard of `like`) where the files lack a parameter (padding zero)."""
    start, end = shard_rank * flat.shard_numel, (shard_rank + 1) * flat.shard_numel
    shard = torch.zeros(flat.shard_numel, dtype=flat.dtype, device=old.device)
    for fqn, offset, numel in zip(flat.fqns, flat.offsets, flat.numels, strict=True):
        lo, hi = max(start, offset), min(end, offset + numel)
        if lo < hi and fqn not in sources:
            shard[lo - start : hi - start].copy_(old.detach()[lo - start : hi - start])
        elif lo < hi:
            entry = sources[fqn]
            with _reading(entry):
                _copy_range(shard[lo - start : hi - start], handles[entry.file], entry, lo - offset)
    return shard


def _copy_range(out: Tensor, handle: Any, entry: _Entry, lo: int) -> None:
    """Copy elements [lo, lo + out.numel()) of the row-major tensor `entry` into `out`,
    reading only the leading-dim rows that cover them."""
    if not entry.shape:  # 0-d: no rows to slice
        out.copy_(handle.get_tensor(entry.key).reshape(-1))
        return
    hi = lo + out.numel()
    row = math.prod(entry.shape[1:])
    first, last = lo // row, -(-hi // row)
    rows = handle.get_slice(entry.key)[first:last]  # (last - first, *shape[1:]), mapped
    out.copy_(rows.reshape(-1)[lo - first * row : hi - first * row])


@contextlib.contextmanager
def _reading(entry: _Entry) -> Iterator[None]:
    """Turn an error while reading `entry`'s bytes into one that names it and its file."""
    try:
        yield
    except Exception as e:
        raise CheckpointCorrupted(
            f"{LOAD}: reading {entry.key!r} from "
            f"{entry.file} failed ({type(e).__name__}: {e}). The file is damaged or "
            f"incomplete; save or download it again."
        ) from e


_RAISED = {
    c.__name__: c for c in (CheckpointCorrupted, FileNotFoundError, OSError, ValueError, TypeError)
}


def agree_on_failure(problem: Exception | None, group: Any, where: str) -> None:
    """Raise on every rank of `group` if any rank met a problem, with the first failing
    rank's exception type and each distinct message (naming the ranks that met it unless
    all did). One all-gather of a flag when none did."""
    flags = collectives.all_gather_ints([int(problem is not None)], group)
    if not any(row[0] for row in flags):
        return
    mine = None if problem is None else (type(problem).__name__, str(problem))
    reports = collectives.all_gather_object(mine, group)
    ranks_of: dict[str, list[int]] = {}
    for rank, report in zip(process_groups.group_ranks(group), reports, strict=True):
        if report is not None:
            ranks_of.setdefault(report[1].removeprefix(f"{where}: "), []).append(rank)
    if len(ranks_of) == 1 and all(reports):
        text = f"{where}: {next(iter(ranks_of))}"
    else:
        text = f"{where}: " + "\n".join(
            f"on rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {message}"
            for message, r in ranks_of.items()
        )
    kind = next(report[0] for report in reports if report is not None)
    raise _RAISED.get(kind, RuntimeError)(text) from problem


def check_state(state: Any, argument: str, where: str) -> None:
    if not isinstance(state, ShardedState):
        raise TypeError(
            f"{where}: {argument} must be a ShardedState (from funcshard.shard), got "
            f"{type(state).__name__}."
        )
