"""Gradient clipping: scale the gradients so their global L2 norm stays under a bound, as
`torch.nn.utils.clip_grad_norm_`.
"""

from __future__ import annotations

from typing import Any

import torch

from funcshard.optim._base import EmptyState, Optimizer
from funcshard.optim._params import _grad_leaves, _like
from funcshard.optim._rates import _check_rates
from funcshard.step._metrics import global_norm


def clip_by_global_norm(max_norm: float) -> Optimizer:
    """Scale gradients so their global L2 norm is at most `max_norm`, as
    `torch.nn.utils.clip_grad_norm_`. Communicates: one all-reduce of the squared norm over
    the shard axis (replicas hold identical shards)."""
    _check_rates("clip_by_global_norm", 0.0, max_norm=max_norm)

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(
        grads: Any, state: EmptyState, params: Any, donate: bool = False
    ) -> tuple[Any, EmptyState]:
        leaves = _grad_leaves(grads)
        present = [g for g in leaves if g is not None]
        if not present:
            return grads, state
        scale = torch.clamp(max_norm / (global_norm(grads) + 1e-6), max=1.0)
        scaled = [
            None if g is None else (g.mul_(scale.to(g.dtype)) if donate else g * scale.to(g.dtype))
            for g in leaves
        ]
        return _like(grads, scaled, donate), state

    return Optimizer(init, update)
