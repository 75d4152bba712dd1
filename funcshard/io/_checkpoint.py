"""Checkpoints through torch.distributed.checkpoint: sharded, atomic, any world size, and
exactly what each rank saved.

[Note: checkpoints]
Every parameter is saved by FQN as a 1-D sharded tensor of its flattened values: each rank
contributes the contiguous piece its flat shard holds (replicas hold the same pieces; DCP
writes each chunk once), so nothing is gathered and no byte is written twice. Optimizer state
that lines up with the flat buffers (Adam's moments, SGD's momentum) is split the same way
under `optim/<path>/<fqn>`; owned state by FQN; its other tensors (step counts), replicated
parameters and buffers are plain tensors, and its Python numbers are written to
funcshard.json (see [Note: optimizer leaves in checkpoints] in funcshard/io/_optim_leaves.py).
Loading builds the same keys laid out like `like` and lets DCP read whichever saved pieces
overlap, which is what makes another world size, mesh or plan work.

What DCP would store once but the ranks hold differently is found before anything is
written and stored per rank ([Note: per-rank leaves] in funcshard/io/_rank_values.py).

Atomic: a save writes a fresh directory `step-<n>-<k>` (or `save-<k>`) under `path`, created
exclusively, then replaces the file `path/LATEST` with `os.replace`, which is atomic; `load`
reads only what LATEST names, so a save that dies half way never changes what loads. Several
jobs on one directory: [Note: writers and readers of a checkpoint directory] in
funcshard/io/_checkpoint_dir.py. `step` and `extra` are written as JSON, tensors in `extra` as DCP
entries ([Note: tensors in extra] in funcshard/io/_checkpoint_extra.py), so loading unpickles
nothing. Each parameter's shape, the module's `state_dict()` keys and its tied names go to
funcshard.json too, for readers without the model ([Note: exporting a checkpoint] in
funcshard/io/_checkpoint_export.py). What a load checks before it reads a byte: [Note: checkpoint
integrity] in funcshard/io/_integrity.py.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.comm import _failures as failures
from funcshard.comm import _process_groups as process_groups
from funcshard.core._state import ShardedState, ensure_live
from funcshard.io import _checkpoint_dict as checkpoint_dict
from funcshard.io import _checkpoint_dir as checkpoint_dir
from funcshard.io import _checkpoint_extra as checkpoint_extra
from funcshard.io import _checkpoint_match as checkpoint_match
from funcshard.io import _dcp as dcp
from funcshard.io import _integrity as integrity
from funcshard.io import _rank_values as rank_values
from funcshard.io._checkpoint_dir import CheckpointConflict as CheckpointConflict
from funcshard.io._checkpoint_export import export_state_dict as export_state_dict
from funcshard.io._checkpoint_latest import META, open_checkpoint, previous_hint
from funcshard.io._checkpoint_latest import CheckpointRetired as CheckpointRetired
from funcshard.io._checkpoint_offline import exists as exists
from funcshard.io._checkpoint_offline import read_meta as read_meta
from funcshard.io._checkpoint_verify import verified
from funcshard.io._checkpoint_verify import verify as verify
from funcshard.io._dcp import CheckpointDiskFull as CheckpointDiskFull
from funcshard.io._hf import load_hf as load_hf
from funcshard.io._hf_save import save_hf as save_hf
from funcshard.io._integrity import CheckpointCorrupted as CheckpointCorrupted
from funcshard.io._integrity import Report as Report
from funcshard.io._optim_leaves import Full, optim_leaves, rebuild, stored

# funcshard.checkpoint's public names (this module is funcshard.checkpoint, see
# funcshard/__init__.py); the others are its machinery, importable but not promised.
__all__ = [
    "CheckpointConflict",
    "CheckpointCorrupted",
    "CheckpointDiskFull",
    "CheckpointRetired",
    "Report",
    "exists",
    "export_state_dict",
    "load",
    "load_hf",
    "read_meta",
    "save",
    "save_hf",
    "verify",
]

_optim_leaves = optim_leaves  # the name tests/io/test_optim_state_checkpoint.py reads
LATEST = checkpoint_dir.LATEST


def save(
    path: str | os.PathLike,
    state: ShardedState,
    opt_state: Any = None,
    step: int | None = None,
    extra: dict | None = None,
    keep: int | None = None,
    checksums: bool = True,
) -> str:
    """Save the state (and optimizer state, step, `extra`) under directory `path`.

    `extra` holds JSON values and tensors (see [Note: tensors in extra]); anything else is a
    TypeError naming its key, on every rank, before anything is written. Values that differ
    across ranks are saved per rank (see [Note: per-rank leaves]); Python numbers in the
    optimizer state are saved too. With `checksums` (the default) every chunk's CRC-32 is
    recorded for `load` and `verify` to check (see [Note: checkpoint integrity]). `keep=N`
    then deletes this job's checkpoints (and dead jobs') older than its last N complete
    ones, never the one LATEST names. A save whose directory another job committed to
    meanwhile raises `CheckpointConflict` (see [Note: writers and readers of a checkpoint
    directory]). Returns the directory written. Communicates: all-gathers
    of the digests, the directory's name, the checksums and the commit's outcome, a
    broadcast per buffer, DCP's collective save. Every rank of the state's mesh calls it, at
    the same point of the program: a rank that saves alone raises a CollectiveError naming
    this call within the mesh's timeout, as do the ranks it left waiting.
    """
    ranks = list(state.layout.mesh.ranks)
    with failures.every_rank_calls("funcshard.checkpoint.save", ranks):
        return _save(path, state, opt_state, step, extra, keep, checksums)


def _save(
    path: str | os.PathLike,
    state: ShardedState,
    opt_state: Any,
    step: int | None,
    extra: dict | None,
    keep: int | None,
    checksums: bool,
) -> str:
    ensure_live(state, "checkpoint.save")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"funcshard.checkpoint.save: keep must be an int >= 1, got {keep!r}.")
    mesh = state.layout.mesh
    group = mesh.group
    rank = process_groups.group_rank(group)
    try:  # on every rank; what any rank finds is raised on all below, never a hang
        described = optim_leaves(opt_state, state.layout)[0] if opt_state is not None else []
        report: Any
        report, extra_tensors = _report(state, described, step, extra)
    except (TypeError, ValueError) as e:
        report, extra_tensors = (type(e).__name__, str(e)), {}
    reports = collectives.all_gather_object(report, group)
    _raise_first(reports)
    _check_steps(reports)
    per_rank = rank_values.differing(
        [
            {**r["plain"], **{k: rank_values.digest(v) for k, v in r["scalars"].items()}}
            for r in reports
        ]
    )
    per_replica = rank_values.differing_replicas(
        [r["flats"] for r in reports], [r["shard_rank"] for r in reports]
    )
    root = os.fspath(path)
    me, name = _create(root, step, mesh, rank == 0)
    target = os.path.join(root, name)
    entries, flat_of = checkpoint_dict.to_dcp(checkpoint_dict.first_ranks_buffers(state), described)
    entries.update(extra_tensors)
    routed = {
        _stored_key(k, flat_of.get(k), per_rank, per_replica, mesh, rank): v
        for k, v in entries.items()
    }
    dcp.dcp_save(routed, target, group)
    chunk_records = _checksummed(target, group) if checksums else None
    failed = None
    if rank == 0:
        try:  # a failure here must reach every rank, not leave them waiting in a barrier
            meta = _meta(reports, entries, flat_of, per_rank, per_replica, mesh, checksums, me)
            meta = _with_model(meta, state)
            _commit(root, name, meta, chunk_records, keep, me)
        except Exception as e:
            failed = (type(e).__name__, str(e))
    failed = collectives.all_gather_object(failed, group)[0]
    if failed is not None:
        kind, message = failed
        if kind == CheckpointConflict.__name__:
            raise CheckpointConflict(f"funcshard.checkpoint.save: {message}")
        raise OSError(f"funcshard.checkpoint.save: committing {target!r} failed: {kind}: {message}")
    return target


def _report(state: ShardedState, described: list, step: Any, extra: Any) -> tuple[dict, dict]:
    """What this rank would save that other ranks may hold differently: digests of the
    leaves that are stored once (see [Note: per-rank leaves]), its Python numbers, extra
    (its JSON part; its tensors are returned beside, see [Note: tensors in extra])."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"funcshard.checkpoint.save: step must be an int or None, got {step!r}.")
    skeleton, extra_tensors = checkpoint_extra.split(extra)
    extra_json = json.dumps(skeleton, sort_keys=True)
    mesh = state.layout.mesh
    scalars = _scalars(described)
    json.dumps(scalars)  # numbers, strings: always JSON
    plain: dict[str, Any] = {}
    if mesh.size > 1:
        plain = {
            key: rank_values.digest(v)
            for v, key, i in described
            if i is None and isinstance(v, Tensor)
        }
        for v, key, i in described:
            if isinstance(i, Full):  # each parameter's piece is one stored value
                pieces = checkpoint_dict.full_pieces(key, v, state.layout.flats[i.flat])
                plain.update({k: rank_values.digest(p) for k, p in pieces.items()})
        plain.update({f"params/{k}": rank_values.digest(v) for k, v in state.replicated.items()})
        plain.update({k: rank_values.digest(v) for k, v in extra_tensors.items()})
    flats = {}
    if mesh.replicate_size > 1:
        shards = checkpoint_dict.flat_shards(state, described)
        flats = {k: rank_values.digest(v) for k, v in shards.items()}
    return {
        "step": step,
        "extra": extra_json,
        "scalars": scalars,
        "plain": plain,
        "flats": flats,
        "shard_rank": mesh.shard_rank,
    }, extra_tensors


def _scalars(described: list) -> dict[str, Any]:
    """The optimizer state's Python numbers and strings by key (None is not stored: see
    [Note: optimizer leaves in checkpoints])."""
    return {k: v for v, k, _ in described if not isinstance(v, Tensor) and stored(v)}


def _raise_first(reports: list[Any]) -> None:
    """Raise, on every rank, the first error any rank found preparing its save."""
    for rank, report in enumerate(reports):
        if isinstance(report, tuple):
            kind, message = report
            error = TypeError if kind == "TypeError" else ValueError
            raise error(f"{message} (found on rank {rank} of the mesh)")


def _check_steps(reports: list[dict]) -> None:
    steps = [r["step"] for r in reports]
    if len(set(steps)) > 1:
        listed = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
        raise ValueError(
            f"funcshard.checkpoint.save: step must be the same on every rank, got {listed}. "
            f"Pass the training step every rank agrees on (keep per-rank positions in extra)."
        )


def _stored_key(
    key: str, flat: str | None, per_rank: set, per_replica: set, mesh: Any, rank: int
) -> str:
    """Where an entry is stored: its own key, or under its rank or replica when it differs."""
    if flat is not None and flat in per_replica:
        return rank_values.replica_key(mesh.replicate_rank, key)
    if key in per_rank:
        return rank_values.rank_key(rank, key)
    return key


def _meta(reports, entries, flat_of, per_rank, per_replica, mesh, checksums, me) -> str:
    """funcshard.json: step, extra, Python numbers, which keys are per rank or replica."""
    extras = [r["extra"] for r in reports]
    scalars, rank_scalars = {}, {}
    for key in sorted({k for r in reports for k in r["scalars"]}):
        held = {str(i): r["scalars"][key] for i, r in enumerate(reports) if key in r["scalars"]}
        if key in per_rank:
            rank_scalars[key] = held
        else:
            scalars[key] = next(iter(held.values()))
    meta: dict[str, Any] = {
        "format": 2,
        "step": reports[0]["step"],
        "extra": json.loads(extras[0]) if len(set(extras)) == 1 else None,
        "checksums": checksums,
        "mesh": [mesh.replicate_size, mesh.shard_size],
        "writer": me.id,
        "scalars": scalars,
        "rank_scalars": rank_scalars,
        "per_rank": sorted(k for k in per_rank if k not in scalars and k not in rank_scalars),
        "per_replica": sorted(k for k in entries if flat_of.get(k) in per_replica),
    }
    if len(set(extras)) > 1:
        meta["rank_extra"] = [json.loads(e) for e in extras]
    return json.dumps(meta)


def _with_model(meta: str, state: ShardedState) -> str:
    """funcshard.json with what a reader without the model needs to rebuild its
    `state_dict()`: each parameter's shape, the keys in order, the tied names (see [Note:
    exporting a checkpoint] in funcshard/io/_checkpoint_export.py)."""
    layout = state.layout
    shapes = {
        f: list(s) for flat in layout.flats for f, s in zip(flat.fqns, flat.shapes, strict=True)
    }
    shapes.update({f: list(t.shape) for f, t in state.replicated.items()})
    model = {
        "shapes": shapes,
        "state_dict_keys": list(layout.state_dict_keys),
        "aliases": [list(pair) for pair in layout.aliases],
    }
    return json.dumps({**json.loads(meta), "model": model})


def _create(root: str, step: Any, mesh: Any, first: bool) -> tuple[Any, str]:
    """On the first rank: this job's writer of `root` and a fresh directory of its own; its
    name on every rank. Communicates: one all-gather."""
    me = None
    found: str | tuple[str, str] | None = None
    if first:
        try:
            os.makedirs(root, exist_ok=True)
            me = checkpoint_dir.writer(root, tuple(mesh.ranks))
            found = checkpoint_dir.create(root, f"step-{step}" if step is not None else "save", me)
        except Exception as e:
            found = ("error", f"{type(e).__name__}: {e}")
    found = collectives.all_gather_object(found, mesh.group)[0]
    if isinstance(found, tuple):
        raise OSError(f"funcshard.checkpoint.save: cannot write under {root!r}: {found[1]}")
    return me, found


def _commit(root: str, name: str, meta: str, chunk_records: list[dict] | None, keep, me) -> None:
    """On the first rank: write funcshard.json and the checksums, point LATEST at `name`
    (atomically: the commit point), then retire old checkpoints."""
    target = os.path.join(root, name)
    with open(os.path.join(target, META), "w") as f:
        f.write(meta)
    if chunk_records is not None:  # before the commit: LATEST never names a dir without
        integrity.write(target, chunk_records, (integrity.DCP_METADATA, META))
    checkpoint_dir.move_latest(root, name, me)
    if keep is not None:
        _retire(root, name, keep, me)


def _checksummed(target: str, group: Any) -> list[dict]:
    """Every chunk's checksum record, each rank computing its share (all ranks get all)."""
    share, shares = process_groups.group_rank(group), group.size()
    try:
        mine: Any = integrity.checksum_share(target, share, shares)
    except Exception as e:  # reported on every rank below, never a hang
        mine = f"rank {process_groups.global_rank()}: {type(e).__name__}: {e}"
    shares_ = collectives.all_gather_object(mine, group)
    failed = [s for s in shares_ if isinstance(s, str)]
    if failed:
        raise OSError(
            f"funcshard.checkpoint.save: could not checksum what was written to {target!r}: "
            f"{'; '.join(failed)}. LATEST still names the previous checkpoint."
        )
    return [record for records in shares_ for record in records]


def _retire(root: str, latest: str, keep: int, me: Any) -> None:
    """Delete this writer's (and dead writers') checkpoints older than its last `keep`
    complete ones, never `latest` (see [Note: writers and readers of a checkpoint directory])."""
    saves = [
        (i, n)
        for i, n in checkpoint_dir.saves(root)
        if _written_by_save(os.path.join(root, n)) and _retirable(root, n, me)
    ]
    complete = [name for _, name in saves if os.path.exists(os.path.join(root, name, META))]
    kept = set(complete[-keep:]) | {latest}
    oldest_kept = min([i for i, name in saves if name in kept] or [0])
    doomed = [name for i, name in saves if i < oldest_kept and name not in kept]
    checkpoint_dir.retire(root, doomed, me)


def _retirable(root: str, name: str, me: Any) -> bool:
    """Whether this writer may retire checkpoint `name`: its own, or a dead writer's."""
    wid = checkpoint_dir.owner(os.path.join(root, name))
    return wid == me.id or not checkpoint_dir.running(root, wid, me)


def _written_by_save(directory: str) -> bool:
    """Whether a directory holds only what a save writes (never delete anything else)."""
    if not os.path.isdir(directory):
        return False
    names = os.listdir(directory)
    ours = {META, integrity.CHECKSUMS, integrity.DCP_METADATA, checkpoint_dir.WRITER}
    return all(n in ours or (n.startswith("__") and n.endswith(".distcp")) for n in names)


def load(
    path: str | os.PathLike,
    like: tuple[ShardedState, Any],
    verify: bool = True,
    *,
    per_rank: str | int = "refuse",
) -> tuple[Any, Any, Any, Any]:
    """Load the latest complete save under `path` (or the checkpoint directory `path`) into
    the layout of `like=(state, opt_state)`.

    Returns `(state, opt_state, step, extra)`; tensors in `extra` come back on the CPU. Works across
    world sizes, meshes and plans; `like=(state, None)` loads the parameters alone, whatever else
    the checkpoint holds.
    Values saved per rank come back to the same rank of a mesh of the same shape; elsewhere
    `per_rank` says what to do: "refuse" (the default) raises naming them, "like" keeps
    `like`'s, an int r gives every rank rank r's (see [Note: per-rank leaves]). With `verify`
    (the default) every byte is first checked against the save's checksums, and a mismatch
    raises `CheckpointCorrupted` on every rank (see [Note: checkpoint integrity]). The mesh's
    first rank resolves LATEST once and holds the checkpoint against retirement while every
    rank reads it. Communicates: all-gathers of the directory, what the checks found and
    the keys, DCP's collective load; so every rank of the mesh calls it, at the same point
    (see `save`).
    """
    state, opt_state = _unpack(like)
    rank_values.check_option(per_rank)
    group = state.layout.mesh.group
    with failures.every_rank_calls("funcshard.checkpoint.load", list(state.layout.mesh.ranks)):
        directory, held = open_checkpoint(os.fspath(path), group)
        try:
            if verify:
                verified(directory, group)
            return _read(directory, state, opt_state, per_rank)
        finally:
            checkpoint_dir.release(held)


def _unpack(like: Any) -> tuple[ShardedState, Any]:
    if isinstance(like, tuple) and len(like) == 2 and isinstance(like[0], ShardedState):
        return like
    raise TypeError(
        f"funcshard.checkpoint.load: like must be a pair (state, opt_state), got "
        f"{type(like).__name__}. Pass like=(state, opt_state), or like=(state, None) to load "
        f"the parameters alone."
    )


def _read(directory: str, state: ShardedState, opt_state: Any, per_rank: Any) -> tuple:
    """Load what `directory` holds into `like`'s layout: keys checked on every rank first."""
    mesh = state.layout.mesh
    rank = process_groups.group_rank(mesh.group)
    described, spec = optim_leaves(opt_state, state.layout) if opt_state is not None else ([], None)
    with open(os.path.join(directory, META)) as f:
        meta = json.load(f)
    template, _ = checkpoint_dict.to_dcp(state, described, zeros=True)
    like_scalars = _scalars(described)
    plan = checkpoint_match.LoadPlan(
        directory, meta, (mesh.replicate_size, mesh.shard_size), rank, per_rank
    )
    routed, kept, scalars, problems = plan.route(template, like_scalars)
    saved = dcp.dcp_sizes(directory)
    extra_routed = _route_extra(plan, directory, saved, problems)
    routed.update(extra_routed)
    for key in [k for k in routed if k not in saved and checkpoint_match.migrated(k)]:
        kept.append(rank_values.base_key(key))  # an older format's: like's values stay
        del routed[key]
    # every number like holds is asked for, so one the checkpoint never held is named missing
    numbers = set(like_scalars) if meta.get("scalars") is not None else set()
    report = (sorted({rank_values.base_key(k) for k in routed} | set(kept) | numbers),
              problems, checkpoint_match.shape_problems(saved, routed))  # fmt: skip
    checkpoint_match.agree_on_keys(
        directory, saved, meta, report, opt_state is not None, mesh.group
    )
    checkpoint_match.warn_casts(directory, routed)
    extra = plan.extra()  # may refuse: the same on every rank
    try:
        dcp.dcp_load(routed, directory, mesh.group)
    except dcp.CheckpointReadError as e:  # DCP raises every rank's read errors on all
        raise integrity.CheckpointCorrupted(
            f"funcshard.checkpoint.load: {directory!r} could not be read "
            f"({_first_line(e)}). Its files are damaged or incomplete. "
            f"{previous_hint(directory)}"
        ) from e
    loaded = {rank_values.base_key(k): v for k, v in routed.items()}
    extra = checkpoint_extra.join(extra, {rank_values.base_key(k): routed[k] for k in extra_routed})
    own = checkpoint_dict.to_dcp(state, described)[0] if kept else {}
    loaded.update({k: _copy(own[k]) for k in kept})
    loaded.update(scalars)
    new_state, leaves = checkpoint_dict.from_dcp(state, described, loaded)
    new_opt = rebuild(spec, leaves) if opt_state is not None else None
    return new_state, new_opt, meta["step"], extra


def _route_extra(plan: Any, directory: str, saved: dict, problems: list) -> dict[str, Tensor]:
    """Where `extra`'s tensors load from (stored key -> an empty CPU tensor to read into),
    this rank's where they were saved per rank (see [Note: tensors in extra])."""
    dtypes = dcp.dcp_dtypes(directory) if saved else {}
    bases = sorted(
        {b for k in saved if (b := rank_values.base_key(k)).startswith(checkpoint_extra.PREFIX)}
    )
    out, refused = {}, []
    for key in bases:
        where = plan.where(key)
        if where is False:
            refused.append("extra")
        elif isinstance(where, str) and where in saved:
            out[where] = torch.empty(saved[where], dtype=dtypes[where])
    if refused:
        problems.append(plan.refusal(refused[:1]))
    return out


def _copy(value: Any) -> Any:
    plain = isinstance(value, Tensor) and not hasattr(value, "local_shards")
    return value.clone() if plain else value


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""
