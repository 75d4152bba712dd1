"""Checkpoints through torch.distributed.checkpoint: sharded, atomic, any world size.

[Note: checkpoints]
Every parameter is saved by FQN as a 1-D sharded tensor of its flattened values: each rank
contributes the contiguous piece its flat shard holds (replicas hold the same pieces; DCP
writes each chunk once), so nothing is gathered and no byte is written twice. Optimizer state
that lines up with the flat buffers (Adam's moments, SGD's momentum) is split the same way
under `optim/<path>/<fqn>`; its other tensors (step counts), replicated parameters and
buffers are plain tensors. Loading builds the same keys laid out like `like` and lets DCP
read whichever saved pieces overlap, which is what makes another world size, mesh or plan
work.

Atomic: a save writes a fresh directory `step-<n>-<k>` (or `save-<k>`) under `path`, then
replaces the file `path/LATEST` with `os.replace`, which is atomic; `load` reads only what
LATEST names, so a save that dies half way never changes what loads. `step` and `extra` are
written as JSON, so loading unpickles nothing. What a load checks before it reads a byte:
[Note: checkpoint integrity] in funcshard/integrity.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
from datetime import timedelta
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch import Tensor

from funcshard import collectives, integrity
from funcshard.hf import load_hf as load_hf
from funcshard.hf_save import save_hf as save_hf
from funcshard.integrity import CheckpointCorrupted as CheckpointCorrupted
from funcshard.integrity import Report as Report
from funcshard.layout import FlatLayout, Layout
from funcshard.state import ShardedState, ensure_live
from funcshard.tree import format_names

LATEST = "LATEST"
META = "funcshard.json"


def save(
    path: str | os.PathLike,
    state: ShardedState,
    opt_state: Any = None,
    step: int | None = None,
    extra: dict | None = None,
    keep: int | None = None,
    checksums: bool = True,
) -> str:
    """Save the state (and optimizer state, step, JSON-able `extra`) under directory `path`.

    With `checksums` (the default) every chunk's CRC-32 is recorded for `load` and `verify`
    to check (see [Note: checkpoint integrity]). `keep=N` then deletes the checkpoints older
    than the last N complete ones, never the one LATEST names.
    Returns the directory written. Communicates: a barrier, DCP's collective save, and
    all-gathers of the save counter, the checksums and the commit's outcome.
    """
    ensure_live(state, "checkpoint.save")
    if opt_state is not None:  # on every rank, before any collective
        _optim_leaves(opt_state, state.layout)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"funcshard.checkpoint.save: keep must be an int >= 1, got {keep!r}.")
    try:  # on every rank, before any collective: a late failure on one rank would hang
        meta = json.dumps({"step": step, "extra": extra, "checksums": checksums})
    except TypeError as e:
        raise TypeError(
            f"funcshard.checkpoint.save: step and extra must be JSON values (numbers, "
            f"strings, lists, dicts), got {e}. Convert them, e.g. tensors with .tolist()."
        ) from e
    root = os.fspath(path)
    group = state.layout.mesh.group
    first = collectives.group_rank(group) == 0
    if first:
        os.makedirs(root, exist_ok=True)
    collectives.barrier(group, _TIMEOUT)
    # a fresh name every time: the directory LATEST names is never touched by a later save
    index = _next_index(root, group)
    name = f"step-{step}-{index}" if step is not None else f"save-{index}"
    target = os.path.join(root, name)
    collectives.dcp_save(_to_dcp(_first_ranks_buffers(state), opt_state), target)
    chunk_records = _checksummed(target, group) if checksums else None
    failed = None
    if first:
        try:  # a failure here must reach every rank, not leave them waiting in a barrier
            _commit(root, name, meta, chunk_records, keep)
        except Exception as e:
            failed = f"{type(e).__name__}: {e}"
    failed = collectives.all_gather_object(failed, group)[0]
    if failed is not None:
        raise OSError(f"funcshard.checkpoint.save: committing {target!r} failed: {failed}")
    return target


def _commit(root: str, name: str, meta: str, chunk_records: list[dict] | None, keep: int | None):
    """On the first rank: write funcshard.json and the checksums, point LATEST at `name`
    (atomically: the commit point), then retire old checkpoints."""
    target = os.path.join(root, name)
    with open(os.path.join(target, META), "w") as f:
        f.write(meta)
    if chunk_records is not None:  # before the commit: LATEST never names a dir without
        integrity.write(target, chunk_records, (integrity.DCP_METADATA, META))
    pointer = os.path.join(root, LATEST + ".tmp")
    with open(pointer, "w") as f:
        f.write(name)
    os.replace(pointer, os.path.join(root, LATEST))  # the commit point
    if keep is not None:
        _retire(root, name, keep)


def _checksummed(target: str, group: Any) -> list[dict]:
    """Every chunk's checksum record, each rank computing its share (all ranks get all)."""
    share, shares = collectives.group_rank(group), group.size()
    try:
        mine: Any = integrity.checksum_share(target, share, shares)
    except Exception as e:  # reported on every rank below, never a hang
        mine = f"rank {collectives.global_rank()}: {type(e).__name__}: {e}"
    shares_ = collectives.all_gather_object(mine, group)
    failed = [s for s in shares_ if isinstance(s, str)]
    if failed:
        raise OSError(
            f"funcshard.checkpoint.save: could not checksum what was written to {target!r}: "
            f"{'; '.join(failed)}. LATEST still names the previous checkpoint."
        )
    return [record for records in shares_ for record in records]


def _retire(root: str, latest: str, keep: int) -> None:
    """Delete checkpoints older than the last `keep` complete ones (never `latest`)."""
    saves = [(i, n) for i, n in _saves(root) if _written_by_save(os.path.join(root, n))]
    complete = [name for _, name in saves if os.path.exists(os.path.join(root, name, META))]
    kept = set(complete[-keep:]) | {latest}
    oldest_kept = min(i for i, name in saves if name in kept)
    for index, name in saves:
        if index < oldest_kept and name not in kept:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _written_by_save(directory: str) -> bool:
    """Whether a directory holds only what a save writes (never delete anything else)."""
    if not os.path.isdir(directory):
        return False
    names = os.listdir(directory)
    ours = {META, integrity.CHECKSUMS, integrity.DCP_METADATA}
    return all(n in ours or (n.startswith("__") and n.endswith(".distcp")) for n in names)


def _saves(root: str) -> list[tuple[int, str]]:
    """The entries of `root` named like checkpoints, as (save counter, name), oldest first."""
    return sorted((i, name) for name in os.listdir(root) if (i := _index(name)) is not None)


def _index(name: str) -> int | None:
    """The save counter in a checkpoint directory's name (`step-<s>-<k>` or `save-<k>`)."""
    match = re.fullmatch(r"(?:step-(?:None|-?[0-9]+)|save)-([0-9]+)", name)
    return int(match.group(1)) if match else None


def load(
    path: str | os.PathLike, like: tuple[ShardedState, Any], verify: bool = True
) -> tuple[Any, Any, Any, Any]:
    """Load the latest complete save under `path` (or the checkpoint directory `path`) into
    the layout of `like=(state, opt_state)`.

    Returns `(state, opt_state, step, extra)`. Works across world sizes, meshes and plans.
    With `verify` (the default) every byte is first checked against the save's checksums,
    and a mismatch raises `CheckpointCorrupted` on every rank (see [Note: checkpoint
    integrity]). Communicates: one all-gather of what the checks found, DCP's collective load.
    """
    state, opt_state = like
    directory = _latest(os.fspath(path))
    if verify:
        _verified(directory, state.layout.mesh.group)
    template = _to_dcp(state, opt_state, zeros=True)
    _check_keys(directory, template)
    try:
        collectives.dcp_load(template, directory)
    except collectives.CheckpointReadError as e:  # DCP raises every rank's read errors on all
        raise integrity.CheckpointCorrupted(
            f"funcshard.checkpoint.load: {directory!r} could not be read "
            f"({_first_line(e)}). Its files are damaged or incomplete. "
            f"{_previous_hint(directory)}"
        ) from e
    new_state, new_opt = _from_dcp(state, opt_state, template)
    with open(os.path.join(directory, META)) as f:
        meta = json.load(f)
    return new_state, new_opt, meta["step"], meta["extra"]


def verify(path: str | os.PathLike) -> integrity.Report:
    """Check the checkpoint LATEST names under `path` (or the checkpoint directory `path`)
    byte for byte against its checksums, offline: no process group needed."""
    directory = _latest(os.fspath(path), "verify")
    if integrity.read(directory) is None and _saved_with_checksums(directory):
        missing = f"{os.path.join(directory, integrity.CHECKSUMS)}: missing"
        return integrity.Report(directory, (f"{integrity.CHECKSUMS}: missing",), (missing,), True)
    return integrity.verify(directory)


_TIMEOUT = timedelta(minutes=5)


def _verified(directory: str, group: Any) -> None:
    """Check the checkpoint's bytes against its checksums before anything reads them: each
    rank its share of the chunks; every rank raises if any rank found a mismatch."""
    share, shares = collectives.group_rank(group), group.size()
    try:
        record = integrity.read(directory)
        if record is None and _saved_with_checksums(directory):
            found: Any = [f"{os.path.join(directory, integrity.CHECKSUMS)}: missing"]
        elif record is None:
            found = None
        else:
            found = integrity.check_files(directory, record) + integrity.check_chunks(
                directory, record, share, shares
            )
    except Exception as e:  # reported on every rank below, never a hang
        found = [f"{directory}: {type(e).__name__}: {e}"]
    everyone = collectives.all_gather_object(found, group)
    if any(f is None for f in everyone):
        warnings.warn(
            f"funcshard.checkpoint.load: {directory!r} was saved without checksums "
            f"(save(checksums=False), or before funcshard wrote them), so its bytes are not "
            f"verified.",
            stacklevel=3,
        )
        return
    problems = sorted({p for f in everyone for p in f})
    if problems:
        listed = "\n  ".join(problems)
        raise integrity.CheckpointCorrupted(
            f"funcshard.checkpoint.load: {directory!r} is corrupted; nothing was loaded:\n  "
            f"{listed}\n{_previous_hint(directory)}"
        )


def _saved_with_checksums(directory: str) -> bool:
    """What funcshard.json says of the save (checkpoints before checksums do not say)."""
    try:
        with open(os.path.join(directory, META)) as f:
            return bool(json.load(f).get("checksums", False))
    except (OSError, ValueError):
        return False


def _previous_hint(directory: str) -> str:
    """What to do instead: load the newest complete checkpoint before `directory`."""
    root, name = os.path.split(os.path.normpath(directory))
    index = _index(name)
    older = [
        (i, n)
        for i, n in _saves(root)
        if index is not None and i < index and os.path.exists(os.path.join(root, n, META))
    ]
    if not older:
        return "There is no earlier complete checkpoint under it to load instead."
    previous = os.path.join(root, older[-1][1])
    return (
        f"Load the previous checkpoint instead: funcshard.checkpoint.load({previous!r}, "
        f"like=...), and check it with `funcshard checkpoint verify {previous}`."
    )


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""


def _next_index(root: str, group: Any) -> int:
    """A save counter above every checkpoint's under `root` (retention deletes old ones, so a
    count of entries could repeat a live name), as the first rank sees them."""
    used = [i for i, _ in _saves(root)]
    index = max([*used, len(os.listdir(root)) - 1]) + 1
    return collectives.all_gather_ints([index], group)[0][0]


def _latest(root: str, caller: str = "load") -> str:
    """The checkpoint LATEST names under `root`, or `root` itself if it is a checkpoint."""
    if os.path.exists(os.path.join(root, integrity.DCP_METADATA)):
        return root
    pointer = os.path.join(root, LATEST)
    if not os.path.isfile(pointer):
        raise FileNotFoundError(
            f"funcshard.checkpoint.{caller}: no complete checkpoint under {root!r} (no "
            f"{LATEST} file). Save one with funcshard.checkpoint.save first."
        )
    with open(pointer) as f:
        directory = os.path.join(root, f.read().strip())
    if not os.path.isdir(directory):
        raise integrity.CheckpointCorrupted(
            f"funcshard.checkpoint.{caller}: {pointer} names {directory!r}, which is missing. "
            f"{_previous_hint(directory)}"
        )
    return directory


def _pieces(shard: Tensor, flat: FlatLayout, shard_rank: int) -> dict[str, tuple[int, Tensor]]:
    """The piece of each parameter that this rank's shard holds: fqn -> (start, values)."""
    start, end = shard_rank * flat.shard_numel, (shard_rank + 1) * flat.shard_numel
    out = {}
    for fqn, offset, numel in zip(flat.fqns, flat.offsets, flat.numels, strict=True):
        lo, hi = max(start, offset), min(end, offset + numel)
        if lo < hi:
            out[fqn] = (lo - offset, shard[lo - start : hi - start])
    return out


def _split(prefix: str, shard: Tensor, flat: FlatLayout, layout: Layout) -> dict[str, Any]:
    """One 1-D sharded tensor per parameter of a flat buffer, holding this rank's piece."""
    mesh = layout.mesh
    pieces = _pieces(shard, flat, mesh.shard_rank)
    # Sharded over the shard axis only: each replica holds (and loads) all of it, and DCP's
    # save planner writes a chunk that several replicas hold once.
    return {
        f"{prefix}/{fqn}": collectives.sharded_tensor(
            [pieces[fqn]] if fqn in pieces else [], numel, mesh.shard_group
        )
        for fqn, numel in zip(flat.fqns, flat.numels, strict=True)
    }


def _join(prefix: str, loaded: dict[str, Any], flat: FlatLayout, layout: Layout) -> Tensor:
    """This rank's flat shard rebuilt from loaded per-parameter pieces (padding zero)."""
    shard = torch.zeros(flat.shard_numel, dtype=flat.dtype, device=layout.mesh.device)
    base = layout.mesh.shard_rank * flat.shard_numel
    for fqn, offset in zip(flat.fqns, flat.offsets, strict=True):
        for start, values in collectives.local_pieces(loaded[f"{prefix}/{fqn}"]):
            at = offset + start - base
            shard[at : at + values.numel()] = values.reshape(-1)
    return shard


def _optim_leaves(opt_state: Any, layout: Layout) -> tuple[list[Any], Any]:
    """Each optimizer leaf with its key, and the flat index it lines up with (or None).

    Flattened with torch's pytree (funcshard's records, dicts, tuples, NamedTuples and
    dataclasses registered with `torch.utils._pytree`), and what torch sees as a leaf with
    optree's (types registered there); a leaf neither knows, other than a tensor, a number,
    a string or None, raises naming its path, so no state is silently left out.
    """
    paths_and_leaves, spec = torch_pytree.tree_flatten_with_path(opt_state)
    described, parts = [], []
    for path, leaf in paths_and_leaves:
        prefix = torch_pytree.keystr(path)
        if _savable(leaf):
            items, part = [(prefix, leaf, path[-1] if path else None)], None
        else:
            accessors, sub_leaves, sub_spec = optree.tree_flatten_with_accessor(
                leaf, none_is_leaf=True
            )
            if len(sub_leaves) == 1 and sub_leaves[0] is leaf:
                _refuse(prefix, leaf)
            items = [
                (prefix + acc.codify(""), sub, acc[-1] if len(acc) else None)
                for acc, sub in zip(accessors, sub_leaves, strict=True)
            ]
            part = (sub_spec, len(items))
            for key, sub, _ in items:
                if not _savable(sub):
                    _refuse(key, sub)
        parts.append(part)
        for key, item, last in items:
            index = _entry(last)
            aligned = (
                isinstance(item, Tensor)
                and isinstance(index, int)
                and index < len(layout.flats)
                and item.dim() == 1
                and item.numel() == layout.flats[index].shard_numel
            )
            key = key.lstrip(".")
            replicated = _replicated_at(item, index, layout)
            if aligned:
                key = key.rsplit("[", 1)[0]
            elif replicated is not None:  # a replicated parameter's moment: keyed by its FQN
                key = f"{key.rsplit('[', 1)[0]}/{replicated}"
            described.append((item, f"optim/{key}", index if aligned else None))
    return described, (spec, parts)


def _replicated_at(item: Any, index: Any, layout: Layout) -> str | None:
    """The replicated parameter an optimizer leaf at `index` of a per-leaf sequence belongs
    to (they follow the flat buffers, as in `ShardedState.leaves()`), or None."""
    if not isinstance(item, Tensor) or not isinstance(index, int):
        return None
    at = index - len(layout.flats)
    return layout.replicated[at] if 0 <= at < len(layout.replicated) else None


def _entry(key: Any) -> Any:
    """The index or key a path step names (torch's SequenceKey/MappingKey, optree's entry)."""
    for field in ("idx", "key", "entry"):
        if hasattr(key, field):
            return getattr(key, field)
    return None


def _rebuild_optim(spec: Any, leaves: list[Any]) -> Any:
    """The optimizer state `_optim_leaves` flattened, from its (loaded) leaves."""
    torch_spec, parts = spec
    outer, at = [], 0
    for part in parts:
        if part is None:
            outer.append(leaves[at])
            at += 1
        else:
            sub_spec, count = part
            outer.append(optree.tree_unflatten(sub_spec, leaves[at : at + count]))
            at += count
    return torch_pytree.tree_unflatten(outer, torch_spec)


def _savable(leaf: Any) -> bool:
    return leaf is None or isinstance(leaf, Tensor | int | float | bool | str)


def _refuse(path: str, leaf: Any) -> None:
    raise TypeError(
        f"funcshard.checkpoint: the optimizer state's {path or 'root'} is a "
        f"{type(leaf).__qualname__}, which is neither a tensor nor a pytree node, so it "
        f"cannot be saved. Register its type as a pytree (a dataclass: "
        f"torch.utils._pytree.register_dataclass; or optree.register_pytree_node), or "
        f"make it a NamedTuple or a dict."
    )


def _first_ranks_buffers(state: ShardedState) -> ShardedState:
    """`state` holding the mesh's first rank's buffers: each rank's own (BatchNorm's running
    statistics) may differ, and DCP writes a tensor that several ranks hold from whichever
    rank it picks, so every rank saves the first rank's, as `full_state_dict` returns them.
    Communicates: one broadcast per buffer."""
    mesh = state.layout.mesh
    if mesh.size == 1 or not state.buffers:
        return state
    first = {
        n: collectives.broadcast(b, mesh.group, src_rank=mesh.ranks[0])
        for n, b in state.buffers.items()
    }
    return dataclasses.replace(state, buffers=first)


def _to_dcp(state: ShardedState, opt_state: Any, zeros: bool = False) -> dict[str, Any]:
    """The DCP state dict: sharded per parameter, plain tensors for the rest."""
    layout = state.layout

    def value(t: Tensor) -> Tensor:
        return torch.zeros_like(t) if zeros else t

    out: dict[str, Any] = {}
    for flat, shard in zip(layout.flats, state.shards, strict=True):
        out.update(_split("params", value(shard), flat, layout))
    out.update({f"params/{k}": value(v) for k, v in state.replicated.items()})
    out.update({f"buffers/{k}": value(v) for k, v in state.buffers.items()})
    if opt_state is not None:
        for leaf, key, index in _optim_leaves(opt_state, layout)[0]:
            if index is not None:
                out.update(_split(key, value(leaf), layout.flats[index], layout))
            elif isinstance(leaf, Tensor):
                out[key] = value(leaf)
    return out


def _from_dcp(state: ShardedState, opt_state: Any, loaded: dict[str, Any]) -> tuple[Any, Any]:
    layout = state.layout
    new_state = state.replace(
        shards=tuple(_join("params", loaded, flat, layout) for flat in layout.flats),
        replicated={k: loaded[f"params/{k}"] for k in state.replicated},
        buffers={k: loaded[f"buffers/{k}"] for k in state.buffers},
    )
    if opt_state is None:
        return new_state, None
    described, spec = _optim_leaves(opt_state, layout)
    leaves = [
        _join(key, loaded, layout.flats[index], layout)
        if index is not None
        else (loaded[key] if isinstance(leaf, Tensor) else leaf)
        for leaf, key, index in described
    ]
    return new_state, _rebuild_optim(spec, leaves)


def _check_keys(directory: str, template: dict[str, Any]) -> None:
    saved = collectives.dcp_sizes(directory)
    missing = sorted(set(template) - set(saved))
    unexpected = sorted(set(saved) - set(template))
    wrong = [
        f"{k} (saved {saved[k]}, expected {collectives.global_size(v)})"
        for k, v in template.items()
        if k in saved and saved[k] != collectives.global_size(v)
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"funcshard.checkpoint.load: {directory!r} does not match the state: missing "
            f"{format_names(missing) or 'none'}; unexpected {format_names(unexpected) or 'none'}; "
            f"shape differs for {format_names(wrong) or 'none'}. Load into the model (and "
            f"optimizer) that saved it; world size, mesh and plan may differ."
        )
