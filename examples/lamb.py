"""LAMB (You et al., 2019) written as a funcshard user writes an optimizer: a pure
`(init, update)` pair over the optimizer's leaves, with per-parameter trust ratios computed on
flat shards through `fs.optim.segments` (which parameter owns which elements of a shard, and
sums over whole parameters across the shard axis). On one process, on FSDP, HSDP or DDP it
takes the same steps: tests/optim/test_lamb.py checks it against a one-process LAMB.

    python examples/lamb.py      # a few steps of a small GPT on 2 local ranks
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import funcshard as fs


@dataclass
class LambState:
    step: Tensor
    exp_avg: list
    exp_avg_sq: list


torch.utils._pytree.register_dataclass(LambState)  # so checkpoints save it whole


def lamb(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.01,
) -> fs.optim.Optimizer:
    b1, b2 = betas

    def init(params) -> LambState:
        zeros = fs.tree_map(torch.zeros_like, fs.optim.leaves(params))
        return LambState(torch.zeros(()), zeros, list(zeros))

    def update(grads, state: LambState, params):
        step = state.step + 1
        m = fs.tree_map(lambda m, g: m.lerp(g, 1 - b1), state.exp_avg, grads)
        v = fs.tree_map(
            lambda v, g: v.mul(b2).addcmul_(g, g, value=1 - b2), state.exp_avg_sq, grads
        )
        c1, c2 = 1 - b1**step, 1 - b2**step
        p = fs.optim.leaves(params)
        r = fs.tree_map(
            lambda m, v, p: m / c1 / ((v / c2).sqrt() + eps) + weight_decay * p, m, v, p
        )
        # per parameter, over all of it: a shard holds pieces of several, each maybe split
        segments = fs.optim.segments(params)
        w_norm = segments.sum(fs.tree_map(torch.square, p))
        r_norm = segments.sum(fs.tree_map(torch.square, r))
        trust = fs.tree_map(
            lambda w, r: torch.where((w > 0) & (r > 0), (w / r).sqrt(), 1.0), w_norm, r_norm
        )
        updates = fs.tree_map(lambda g, t, r: -lr * t * r, grads, segments.expand(trust), r)
        return updates, LambState(step, m, v)

    return fs.optim.Optimizer(init, update)


def _train(rank: int) -> float:
    import torch.nn.functional as F

    from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=2)
    )
    opt = lamb(lr=1e-2)
    opt_state = opt.init(state)
    for step in range(5):
        x, y = random_tokens(model.cfg, 2, seed=10 * step + rank)
        loss, grads = fs.value_and_grad(
            lambda s, x, y: F.cross_entropy(fs.call(model, s, x).flatten(0, 1), y.flatten())
        )(state, x, y)
        state, opt_state = opt.step(grads, opt_state, state)
    return fs.pmean(loss, state.layout.mesh).item()


if __name__ == "__main__":
    print(f"loss after 5 LAMB steps: {fs.testing.run(_train, world_size=2)[0]:.4f}")
