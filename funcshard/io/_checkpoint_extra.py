"""A checkpoint's `extra`: JSON values and tensors, stored without pickle.

[Note: tensors in extra]
`extra` is the caller's own record (model settings, a data loader's position, an RNG
state). Its JSON values go to funcshard.json as before. Each tensor in it is replaced there
by a marker `{"__funcshard_tensor__": "extra/<i>"}` (i counts the tensors in the order a
walk of `extra` meets them) and saved through torch.distributed.checkpoint under that key,
beside the parameters. So a load reads it with DCP's tensor reader (torch.load with
weights_only) and unpickles nothing it did not before. The key is a number, not the path
in `extra`, so any dict key is fine. The tensors are digested like the other leaves stored
once: one that differs across ranks is stored per rank, `rank/<r>/extra/<i>` ([Note:
per-rank leaves] in funcshard/io/_rank_values.py). Anything in `extra` that is neither a
JSON value nor a tensor is a TypeError naming its key, found before anything is written.
Loaded tensors come back on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

MARK = "__funcshard_tensor__"
PREFIX = "extra/"
_SCALARS = (bool, int, float, str, type(None))


def split(extra: Any, caller: str = "funcshard.checkpoint.save") -> tuple[Any, dict[str, Tensor]]:
    """`extra` with each tensor replaced by its marker, and the tensors by stored key.
    Raises TypeError naming the first value that is neither JSON nor a tensor."""
    tensors: dict[str, Tensor] = {}

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, Tensor):
            key = f"{PREFIX}{len(tensors)}"
            tensors[key] = value.detach()
            return {MARK: key}
        if isinstance(value, dict):
            if MARK in value:
                raise ValueError(f"{caller}: {where} uses the key {MARK!r}, which is reserved.")
            return {_key(k, where, caller): walk(v, f"{where}[{k!r}]") for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, _SCALARS):
            return value
        raise TypeError(
            f"{caller}: {where} is a {type(value).__module__}.{type(value).__qualname__}; "
            f"extra holds JSON values (numbers, strings, lists, dicts) and tensors, so "
            f"loading never unpickles. Convert it (e.g. a state_dict() of tensors and numbers)."
        )

    return walk(extra, "extra"), tensors


def _key(key: Any, where: str, caller: str) -> Any:
    if isinstance(key, _SCALARS):
        return key
    raise TypeError(
        f"{caller}: {where} has the key {key!r} ({type(key).__name__}); extra's dict keys are "
        f"strings or numbers (JSON's)."
    )


def keys(skeleton: Any) -> list[str]:
    """The stored keys of the tensors a saved `extra` refers to, in order."""
    found: list[str] = []
    _map(skeleton, lambda key: found.append(key))
    return found


def join(skeleton: Any, tensors: dict[str, Tensor | None]) -> Any:
    """The saved `extra` with its markers replaced by the tensors read (None where absent)."""
    return _map(skeleton, tensors.get)


def _map(value: Any, fn: Callable[[str], Any]) -> Any:
    if isinstance(value, dict):
        if set(value) == {MARK}:
            return fn(value[MARK])
        return {k: _map(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map(v, fn) for v in value]
    return value
