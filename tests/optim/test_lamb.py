"""examples/lamb.py, a user-written LAMB with per-parameter trust ratios on flat shards, takes
the steps a one-process LAMB takes, sharded or on a plain dict."""

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
from funcshard.testing.compare import assert_trees_close
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from lamb import lamb

STEPS, LR, EPS, WD = 5, 1e-2, 1e-3, 0.01


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_tokens(GPTConfig(n_layer=2), 4, seed=step)


def _loss(model, params, x, y):
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _train(mesh: str, rank: int) -> dict:
    model = _model()
    world = 1 if mesh == "dict" else 2
    if mesh == "dict":
        params, _ = fs.extract(model)
    elif mesh == "ddp":
        params = fs.replicate(model, fs.Mesh(replicate=2), bucket_mb=0.01)
    else:
        policy = fs.policy.module_classes({Block})
        params = fs.shard(model, fs.plan(model, policy=policy), fs.Mesh(shard=2))
    opt = lamb(LR, eps=EPS, weight_decay=WD)
    opt_state = opt.init(params)
    for step in range(STEPS):
        x, y = _batch(step)
        mine = x.chunk(world)[rank], y.chunk(world)[rank]
        _, grads = fs.value_and_grad(functools.partial(_loss, model))(params, *mine)
        params, opt_state = opt.step(grads, opt_state, params)
    return params if mesh == "dict" else fs.unshard(params)


def _one_process_lamb() -> dict:
    """LAMB as its paper states it, one parameter at a time with torch.optim-style loops."""
    model = _model()
    b1, b2 = 0.9, 0.999
    moments = {f: (torch.zeros_like(p), torch.zeros_like(p)) for f, p in model.named_parameters()}
    for step in range(1, STEPS + 1):
        x, y = _batch(step - 1)
        model.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        with torch.no_grad():
            for f, p in model.named_parameters():
                m, v = moments[f]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                r = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + EPS) + WD * p
                w_norm, r_norm = p.norm(), r.norm()
                trust = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
                p.sub_(LR * trust * r)
    return {f: p.detach() for f, p in model.named_parameters()}


@pytest.mark.parametrize("mesh", ["fsdp", "ddp", "dict"])
def test_lamb_example_equals_one_process_lamb(mesh):
    """FSDP-2 (blocks' flat buffers split parameters across ranks), DDP-2 in small buckets,
    and a plain dict on one process."""
    world = 1 if mesh == "dict" else 2
    result = testing.run(functools.partial(_train, mesh), world_size=world)[0]
    assert_trees_close(dict(result), _one_process_lamb(), rtol=1e-5, atol=1e-6)
