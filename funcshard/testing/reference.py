"""The reference `fs.testing.check` compares sharded training with: one plain process.

It starts from `fs.unshard` of the sharded run's first state (never a second `make_model()`,
whose initialization could differ) and trains with plain PyTorch: `fs.call` on a params dict
(torch.func.functional_call underneath), `loss.backward()` and the `torch.optim` optimizer
that funcshard's own follows. A model with batch statistics (BatchNorm) runs each rank's
micro-batch on its own and averages the gradients, as data parallelism without
SyncBatchNorm does, and keeps each rank's buffers (running statistics) apart.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from funcshard.testing.harness import ADAMW_EPS, Case, Config, call, global_batch, split


def torch_optimizer(case: Case, params: list[Tensor]) -> torch.optim.Optimizer:
    """The torch.optim optimizer that `harness.optimizer(case)` follows."""
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=case.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=case.lr, eps=ADAMW_EPS, weight_decay=0.01)


def reference(
    case: Case,
    model: nn.Module,
    config: Config,
    batch_stats: bool,
    full: dict[str, Tensor],
    buffers: dict[str, Tensor],
) -> dict[str, Any]:
    """Train `case.steps` steps in this process from `full` and `buffers`; return the losses
    (the global batch's mean), the final parameters and the buffers (one dict per simulated
    rank with `batch_stats`, else one)."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    params = {k: v.detach().clone().requires_grad_(k in trainable) for k, v in full.items()}
    opt = torch_optimizer(case, [p for p in params.values() if p.requires_grad])
    parts = config.world if batch_stats else 1
    rank_buffers = [dict(buffers) for _ in range(parts)]
    losses = []
    for step in range(case.steps):
        inputs, targets = global_batch(case, config, step)
        opt.zero_grad()
        total = 0.0
        for i in range(parts):
            out, new = call(
                model, params, split(inputs, i, parts), buffers=rank_buffers[i], mutable=True
            )
            loss = case.loss_fn(out, split(targets, i, parts)) / parts
            loss.backward()
            total += loss.item()
            rank_buffers[i] = {k: v.detach() for k, v in new.items()}
        opt.step()
        losses.append(total)
    final = {k: v.detach() for k, v in params.items()}
    first = {k: v.detach().clone() for k, v in full.items()}
    return {"losses": losses, "first": first, "final": final, "buffers": rank_buffers}
