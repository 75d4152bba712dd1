"""A funcshard checkpoint as a plain `torch.save` file of the model's full state dict, made in
one process with no mesh (for a script that samples with `torch.load`, as nanoGPT's does).

[Note: exporting a checkpoint]
A checkpoint stores each parameter once, by its first FQN, as a 1-D tensor of its
flattened values under `params/<fqn>` (sharded across the saving ranks), replicated
parameters whole under the same prefix, buffers under `buffers/<name>`, the optimizer's
leaves under `optim/` (see [Note: checkpoints] in funcshard/io/_checkpoint.py). The export
reads the `params/` and `buffers/` keys whole with DCP in this process alone ([Note: reading
a checkpoint offline] in funcshard/io/_checkpoint_offline.py), and leaves the optimizer on
disk. What a flat key does not say, funcshard.json does since saves record it: each
parameter's shape, the module's `state_dict()` keys in order (persistent buffers only) and
its tied names as (second name, first FQN). A tied name is written as the same tensor as
its first FQN, so `torch.save` stores one storage under both keys, as `model.state_dict()`
gives them, and `load_state_dict` fills both. A checkpoint saved before these were recorded
exports with `model=` (any module of the same architecture, on the meta device is fine):
its `state_dict()` keys, parameter shapes and shared parameters say the same things.
Values saved per rank (a replicated parameter that differed, HSDP replicas that diverged)
export as the first rank's, as `full_state_dict` gives them. The file is written beside
`out` and moved onto it with `os.replace`, so a failed export leaves no half file.
`under="model"` writes `{"model": state_dict, **extra}` instead, the layout nanoGPT's
sample.py reads (its `model_args` kept in `extra` at save): `extra` must then be one dict,
the same on every saving rank, with no key named `under`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import Tensor, nn

from funcshard.io import _dcp as dcp
from funcshard.io import _integrity as integrity
from funcshard.io import _rank_values as rank_values
from funcshard.io._checkpoint_latest import META
from funcshard.io._checkpoint_offline import read_meta, resolve
from funcshard.io._checkpoint_verify import verify as verify_checkpoint

_WHERE = "funcshard.checkpoint.export_state_dict"


def export_state_dict(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    overwrite: bool = False,
    verify: bool = True,
    under: str | None = None,
) -> str:
    """Write the full `model.state_dict()` a checkpoint holds to `out` with `torch.save`, in
    this process alone (no mesh, no process group); returns `out`.

    `path` is a checkpoint directory or the directory LATEST is in. Keys are the module's
    `state_dict()` keys (persistent buffers included), tensors in their saved dtype on the
    CPU, tied weights one tensor under each of their names. The optimizer state is left
    out. An existing `out` is refused unless `overwrite=True`. With `verify` (the default)
    every byte is first checked against the save's checksums. `model=` (optional) supplies
    keys, shapes and ties for a checkpoint saved before funcshard recorded them.
    `under="model"` writes `{"model": state_dict, **extra}` (the save's `extra` dict beside
    it, as nanoGPT's `ckpt.pt` holds `model` and `model_args`). See
    [Note: exporting a checkpoint].
    """
    target = os.fspath(out)
    if os.path.isdir(target):
        raise IsADirectoryError(f"{_WHERE}: out {target!r} is a directory; pass a file path.")
    if os.path.exists(target) and not overwrite:
        raise FileExistsError(
            f"{_WHERE}: {target!r} exists; pass overwrite=True (CLI: --overwrite) to replace it."
        )
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(
            f"{_WHERE}: model must be an nn.Module or None, got {type(model).__name__}."
        )
    directory = resolve(path, "export_state_dict")
    if verify:
        _check(directory)
    written: Any = read_state_dict(directory, model)
    if under is not None:
        written = {under: written, **_extra_beside(directory, under)}
    folder = os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    partial = os.path.join(folder, f".{os.path.basename(target)}.partial")
    try:
        torch.save(written, partial)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


def _extra_beside(directory: str, under: str) -> dict[str, Any]:
    """The save's `extra`, to write beside the state dict under `under`; refused, naming
    why, where it cannot sit there."""
    try:
        _, extra = read_meta(directory)
    except ValueError as e:
        raise ValueError(f"{_WHERE}: under={under!r} writes extra beside the model, but {e}") from e
    extra = {} if extra is None else extra
    if not isinstance(extra, dict) or under in extra:
        what = f"holds a key {under!r}" if isinstance(extra, dict) else "is not a dict"
        raise ValueError(
            f"{_WHERE}: under={under!r} writes the save's extra beside the model, but its "
            f"extra {what}. Pass another under=, or export the bare state dict (under=None)."
        )
    return extra


def _check(directory: str) -> None:
    report = verify_checkpoint(directory)
    if report.problems:
        raise integrity.CheckpointCorrupted(
            f"{_WHERE}: {directory!r} is corrupted; nothing was written:\n  "
            + "\n  ".join(report.problems)
        )


def read_state_dict(directory: str, model: nn.Module | None = None) -> dict[str, Tensor]:
    """The full state dict of a resolved checkpoint directory, in `state_dict()` order."""
    stored = _model_keys(directory)
    tensors = dcp.dcp_read(directory, stored)
    params = {k.removeprefix("params/"): v for k, v in tensors.items() if k.startswith("params/")}
    buffers = {
        k.removeprefix("buffers/"): v for k, v in tensors.items() if k.startswith("buffers/")
    }
    shapes, keys, aliases = _model_facts(directory, model, params)
    whole = {f: v.view(shapes[f]) for f, v in params.items()}
    whole.update({second: whole[first] for second, first in aliases})
    everything = {**whole, **buffers}
    missing = [k for k in keys if k not in everything]
    if missing:
        raise ValueError(
            f"{_WHERE}: {directory!r} holds no {', '.join(missing[:5])}, which the model's "
            f"state_dict() has. Pass the model that saved it."
        )
    return {k: everything[k] for k in keys or everything}


def _model_keys(directory: str) -> dict[str, str]:
    """The stored key to read for each parameter and buffer: its own, or the first rank's
    (first replica's) where it was saved per rank."""
    out: dict[str, str] = {}
    for key in sorted(dcp.dcp_sizes(directory)):
        base = rank_values.base_key(key)
        if not base.startswith(("params/", "buffers/")):
            continue
        first = key in (base, rank_values.rank_key(0, base), rank_values.replica_key(0, base))
        if first:
            out.setdefault(base, key)
    return out


def _model_facts(
    directory: str, model: nn.Module | None, params: dict[str, Tensor]
) -> tuple[dict[str, tuple[int, ...]], list[str], list[tuple[str, str]]]:
    """Each parameter's shape, the `state_dict()` keys, the tied (second, first) names:
    from `model` when given, else from funcshard.json."""
    if model is not None:
        return _from_model(directory, model, params)
    with open(os.path.join(directory, META)) as f:
        recorded: Any = json.load(f).get("model")
    if recorded is None:
        raise ValueError(
            f"{_WHERE}: {directory!r} was saved by a funcshard that did not record parameter "
            f"shapes and tied names. Pass model= (a module of the same architecture; on "
            f"torch.device('meta') is fine)."
        )
    shapes = {f: tuple(s) for f, s in recorded["shapes"].items()}
    return shapes, list(recorded["state_dict_keys"]), [tuple(p) for p in recorded["aliases"]]


def _from_model(
    directory: str, model: nn.Module, params: dict[str, Tensor]
) -> tuple[dict[str, tuple[int, ...]], list[str], list[tuple[str, str]]]:
    firsts: dict[int, str] = {}
    aliases = []
    shapes = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first = firsts.setdefault(id(p), name)
        if first != name:
            aliases.append((name, first))
        else:
            shapes[name] = tuple(p.shape)
    wrong = [
        f"{f} (saved {params[f].numel()} elements, model {tuple(shapes[f])})"
        for f in shapes
        if f in params and params[f].numel() != torch.Size(shapes[f]).numel()
    ]
    unknown = sorted(set(params) - set(shapes))
    if wrong or unknown:
        raise ValueError(
            f"{_WHERE}: {directory!r} does not match {type(model).__name__}: parameters it "
            f"lacks {', '.join(unknown[:5]) or 'none'}; sizes that differ "
            f"{', '.join(wrong[:5]) or 'none'}. Pass the model that saved it."
        )
    return shapes, list(model.state_dict(keep_vars=True)), aliases
