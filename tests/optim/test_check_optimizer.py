"""`fs.testing.check(..., optimizer=factory)`: the laws with a user's own optimizer, whose
parity reference is the same optimizer on one process's params dict (testing/reference.py).

LARS with its trust ratio taken per leaf is right on a dict and wrong on flat shards: parity
catches it, naming a parameter; LARS through `fs.optim.segments` keeps every law. The
factories are tests/optim/test_optim_warnings.py's, module-level so the ranks unpickle them.
"""

import dataclasses
import functools

import pytest
import torch
from test_optim_warnings import lars, naive_lars
from torch import nn

import funcshard as fs
from funcshard.testing.recipe import Axes

# one mesh of two ranks, two steps, no recipe switches, one flat buffer of all four parameters
# (the root unit): the smallest check where LARS's leaves mix parameters split over ranks
ROOT = fs.policy.module_classes(set())
SMALL = {"world_sizes": (2,), "steps": 2, "recipes": False, "shrink_budget": 1, "policy": ROOT}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(4, 8, generator=g),), torch.randn(4, 4, generator=g)


def test_lars_taking_norms_per_leaf_breaks_parity_naming_a_parameter():
    with pytest.raises(fs.testing.LawViolation) as caught:
        fs.testing.check(mlp, batch, optimizer=naive_lars, examples=1, laws=("parity",), **SMALL)
    report = caught.value.report
    failed = [r for r in report.results if r.failed]
    assert failed and {r.law for r in failed} == {"parity"}
    assert any(
        f"at {name} on rank" in r.detail for r in failed for name, _ in mlp().named_parameters()
    )


def test_lars_through_segments_keeps_every_law_on_each_mesh_of_two_ranks():
    """FSDP-2 (parameters split over the ranks), HSDP 2x1 and DDP-2 (buffers and buckets that
    mix parameters): parity and every other law, the checkpoint of LARS's own state included."""
    report = fs.testing.check(mlp, batch, optimizer=lars, examples=3, **SMALL)
    assert report.ok, report.table()
    assert {c.mesh_name for c in report.configs} == {"fsdp 2", "hsdp 2x1", "ddp 2"}


def whole_params_lars() -> fs.optim.Optimizer:
    """The per-leaf LARS made right by running it on whole parameters, on their owners."""
    return fs.optim.whole_params(naive_lars())


def test_the_per_leaf_lars_through_whole_params_keeps_parity_and_checkpoints():
    """The same trust ratio per leaf, each leaf now one whole parameter on its owner rank;
    its Owned state saved at 2 ranks and loaded at 2 again; its uneven all-to-alls compared
    across ranks as the group's mean buffer."""
    report = fs.testing.check(mlp, batch, optimizer=whole_params_lars, examples=2, **SMALL)
    assert report.ok, report.table()
    assert "fsdp 2" in {c.mesh_name for c in report.configs}


def _closure_factory():
    def make():
        return lars()

    return make


def test_an_optimizer_factory_that_cannot_reach_the_ranks_is_refused_naming_the_fix():
    for factory in (lambda: lars(), _closure_factory()):
        with pytest.raises(TypeError, match=r"module-level function returning an fs\.optim"):
            fs.testing.check(mlp, batch, optimizer=factory, **SMALL)
    with pytest.raises(TypeError, match=r"must return an fs\.optim\.Optimizer, got int"):
        fs.testing.check(mlp, batch, optimizer=functools.partial(int, 3), **SMALL)
    with pytest.raises(ValueError, match="'adamw', 'sgd' or a module-level function"):
        fs.testing.check(mlp, batch, optimizer="lamb", **SMALL)


def test_the_check_command_takes_an_optimizer_factory_by_module_and_name():
    import argparse

    from funcshard.cli import _check_command as check_command

    parser = argparse.ArgumentParser()
    check_command.add_parser(parser.add_subparsers(dest="command"))
    argv = ["check", "test_check_optimizer:mlp", "--batch", "test_check_optimizer:batch"]
    chosen = check_command._options(
        parser.parse_args([*argv, "--optimizer", "test_optim_warnings:lars"])
    )
    assert chosen["optimizer"] is lars
    assert check_command._options(parser.parse_args(argv))["optimizer"] == "adamw"


class Stack(nn.Module):
    """Two blocks in a ModuleList: check's frozen axis freezes each block's first Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(2)
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stateless_sgd() -> fs.optim.Optimizer:
    """Plain SGD whose state is `()`: nothing to save but the empty tuple."""

    def update(grads, state, params, donate=False):
        return fs.tree_map(lambda g: -0.05 * g, grads), state

    return fs.optim.Optimizer(lambda params: (), update)


def _only(**on: bool) -> Axes:
    """Check's recipe axes with only `on` drawn."""
    return dataclasses.replace(Axes.none(), **on)


def test_an_empty_optimizer_state_keeps_the_checkpoint_law_beside_clipping():
    """`chain(clip, f)`'s state holds f's `()`: saved, loaded and compared as it is."""
    small = {**SMALL, "recipes": _only(clip=True)}
    report = fs.testing.check(mlp, batch, optimizer=stateless_sgd, examples=2, **small)
    assert report.ok, report.table()
    assert any(c.clip for c in report.configs)


def test_whole_params_beside_frozen_parameters_keeps_every_law():
    """check's frozen axis pinned (frozen="split"): the reference runs the optimizer on one
    process's params dict, whose frozen entries get None gradients, the shards beside it."""
    small = {**SMALL, "recipes": _only(frozen=True), "policy": None}
    report = fs.testing.check(Stack, batch, optimizer=whole_params_lars, examples=2, **small)
    assert report.ok, report.table()
    assert any(c.frozen for c in report.configs)
