"""torch.compile of value_and_grad, fuzzed: for a random module tree, plan and mesh, the
compiled gradient step is one graph and computes what the eager step computes.

Each drawn case compiles a step on every rank, so CI draws `EXAMPLES` (3) of them;
`HYPOTHESIS_PROFILE=long` (`bash scripts/stress.sh 1 0 property_tests/compiling`) draws 50."""

import functools
import os
import warnings

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard import testing
from funcshard.testing import strategies
from funcshard.testing.compare import assert_trees_close
from funcshard.testing.dynamo import isolated

EXAMPLES = 50 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 3


def _loss(model, state, x, target):
    return (fs.call(model, state, x) - target).square().mean()


@isolated()
def _compiled_and_eager(case, mesh_shape, seed: int, rank: int) -> tuple:
    model = case.spec.build().eval()  # eval: BatchNorm uses its running stats
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frozen and trainable mixed in a unit only warn
        plan = fs.plan(model, **case.kwargs(model))
    state = fs.shard(model, plan, mesh_shape.build())
    x = case.spec.example_input(2, seed=seed + rank)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed - rank))
    step = fs.value_and_grad(functools.partial(_loss, model))
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(state, x, target)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    return compiled, step(state, x, target), breaks


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    case=strategies.plans(),
    mesh=strategies.meshes(world_sizes=(2, 4)),
    seed=st.integers(1, 2**20),
)
def test_a_compiled_gradient_step_equals_the_eager_one(case, mesh, seed):
    results = testing.run(
        functools.partial(_compiled_and_eager, case, mesh, seed), mesh.world_size, timeout=240
    )
    for compiled, eager, breaks in results:
        assert breaks == {}
        assert_trees_close(compiled, eager)
