"""Compare two results of a step (states, grads, losses: any pytree of tensors)."""

from __future__ import annotations

from typing import Any

import torch


def assert_trees_close(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Raise unless `a` and `b` have one tree structure (None where the other has None; funcshard
    records are pytrees) and every pair of leaves is close."""
    (leaves_a, spec_a), (leaves_b, spec_b) = map(torch.utils._pytree.tree_flatten, (a, b))
    assert spec_a == spec_b, f"different structures:\n{spec_a}\n{spec_b}"
    for x, y in zip(leaves_a, leaves_b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)
