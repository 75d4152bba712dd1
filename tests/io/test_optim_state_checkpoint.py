"""Optimizer state of any registered pytree type is checkpointed whole, never dropped."""

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import funcshard as fs
from funcshard import testing
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens


@dataclass
class LionState:
    """A user's optimizer state written as funcshard's own are: a dataclass."""

    step: Tensor
    momentum: tuple


torch.utils._pytree.register_dataclass(LionState)


def lion(lr: float, b1: float = 0.9, b2: float = 0.99) -> fs.optim.Optimizer:
    """Lion (Chen et al. 2023) as a user writes it: sign of an interpolated momentum."""

    def init(params: fs.ShardedState) -> LionState:
        return LionState(
            torch.zeros((), dtype=torch.int64), tuple(map(torch.zeros_like, params.shards))
        )

    def update(grads: Any, state: LionState, params: Any, donate: bool = False) -> tuple:
        updates = [
            torch.sign(b1 * m + (1 - b1) * g) * -lr
            for g, m in zip(grads.shards, state.momentum, strict=True)
        ]
        momentum = tuple(
            b2 * m + (1 - b2) * g for g, m in zip(grads.shards, state.momentum, strict=True)
        )
        new = fs.ShardedGrads(shards=tuple(updates), layout=grads.layout)
        return new, LionState(state.step + 1, momentum)

    return fs.optim.Optimizer(init, update)


def _state(world: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    return model, fs.shard(model, plan, fs.Mesh(shard=world))


def _train(model, state, opt, opt_state, steps, rank):
    loss_fn = lambda s, x, y: F.cross_entropy(fs.call(model, s, x).flatten(0, 1), y.flatten())  # noqa: E731
    for step in steps:
        x, y = random_tokens(model.cfg, 2, seed=step)  # the same batch on every rank
        _, grads = fs.value_and_grad(loss_fn)(state, x, y)
        updates, opt_state = opt.update(grads, opt_state, state)
        state = fs.apply_updates(state, updates)
    return state, opt_state


def _save_after_two_steps(path: str, rank: int) -> dict:
    model, state = _state(2)
    opt = lion(1e-3)
    state, opt_state = _train(model, state, opt, opt.init(state), range(2), rank)
    fs.checkpoint.save(path, state, opt_state, step=2)
    state, opt_state = _train(model, state, opt, opt_state, range(2, 4), rank)
    return fs.unshard(state)


def _resume(path: str, world: int, rank: int) -> dict:
    model, state = _state(world)
    opt = lion(1e-3)
    state, opt_state, step, _ = fs.checkpoint.load(path, like=(state, opt.init(state)))
    assert isinstance(opt_state, LionState) and int(opt_state.step) == 2 and step == 2
    state, opt_state = _train(model, state, opt, opt_state, range(2, 4), rank)
    return fs.unshard(state)


def test_a_dataclass_optimizer_state_is_saved_and_resumes_at_other_world_sizes(tmp_path):
    path = str(tmp_path)
    straight = testing.run(functools.partial(_save_after_two_steps, path))[0]
    for world in (1, 3):
        resumed = testing.run(functools.partial(_resume, path, world), world_size=world)[0]
        for fqn, value in straight.items():
            # a momentum reset to zero would move every weight by a different sign
            torch.testing.assert_close(resumed[fqn], value, rtol=0, atol=0, msg=fqn)


class Opaque:
    """A state class registered with no pytree library."""

    def __init__(self, moments: tuple) -> None:
        self.moments = moments


def _save_opaque(path: str, rank: int) -> None:
    _, state = _state(2)
    fs.checkpoint.save(path, state, {"inner": Opaque(state.shards)})


def test_a_state_funcshard_cannot_save_raises_on_every_rank_naming_its_path(tmp_path):
    with pytest.raises(TypeError) as caught:
        testing.run(functools.partial(_save_opaque, str(tmp_path)))
    message = str(caught.value)
    assert "the optimizer state's ['inner'] is a Opaque" in message
    assert "register_dataclass" in message


def _int_keyed_described(rank: int) -> list:
    from funcshard.io._checkpoint import _optim_leaves

    _, state = _state(1)
    described, _ = _optim_leaves({i: s for i, s in enumerate(state.shards)}, state.layout)
    return [(key, index) for _, key, index in described]


def test_an_int_keyed_dict_state_lines_up_with_the_flat_buffers_it_belongs_to():
    """{flat index: shard} states are saved per parameter (so they load at any world size),
    as they were when optree flattened them."""
    described = testing.run(_int_keyed_described, world_size=1)[0]
    assert described == [("optim/", i) for i in range(len(described))] and len(described) == 3
