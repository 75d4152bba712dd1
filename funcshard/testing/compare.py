"""Compare two results of a step (states, grads, losses: any pytree of tensors).

A failure names the leaf by its pytree path (`['blocks.0.weight']`, `.shards[3]`), the
element that misses its tolerance by the most, and both values there, so that a failing
comparison of two whole states says where to look without a debugger.
"""

from __future__ import annotations

from typing import Any

import optree
import torch


def assert_trees_close(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Raise AssertionError unless `a` and `b` have one tree structure and close leaves.

    Structures compare as optree does: dicts by their keys in any order (as `==` does),
    OrderedDicts and sequences in order, None only where the other has None; funcshard
    records are pytrees. Leaves compare as `torch.testing.assert_close` does (shape, dtype,
    `|a - b| <= atol + rtol * |b|`), and a failure names the leaf's path, the worst index and
    both values there.
    """
    paths_a, leaves_a, spec_a = optree.tree_flatten_with_accessor(a)
    paths_b, leaves_b, spec_b = optree.tree_flatten_with_accessor(b)
    if spec_a != spec_b:
        raise AssertionError(_structure_difference(paths_a, spec_a, paths_b, spec_b))
    for path, x, y in zip(paths_a, leaves_a, leaves_b, strict=True):
        try:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)
        except AssertionError as e:
            leaf = f"leaf {path.codify('')}" if len(path) else "the root leaf"
            raise AssertionError(
                f"assert_trees_close: {leaf} differs{_worst(x, y, rtol, atol) or f': {e}'}"
            ) from e


def _structure_difference(
    paths_a: list[optree.PyTreeAccessor],
    spec_a: optree.PyTreeSpec,
    paths_b: list[optree.PyTreeAccessor],
    spec_b: optree.PyTreeSpec,
) -> str:
    """Name the leaves one tree has and the other lacks, or else show both structures."""
    names_a = [p.codify("") for p in paths_a]
    names_b = [p.codify("") for p in paths_b]
    set_a, set_b = set(names_a), set(names_b)
    only_a = [n for n in names_a if n not in set_b]
    only_b = [n for n in names_b if n not in set_a]
    if only_a or only_b:
        return (
            f"assert_trees_close: the trees have different leaves: only a has "
            f"{_listed(only_a)}; only b has {_listed(only_b)}."
        )
    return f"assert_trees_close: the trees have different structures:\na: {spec_a}\nb: {spec_b}"


def _listed(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "none"


def _worst(x: Any, y: Any, rtol: float, atol: float) -> str:
    """Where two leaves of one shape and dtype miss their tolerance by the most, and both
    values there; "" for leaves that differ otherwise (torch's message says how)."""
    try:
        x, y = torch.as_tensor(x).detach().cpu(), torch.as_tensor(y).detach().cpu()
    except (TypeError, ValueError, RuntimeError):  # not numbers: torch's message suffices
        return ""
    if x.shape != y.shape or x.dtype != y.dtype or x.numel() == 0:
        return ""
    wide = torch.complex128 if x.is_complex() else torch.float64
    x64, y64 = x.reshape(-1).to(wide), y.reshape(-1).to(wide)
    allowed = atol + rtol * y64.abs()
    excess = (x64 - y64).abs() - allowed  # beyond the tolerance; NaN where either is NaN
    excess = torch.where(x64 == y64, -torch.inf, excess)  # equal infinities are close
    excess = torch.nan_to_num(excess, nan=torch.inf)
    i = int(excess.argmax())
    index = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), x.shape))
    where = f" at index {index}" if index else ""
    return (
        f"{where}: a has {x.reshape(-1)[i].item()!r}, b has {y.reshape(-1)[i].item()!r} "
        f"(|a - b| {(x64[i] - y64[i]).abs().item():.3g}, allowed {allowed[i].item():.3g}); "
        f"{int((excess > 0).sum())} of {x.numel()} elements are not close "
        f"(rtol={rtol:g}, atol={atol:g})."
    )
