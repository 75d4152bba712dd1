"""Gradient clipping: scale the gradients so their global norm (L2, L1 or max) stays under a
bound, as `torch.nn.utils.clip_grad_norm_`.
"""

from __future__ import annotations

from typing import Any

import torch

from funcshard.optim._base import EmptyState, Optimizer
from funcshard.optim._params import _grad_leaves, _like
from funcshard.optim._rates import _check_rates
from funcshard.step._metrics import checked_norm_type, global_norm


def clip_by_global_norm(max_norm: float, norm_type: float = 2.0) -> Optimizer:
    """Scale gradients so their global norm is at most `max_norm`, as
    `torch.nn.utils.clip_grad_norm_(..., norm_type)` for `norm_type` 1, 2 (the default) or
    inf. Communicates: one all-reduce of one number over the shard axis (a max for inf;
    replicas hold identical shards)."""
    _check_rates("clip_by_global_norm", 0.0, max_norm=max_norm)
    norm_type = checked_norm_type(norm_type, "optim.clip_by_global_norm")

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(
        grads: Any, state: EmptyState, params: Any, donate: bool = False
    ) -> tuple[Any, EmptyState]:
        leaves = _grad_leaves(grads)
        present = [g for g in leaves if g is not None]
        if not present:
            return grads, state
        scale = torch.clamp(max_norm / (global_norm(grads, norm_type) + 1e-6), max=1.0)
        scaled = [
            None if g is None else (g.mul_(scale.to(g.dtype)) if donate else g * scale.to(g.dtype))
            for g in leaves
        ]
        return _like(grads, scaled, donate), state

    return Optimizer(init, update)
