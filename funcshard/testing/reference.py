"""The reference `fs.testing.check` compares sharded training with: one plain process.

It starts from `fs.unshard` of the sharded run's first state (never a second `make_model()`,
whose initialization could differ) and trains with plain PyTorch: `fs.value_and_grad` of
`fs.call` on a params dict (torch.func.functional_call and autograd underneath; it
recomputes checkpointed blocks with the dict's tensors) and the `torch.optim` optimizer
that funcshard's own follows, with the configuration's parameter groups, schedule and
clipping (recipe.py); or, for a user's optimizer factory, that same funcshard optimizer on
the params dict, where each leaf is one whole parameter (so per-parameter math written per
leaf is right here, and parity catches it when it is wrong on flat shards). A model with
batch statistics (BatchNorm) runs each rank's
micro-batch on its own and averages the gradients, as data parallelism without
SyncBatchNorm does, and keeps each rank's buffers (running statistics) apart (so does a
mixed-precision run: each micro-batch's gradient is rounded in the low dtype); with
accumulation, each step runs as many micro-batches as each rank does, a rank's buffers
threaded through its own. With mixed precision it computes as the sharded run does: in the
low dtype, on a low-precision copy of fp32 master parameters (DDP's compressed all-reduce
computes in fp32).
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor, nn

from funcshard.optim._params import apply_updates
from funcshard.step._autodiff import value_and_grad
from funcshard.testing import recipe
from funcshard.testing.harness import (
    ADAMW_EPS,
    MP,
    Case,
    Config,
    call,
    global_batch,
    optimizer,
    split,
)


def torch_optimizer(case: Case, config: Config, params: dict[str, Tensor]) -> Any:
    """The torch.optim optimizer that `harness.optimizer(case, config)` follows."""
    assert isinstance(case.optimizer, str)  # a user's factory has no torch.optim counterpart
    return recipe.torch_optimizer(
        case.optimizer, case.lr, ADAMW_EPS, params, config.groups, config.schedule, config.clip
    )


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
    step_with = _functional_step(case, config, params) if callable(case.optimizer) else None
    opt = torch_optimizer(case, config, params) if step_with is None else None
    low = MP[config.mp] if config.mp is not None and not config.ddp else None
    # as many forwards per step as each rank runs (a buffer may count them); the ranks'
    # own micro-batches where their grouping changes the numbers: batch statistics, or
    # low-precision compute (each micro-batch's gradient rounded in the low dtype)
    ranks = config.world if batch_stats or low is not None else 1
    micro = config.micro_batches
    rank_buffers = [dict(buffers) for _ in range(ranks)]
    losses = []
    for step in range(case.steps):
        inputs, targets = global_batch(case, config, step)
        summed: dict[str, Tensor | None] = {}
        total = 0.0
        for i in range(ranks * micro):
            rank = i // micro
            part = split(inputs, i, ranks * micro), split(targets, i, ranks * micro)
            grad_fn = value_and_grad(_loss, has_aux=True)  # recomputes checkpointed blocks
            (loss, new), grads = grad_fn(
                params, case, model, low, ranks * micro, rank_buffers[rank], *part
            )
            summed = {k: g if summed.get(k) is None else summed[k] + g for k, g in grads.items()}
            total += loss.item()
            rank_buffers[rank] = {k: v.detach() for k, v in new.items()}
        if step_with is not None:
            params = step_with(params, summed)
        else:
            _torch_step(opt, params, summed)
        losses.append(total)
    final = {k: v.detach() for k, v in params.items()}
    first = {k: v.detach().clone() for k, v in full.items()}
    return {"losses": losses, "first": first, "final": final, "buffers": rank_buffers}


def _torch_step(opt: Any, params: dict[str, Tensor], grads: dict[str, Tensor | None]) -> None:
    """One torch.optim step on `params` (in place) with `grads`."""
    opt.zero_grad()
    for k, g in grads.items():
        params[k].grad = g
    opt.step()


def _functional_step(case: Case, config: Config, params: dict[str, Tensor]) -> Any:
    """`(params, grads) -> new params`: the configuration's funcshard optimizer (a user's
    factory's) stepping a params dict, its state threaded from one call to the next."""
    opt = optimizer(case, config)
    state = [opt.init(params)]

    def step(params: dict[str, Tensor], grads: dict[str, Tensor | None]) -> dict[str, Tensor]:
        updates, state[0] = opt.update(grads, state[0], params)
        return apply_updates(params, updates)

    return step


def _loss(
    params: dict[str, Tensor],
    case: Case,
    model: nn.Module,
    low: torch.dtype | None,
    parts: int,
    buffers: dict[str, Tensor],
    inputs: Any,
    targets: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's share of the loss (computed in `low` if given), its new buffers."""
    out, new = call(model, _cast(params, low), _cast(inputs, low), buffers=buffers, mutable=True)
    out = _cast(out, torch.float32 if low is not None else None)
    return case.loss_fn(out, targets) / parts, new


def _cast(tree: Any, dtype: torch.dtype | None) -> Any:
    """The floating-point tensors of `tree` in `dtype` (differentiably), or `tree` for None."""
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x

    return optree.tree_map(cast, tree, none_is_leaf=False)
