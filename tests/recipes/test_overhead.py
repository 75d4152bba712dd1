"""funcshard's own work per unit depends on the unit layout only, not on the model's class.

The overhead benchmark (benchmarks/overhead_matrix.py) times MLP and GPT blocks; nothing in
funcshard may be tuned to them. Two model classes written differently (modules vs bare
parameters and functional calls) with the same unit layout must cost funcshard the same
ops and the same collectives per unit of a step.
"""

import collections
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard as fs
from funcshard import testing
from funcshard.comm import _collectives as collectives
from funcshard.testing.models import MLPBlock, MLPStack, MLPStackConfig

D = 8


class BareBlock(nn.Module):
    """An MLPBlock's parameters, as bare Parameters used through torch.nn.functional."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(D))
        self.b = nn.Parameter(torch.zeros(D))
        self.w_in = nn.Parameter(torch.randn(4 * D, D) / D**0.5)
        self.b_in = nn.Parameter(torch.zeros(4 * D))
        self.w_out = nn.Parameter(torch.randn(D, 4 * D) / (4 * D) ** 0.5)
        self.b_out = nn.Parameter(torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, (D,), self.g, self.b)
        return F.linear(F.relu(F.linear(h, self.w_in, self.b_in)), self.w_out, self.b_out)


class BareChain(nn.Sequential):
    def __init__(self, n: int) -> None:
        super().__init__(*(BareBlock() for _ in range(n)))


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _plain_ops(model: nn.Module, x: torch.Tensor) -> collections.Counter:
    params = list(model.parameters())
    with _CountOps() as counter:
        torch.autograd.grad(model(x).square().mean(), params)
    return counter.ops


def _work_per_unit(kind: str, n: int, rank: int) -> dict:
    torch.manual_seed(0)
    if kind == "modules":
        model, unit = MLPStack(MLPStackConfig(d_model=D, n_layer=n)), MLPBlock
    else:
        model, unit = BareChain(n), BareBlock
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({unit})), fs.Mesh(shard=2)
    )
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(rank))
    grad_fn = fs.value_and_grad(lambda s: fs.call(model, s, x).square().mean())
    grad_fn(state)  # warm: one-time work (bindings, specs) is not per step
    with collectives.record() as log, _CountOps() as counter:
        grad_fn(state)
    own = counter.ops.copy()
    own.subtract(_plain_ops(model, x))
    return {
        "layout": [flat.numel for flat in state.layout.flats],
        "ops": {op: count for op, count in own.items() if count},
        "collectives": collections.Counter(r.op for r in log),
    }


def test_a_step_costs_funcshard_the_same_ops_and_collectives_per_unit_whatever_the_model_class():
    for n in (2, 4):
        modules, bare = (
            testing.run(functools.partial(_work_per_unit, kind, n))[0]
            for kind in ("modules", "bare")
        )
        assert modules["layout"] == bare["layout"]  # the same units, the same flat buffers
        assert modules["ops"] == bare["ops"], (n, modules["ops"], bare["ops"])
        assert modules["collectives"] == bare["collectives"]
        # per unit: its all-gather, its regather in backward (not the unit forward ran last,
        # kept for backward), its reduce-scatter; and per step the non-finite verdict's
        assert modules["collectives"] == {"all_gather": 2 * n - 1 + 1, "reduce_scatter": n}
    assert sum(modules["ops"].values()) > 0  # the count sees funcshard's own ops
