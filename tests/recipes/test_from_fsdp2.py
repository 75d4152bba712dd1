"""Scenarios of PyTorch's FSDP2 unit tests (test/distributed/_composable/fsdp/), each named
after the test it answers, written with funcshard's API and checked against the same
single-process arithmetic at FSDP2's tolerances.
"""

import copy
import functools

import torch
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.comm._collectives import fp16_divisors

WORLD = 2


def _mlps() -> nn.Sequential:
    torch.manual_seed(42)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(3)]
    )


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(43 + rank)).half()


SCALE = 2e-4  # the loss's: many gradient elements then sit among fp16's subnormals, where a
# mean's rounding depends on when it divides (Adam's updates do not depend on the scale)


def _fp16_training(rank: int) -> dict[str, torch.Tensor]:
    model = _mlps()
    plan = fs.plan(model, policy=lambda module, name, numel: name in {"0", "1", "2"})
    state = fs.shard(
        model, plan, fs.Mesh(shard=WORLD), mp=fs.MixedPrecision(param_dtype=torch.float16)
    )
    opt = fs.optim.adam(1e-2)
    opt_state, x = opt.init(state), _inputs(rank)
    grad_fn = fs.value_and_grad(lambda state, x: fs.call(model, state, x).sum() * SCALE)
    for _ in range(10):
        _, grads = grad_fn(state, x)
        state, opt_state = opt.step(grads, opt_state, state)
    return fs.unshard(state)


def _reference_fp16_training() -> dict[str, torch.Tensor]:
    """FSDP2's reference: fp32 master weights and torch.optim.Adam, an fp16 copy computing
    each rank's gradient, their fp16 mean divided before and after the sum."""
    model = _mlps()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before, after = fp16_divisors(WORLD)
    for _ in range(10):
        grads = []
        for rank in range(WORLD):
            half = copy.deepcopy(model).half()
            (half(_inputs(rank)).sum() * SCALE).backward()
            grads.append([p.grad / before for p in half.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads, strict=True):
            p.grad = (functools.reduce(torch.add, per_rank) / after).float()
        opt.step()
    return dict(model.named_parameters())


def test_compute_dtype_fp16_means_divide_before_and_after_the_sum():
    """test_fully_shard_mixed_precision.py::test_compute_dtype, fp16 (bf16 and fp32 means
    are one "avg" reduction, as before)."""
    expected = _reference_fp16_training()
    for params in testing.run(_fp16_training, world_size=WORLD):
        for name, p in params.items():
            torch.testing.assert_close(p, expected[name].detach(), rtol=1.3e-6, atol=1e-5)
