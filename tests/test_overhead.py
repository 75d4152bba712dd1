"""funcshard's own work per unit depends on the unit layout only, not on the model's class.

The overhead benchmark (benchmarks/overhead_matrix.py) times MLP and GPT blocks; nothing in
funcshard may be tuned to them. Two model classes written differently (modules vs bare
parameters and functional calls) with the same unit layout must cost funcshard the same
ops and the same collectives per unit of a step.
"""

import collections
import contextlib
import functools
import gc

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard as fs
from funcshard import collectives, testing
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
        # kept for backward), its reduce-scatter
        assert modules["collectives"] == {"all_gather": 2 * n - 1, "reduce_scatter": n}
    assert sum(modules["ops"].values()) > 0  # the count sees funcshard's own ops


def _collector_during_a_step(rank: int) -> dict:
    """Whether the garbage collector is enabled in the forward and the backward of a
    resharding step, after it, after a step that raised, and when the caller disabled it."""
    torch.manual_seed(0)
    model = MLPStack(MLPStackConfig(d_model=D, n_layer=4))
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({MLPBlock})), fs.Mesh(shard=2)
    )
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(rank))
    seen = []

    def loss(s: fs.ShardedState) -> torch.Tensor:
        out = fs.call(model, s, x)
        seen.append(("forward", gc.isenabled()))
        out.register_hook(lambda g: seen.append(("backward", gc.isenabled())))
        return out.square().mean()

    grad_fn = fs.value_and_grad(loss)
    try:
        grad_fn(state)
        after = gc.isenabled()
        with contextlib.suppress(ZeroDivisionError):
            fs.value_and_grad(lambda s: 1 / 0)(state)
        after_error = gc.isenabled()
        gc.disable()  # the caller's own choice is kept
        grad_fn(state)
        kept_disabled = not gc.isenabled()
    finally:
        gc.enable()
    return {"inside": seen[:2], "after": (after, after_error, kept_disabled)}


def test_the_collector_is_paused_through_forward_and_backward_and_restored():
    """The Python objects of a resharded call's saved tensors live from forward to backward,
    so the collector is paused meanwhile (see [Note: no garbage collection inside a step])."""
    for result in testing.run(_collector_during_a_step):
        assert result["inside"] == [("forward", False), ("backward", False)], result
        assert result["after"] == (True, True, True), result
