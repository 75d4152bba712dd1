"""Checkpoints save and load without torch's ShardedTensor deprecation warnings."""

import functools
import warnings

import torch

import funcshard as fs
from funcshard import testing
from funcshard.io import _checkpoint as checkpoint
from funcshard.testing.models import GPT, Block, GPTConfig


def _save_and_load(path: str, rank: int) -> list[str]:
    with torch.device("meta"):
        model = GPT(GPTConfig())
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    state = fs.shard(model, plan, fs.Mesh(shard=2), seed=0)
    opt_state = fs.optim.adamw(1e-3).init(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.save(path, state, opt_state, step=1)
        checkpoint.load(path, like=(state, opt_state))
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_save_and_load_warn_about_nothing_on_any_rank(tmp_path):
    """Every save and load printed torch's "we are deprecating ShardedTensor" FutureWarning,
    once per parameter, on every rank."""
    for caught in testing.run(functools.partial(_save_and_load, str(tmp_path)), world_size=2):
        deprecations = ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning")
        assert not [w for w in caught if w.startswith(deprecations) or "ShardedTensor" in w]
