"""Reading a checkpoint in one process, with no mesh, no model and no process group:
`read_meta` (its step and `extra`, say to build the model from settings kept there),
`exists` (is there one to resume from), and which directory a path names, or what else it is.

[Note: reading a checkpoint offline]
`load` is collective: the mesh's first rank resolves LATEST and leases the checkpoint for
every rank, then DCP reads collectively. A script that reads a checkpoint before it has a
model (its settings are in `extra`), or a tool that converts one, is a single process that
may or may not be one rank of a job. So the offline readers resolve LATEST themselves, the
way `verify` does, and read tensors through DCP with `no_dist` (never a collective, even
where a process group is initialized). They take no lease: a writer running `save(keep=N)`
on the same directory could retire the checkpoint while they read it, which then fails
loudly (a missing file) rather than reading a wrong byte. A path that is no funcshard
checkpoint gets a ValueError saying what it is (a file, safetensors, torch's own DCP
directory, a save that never completed), not a bare "no LATEST".
"""

from __future__ import annotations

import json
import os
from typing import Any

from funcshard.io import _checkpoint_dir as checkpoint_dir
from funcshard.io import _checkpoint_extra as checkpoint_extra
from funcshard.io import _dcp as dcp
from funcshard.io import _integrity as integrity
from funcshard.io import _rank_values as rank_values
from funcshard.io._checkpoint_latest import META, latest


def read_meta(path: str | os.PathLike, rank: int | None = None) -> tuple[Any, Any]:
    """A checkpoint's `(step, extra)`, read in this process alone: no mesh, no model, no
    process group (e.g. to build the model from settings saved in `extra`).

    `path` is a checkpoint directory or the directory LATEST is in (as for `load`).
    Tensors in `extra` come back on the CPU. Where ranks saved different `extra` (or
    different tensors in it), pass `rank=r` for rank r's; without it that raises, naming
    them. Reads no parameter and unpickles nothing.
    """
    directory = resolve(path, "read_meta")
    meta = _meta(directory)
    size = _saved_ranks(meta)
    if rank is not None and (
        isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size
    ):
        raise ValueError(
            f"funcshard.checkpoint.read_meta: rank must be an int in [0, {size}) (the ranks "
            f"that saved {directory!r}), got {rank!r}."
        )
    if "rank_extra" in meta:
        if rank is None:
            raise ValueError(_needs_rank(directory, "extra differed across ranks", size))
        skeleton = meta["rank_extra"][rank]
    else:
        skeleton = meta.get("extra")
    per_rank = set(meta.get("per_rank", ()))
    wanted = checkpoint_extra.keys(skeleton)
    differing = [k for k in wanted if k in per_rank]
    if differing and rank is None:
        raise ValueError(_needs_rank(directory, "tensors in extra differed across ranks", size))
    stored = {k: rank_values.rank_key(rank or 0, k) if k in differing else k for k in wanted}
    present = set(dcp.dcp_sizes(directory)) if stored else set()
    tensors = dcp.dcp_read(directory, {k: s for k, s in stored.items() if s in present})
    return meta.get("step"), checkpoint_extra.join(skeleton, dict(tensors))


def _needs_rank(directory: str, what: str, size: int) -> str:
    return (
        f"funcshard.checkpoint.read_meta: {directory!r}: {what} when saved, so each rank's "
        f"own was stored. Pass rank=r (0..{size - 1}) to read rank r's."
    )


def _saved_ranks(meta: dict) -> int:
    replicate, shard = meta.get("mesh", (1, 1))
    return int(replicate) * int(shard)


def _meta(directory: str) -> dict:
    with open(os.path.join(directory, META)) as f:
        return json.load(f)


def exists(path: str | os.PathLike) -> bool:
    """Whether `path` names a complete checkpoint that `load` would read: a checkpoint
    directory, or a directory whose LATEST names one. A script's "resume if there is one".

    False where `path` does not exist or holds no checkpoint yet (no LATEST); a file, or a
    LATEST naming a damaged checkpoint, raises as `load` would. No mesh, no collective.
    """
    if os.path.isfile(path):
        resolve(path, "exists")  # raises, saying what the file is
    try:
        resolve(path, "exists")
    except (FileNotFoundError, ValueError):
        return False
    return True


def resolve(path: str | os.PathLike, caller: str) -> str:
    """The complete funcshard checkpoint `path` names (itself, or what its LATEST names);
    else FileNotFoundError, or ValueError saying what `path` is instead."""
    root = os.fspath(path)
    where = f"funcshard.checkpoint.{caller}: {root!r}"
    if not os.path.exists(root):
        raise FileNotFoundError(f"{where} does not exist.")
    if not os.path.isdir(root):
        raise ValueError(
            f"{where} is a file, not a checkpoint directory (a torch.save file loads with "
            f"torch.load). Pass the directory funcshard.checkpoint.save wrote."
        )
    if os.path.exists(os.path.join(root, integrity.DCP_METADATA)):
        if not os.path.exists(os.path.join(root, META)):
            raise ValueError(
                f"{where} is a torch.distributed.checkpoint directory without funcshard's "
                f"{META}: a save that did not complete, or one funcshard did not write "
                f"(torch.distributed.checkpoint.format_utils.dcp_to_torch_save converts "
                f"torch's own)."
            )
        return root
    if os.path.exists(os.path.join(root, checkpoint_dir.LATEST)):
        directory = latest(root, caller)
        return resolve(directory, caller)
    raise ValueError(f"{where} is not a funcshard checkpoint: it {_contents(root)}.")


def _contents(root: str) -> str:
    """What a directory that is no checkpoint holds, in words."""
    names = sorted(os.listdir(root))
    if not names:
        return "is empty"
    if any(n.endswith(".safetensors") for n in names):
        return (
            "holds safetensors files (Hugging Face weights: funcshard.checkpoint.load_hf or "
            "from_pretrained reads them)"
        )
    saves = [n for _, n in checkpoint_dir.saves(root)]
    if saves:
        return (
            f"holds checkpoint directories ({', '.join(saves[:3])}) but no LATEST: no save "
            f"completed there; pass one of them"
        )
    return (
        f"holds neither LATEST nor DCP's {integrity.DCP_METADATA} (it lists {', '.join(names[:5])})"
    )
