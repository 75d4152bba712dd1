"""The testing toolkit (issue 26, item 8): unshard's key order, assert_trees_close's report,
fs.testing's submodules, the laws of strategies.modules(), and a quiet exit after fresh runs."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as torch_pytree
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.testing import strategies
from funcshard.testing.compare import assert_trees_close
from funcshard.testing.models import GPT, Block

ROOT = Path(__file__).resolve().parents[2]


# -- fs.unshard keeps the model's named_parameters order ------------------------------------


class MixedRoot(nn.Module):
    """Root parameters around a child unit, one of them bf16: the root unit (last in plan
    order) splits into two flat buffers, and the child's unit comes first."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.randn(3))
        self.body = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.gate = nn.Parameter(torch.randn(2).to(torch.bfloat16))
        self.head = nn.Linear(4, 2)


def _unshard_order(case: str, rank: int) -> tuple[list[str], list[str], list[str], bool]:
    torch.manual_seed(0)
    if case == "blocks, ignored in the middle":
        model = GPT()
        plan = fs.plan(model, policy=fs.policy.module_classes({Block}), ignored=["blocks.0.ln2"])
    elif case == "buckets, in reverse":
        model = GPT()
        plan = fs.plan(model, policy=fs.policy.buckets(bucket_mb=0.01, first_bucket_mb=0.01))
    else:
        model = MixedRoot()
        plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    params, _ = fs.extract(model)
    full = fs.unshard(state)
    some = fs.unshard_async(state, units=[u.name for u in plan.units[::2]]).wait()
    same_spec = torch_pytree.tree_structure(full) == torch_pytree.tree_structure(params)
    return list(full), list(some), list(params), same_spec


@pytest.mark.parametrize(
    "case", ["blocks, ignored in the middle", "buckets, in reverse", "bf16 at the root"]
)
def test_unshard_lists_parameters_in_named_parameters_order_replicated_ones_in_place(case):
    """Regression: unshard listed them unit by unit (children's units before the root's,
    replicated ones last), so equal results compared as different torch pytrees."""
    for full, some, names, same_spec in testing.run(functools.partial(_unshard_order, case), 2):
        assert full == names
        assert some == [n for n in names if n in some]  # a subset keeps the order too
        assert same_spec


# -- assert_trees_close names the leaf path, the worst index and both values ---------------


def test_assert_trees_close_names_the_leaf_path_the_worst_index_and_both_values():
    """Regression: a failure quoted torch's message alone, which names no leaf and shows
    neither value. The worst element is the one furthest beyond its tolerance: (0, 1), not
    (0, 0), whose difference is larger but within rtol."""
    a = {"opt": [torch.zeros(2), torch.tensor([[100.0, 0.0], [1.0, 1.0]])]}
    b = {"opt": [torch.zeros(2), torch.tensor([[100.5, 0.25], [1.0, 1.0]])]}
    with pytest.raises(AssertionError) as info:
        assert_trees_close(a, b, rtol=1e-2, atol=0.0)
    message = str(info.value)
    assert "leaf ['opt'][1] differs at index (0, 1): a has 0.0, b has 0.25" in message
    assert "1 of 4 elements are not close" in message


def test_assert_trees_close_accepts_equal_dicts_whose_keys_come_in_another_order():
    """Regression: dicts with the same items in another order were "different structures"."""
    a = {"w": torch.ones(2), "b": torch.zeros(())}
    assert_trees_close(a, {"b": torch.zeros(()), "w": torch.ones(2)})


def test_assert_trees_close_names_the_leaves_only_one_tree_has():
    with pytest.raises(AssertionError, match=r"only a has \['b'\]; only b has \['c'\]"):
        assert_trees_close({"a": torch.ones(1), "b": 1.0}, {"a": torch.ones(1), "c": 1.0})


# -- the testing submodules are attributes of fs.testing: checked by the fresh-run script ----
# (test_a_fresh_run_leaves_no_semaphores_to_the_resource_tracker, below), whose interpreter has
# imported nothing of funcshard before its first line, as this test process has.


# -- strategies.modules(): its laws and options --------------------------------------------


@settings(max_examples=30, deadline=None)
@given(spec=strategies.modules())
def test_a_drawn_tree_builds_the_same_module_anywhere_mapping_batch_by_width(spec):
    first, second = spec.build(), spec.build()
    for (name, a), (_, b) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    params = list(first.parameters())
    assert params and all(p.dtype == torch.float32 for p in params)
    assert first(spec.example_input(batch=3)).shape == (3, spec.width)


@settings(max_examples=30, deadline=None)
@given(spec=strategies.modules(batch_stats=False))
def test_without_batch_stats_a_tree_is_pure_and_per_row_in_train_mode(spec):
    model = spec.build().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = spec.example_input(batch=4, seed=1)
    out = model(x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    rows = torch.cat([model(x[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(out, rows, rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    spec=strategies.modules(frozen_mixes=False),
    policy=st.sampled_from(
        [
            None,
            fs.policy.size(1),
            fs.policy.module_classes({nn.Linear}),
            fs.policy.module_classes({strategies.Stack, strategies.Residual}),
            fs.policy.buckets(bucket_mb=1e-4, first_bucket_mb=1e-4),
        ]
    ),
)
def test_without_frozen_mixes_plan_accepts_a_tree_under_any_policy(spec, policy):
    model = spec.build()
    assert len({p.requires_grad for p in model.parameters()}) == 1
    fs.plan(model, policy=policy)  # frozen="error" by default


def test_by_default_trees_hold_batch_stats_and_frozen_mixes():
    """The options narrow the default draws, which keep both (plans() and the split
    properties rely on them)."""
    from hypothesis import find

    find(strategies.modules(), lambda s: "batchnorm" in repr(s.tree))
    mixed = find(
        strategies.modules(),
        lambda s: len({p.requires_grad for p in s.build().parameters()}) == 2,
    )
    assert mixed


# -- no resource-tracker warnings at exit --------------------------------------------------

_SCRIPT = """
import multiprocessing
import sys

import funcshard as fs
from funcshard import testing

KEEP = []


def submodules_are_attributes():
    # regression: fs.testing.strategies (and .compare, .models, .memory, .dynamo) raised
    # AttributeError until imported explicitly; hypothesis stays unimported until strategies
    # is used
    assert "hypothesis" not in sys.modules
    fs.testing.compare.assert_trees_close, fs.testing.models.GPT
    fs.testing.memory.LiveTensors, fs.testing.dynamo.isolated
    fs.testing.strategies.modules
    assert {"compare", "dynamo", "memory", "models", "strategies"} <= set(dir(fs.testing))
    print("submodules are attributes")


def locks_then(outcome, rank):
    # torch.compile's compile workers make semaphores like this one in a rank
    KEEP.append(multiprocessing.get_context("spawn").Lock())
    if outcome == "raises":
        raise ValueError("on purpose")
    return rank


if __name__ == "__main__":
    import functools

    submodules_are_attributes()
    for outcome in sys.argv[1:]:
        try:
            print(testing.run(functools.partial(locks_then, outcome), 2, fresh=True))
        except ValueError:
            print("raised")
"""


def test_a_fresh_run_leaves_no_semaphores_to_the_resource_tracker(tmp_path):
    """Regression: fresh ranks were killed, so what they had registered with multiprocessing's
    resource tracker stayed there, and it warned of "leaked semaphore objects" at exit. One
    script runs both outcomes (a function that returns, then one that raises) on fresh ranks
    each: the tracker warns at the script's exit for either (one launch, was one each).

    The same fresh interpreter first checks that every fs.testing submodule is an attribute
    after `import funcshard` and that hypothesis is not imported by it (was its own launch:
    test_every_testing_submodule_is_an_attribute_after_import_funcshard)."""
    script = tmp_path / "fresh_run.py"
    script.write_text(_SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, str(script), "returns", "raises"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = ["submodules are attributes", "[0, 1]", "raised"]
    assert out.stdout.splitlines() == lines, out.stdout
    assert "resource_tracker" not in out.stderr, out.stderr
