"""The recipe axes of a configuration: the features real training steps combine, applied the
same way to the sharded run and to the one-process reference.

[Note: recipes compose]
Each feature of a training step works alone; real recipes combine them (LoRA beside a frozen
base with activation checkpointing, a compiled step that clips, accumulation with a user
`Comm`). So a `Config` carries, beside its mesh and precision, a switch per feature, and the
same helpers turn each switch on for the sharded run and for the reference:

- `checkpointing`: the forward of every other block (the first `ModuleList`'s children 0,
  2, ...) runs under `torch.utils.checkpoint` (non-reentrant), as transformers'
  `gradient_checkpointing_enable` wraps its layers: recomputed in backward.
- `frozen`: in each block, the parameters of its first `nn.Linear` (LoRA's frozen base)
  stop requiring grad, and the plan gives them flat buffers of their own
  (`plan(frozen="split")`); the reference leaves them out of its optimizer.
- `compiled`: the whole step through `fs.compile` (the case's backend).
- `clip`: `clip_by_global_norm(CLIP)` chained before the optimizer; the reference calls
  `torch.nn.utils.clip_grad_norm_`.
- `micro_batches`: each rank's batch in that many micro-batches, their local gradients
  summed by `fs.accumulate` and reduced once, each loss divided by their number (the
  reference takes the whole batch at once: a mean of means is the mean).
- `groups`: two parameter groups by `fs.optim.partition` (matrices at the rate, the rest at
  half of it without weight decay); the reference gives torch.optim the same two groups.
- `schedule`: the rate times `warmup(step)`, the reference's `LambdaLR(opt, warmup)`.
- `comm`: a user `fs.Comm` whose gather and reduce are the mesh axis's own all-gather and
  mean reduce-scatter (the same numbers as funcshard's, through the user path).
- `owned`: `plan(placement=...)` puts each parameter whole on one rank of the shard axis in
  every unit within the owned bound, the others even (see [Note: owned placement] in
  funcshard/core/_placement.py); the reference is unchanged. Drawn on shard axes over 1.

The block structure is found, not declared (`blocks`): a model without a `ModuleList`
checkpoints and freezes nothing, and its configurations are the plain ones.

Refused by design, each with an error that names the cause (so never drawn):
- a user `Comm` on a mesh whose shard axis has one rank (DDP, HSDP R x 1): its gather and
  reduce would never run (ValueError; tests/comm/test_comm.py);
- `fs.compile(..., fullgraph=True)` of a step whose checkpointed blocks torch cannot
  recompute inside one graph (random ops, attention): ValueError naming the modules
  (tests/compiling/test_compile_recipes.py). Without `fullgraph` such a step compiles with one
  graph break and equals eager, which is what `compiled` draws.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from funcshard.comm._comm import Comm, MeshAxis
from funcshard.optim._base import Optimizer
from funcshard.optim._clipping import clip_by_global_norm
from funcshard.optim._combinators import chain
from funcshard.optim._kernels import adamw, sgd
from funcshard.optim._partition import partition

CLIP = 0.05  # small enough that a step's gradients are clipped, so clipping is checked
WARMUP_STEPS = 3


@dataclass(frozen=True)
class Axes:
    """Which recipe axes a strategy of configurations draws (see [Note: recipes compose])."""

    checkpointing: bool = True
    frozen: bool = True
    compiled: bool = True
    clip: bool = True
    micro_batches: bool = True
    groups: bool = True
    schedule: bool = True
    comm: bool = True
    owned: bool = True

    @classmethod
    def none(cls) -> Axes:
        return cls(**{f.name: False for f in dataclasses.fields(cls)})


def warmup(step: int) -> float:
    """The schedule's factor at a 0-based update count: 1/3, 2/3, 1, 1, ..."""
    return min(1.0, (step + 1) / WARMUP_STEPS)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the model's first non-empty ModuleList (transformer blocks)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module):
            return list(module)
    return []


def prepare(model: nn.Module, checkpointing: bool, frozen: bool) -> nn.Module:
    """Freeze and checkpoint `model`'s blocks as the switches say (on the model itself:
    a meta model is prepared before `shard` materializes it)."""
    found = blocks(model)
    if frozen:
        trainable = [p for p in model.parameters() if p.requires_grad]
        bases = [_first_linear(b) for b in found]
        chosen = [p for base in bases if base is not None for p in base.parameters()]
        if len({id(p) for p in chosen}) < len({id(p) for p in trainable}):  # keep one trainable
            for p in chosen:
                p.requires_grad_(False)
    if checkpointing:
        for block in found[::2]:
            block.forward = functools.partial(_checkpointed, block.forward)
    return model


def _first_linear(block: nn.Module) -> nn.Linear | None:
    return next((m for m in block.modules() if isinstance(m, nn.Linear)), None)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`forward(*args, **kwargs)`, recomputed in backward (a partial of this function is
    a block's forward: `copy.deepcopy` rebinds the forward to the copy, a closure would not)."""
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def is_matrix(fqn: str, param: Tensor) -> bool:
    """The first parameter group: weights of two or more dims."""
    return param.dim() >= 2


def _group_label(fqn: str, param: Tensor) -> str:
    return "matrices" if is_matrix(fqn, param) else "others"


def _scaled(rate: float, step: int) -> float:
    return rate * warmup(step)


OptimizerChoice = str | Callable[[], Optimizer]  # "adamw", "sgd" or a user's factory


def optimizer(
    name: OptimizerChoice, lr: float, eps: float, groups: bool, schedule: bool, clip: bool
) -> Optimizer:
    """funcshard's optimizer for a configuration: AdamW (weight decay 0.01, `eps`) or SGD
    (momentum 0.9), in two groups, on a schedule and after clipping as the switches say; or
    a user's factory's optimizer, after clipping (its groups and rates are its own: `check`
    draws neither switch for it)."""
    if callable(name):
        made = name()
        return chain(clip_by_global_norm(CLIP), made) if clip else made

    def one(rate: float, weight_decay: float) -> Optimizer:
        lr_of = functools.partial(_scaled, rate) if schedule else rate
        if name == "sgd":
            return sgd(lr_of, momentum=0.9, weight_decay=weight_decay)
        return adamw(lr_of, eps=eps, weight_decay=weight_decay)

    decay = 0.0 if name == "sgd" else 0.01
    opt = one(lr, decay)
    if groups:
        opt = partition({"matrices": opt, "others": one(lr / 2, 0.0)}, _group_label)
    return chain(clip_by_global_norm(CLIP), opt) if clip else opt


@dataclass
class TorchOptimizer:
    """The torch.optim side of `optimizer`: the optimizer, its schedule and the clipping."""

    opt: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR | None
    clipped: Sequence[Tensor] | None

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        if self.clipped is not None:
            torch.nn.utils.clip_grad_norm_(self.clipped, CLIP)
        self.opt.step()
        if self.scheduler is not None:
            self.scheduler.step()


def torch_optimizer(
    name: str,
    lr: float,
    eps: float,
    params: dict[str, Tensor],
    groups: bool,
    schedule: bool,
    clip: bool,
) -> TorchOptimizer:
    """torch.optim's optimizer that `optimizer(...)` follows, over the trainable `params`."""
    decay = 0.0 if name == "sgd" else 0.01
    trainable = {k: p for k, p in params.items() if p.requires_grad}
    if groups:
        matrices = [p for k, p in trainable.items() if is_matrix(k, p)]
        others = [p for k, p in trainable.items() if not is_matrix(k, p)]
        param_groups: list[dict[str, Any]] = [
            {"params": matrices, "weight_decay": decay},
            {"params": others, "lr": lr / 2, "weight_decay": 0.0},
        ]
    else:
        param_groups = [{"params": list(trainable.values()), "weight_decay": decay}]
    param_groups = [g for g in param_groups if g["params"]]
    if name == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(param_groups, lr=lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(param_groups, lr=lr, eps=eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup) if schedule else None
    return TorchOptimizer(opt, scheduler, list(trainable.values()) if clip else None)


def _user_gather(shard: Tensor, axis: MeshAxis) -> Tensor:
    return axis.all_gather(shard)


def _user_reduce(full: Tensor, axis: MeshAxis) -> Tensor:
    return axis.reduce_scatter(full, "avg")


USER_COMM = Comm(gather=_user_gather, reduce=_user_reduce)
