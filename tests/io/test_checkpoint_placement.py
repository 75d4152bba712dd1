"""Checkpoints move between placements: an owned state saved at 2 ranks loads into an even
one at 3 and back into an owned one at 4, bitwise, its Muon state following the owners."""

import functools

import optree
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens


def _config() -> GPTConfig:
    return GPTConfig(n_layer=2)


def _label(fqn: str, p: torch.Tensor) -> str:
    return "muon" if p.ndim == 2 and fqn.startswith("blocks.") else "adamw"


def _optimizer() -> fs.optim.Optimizer:
    groups = {"muon": fs.optim.muon(0.02), "adamw": fs.optim.adamw(3e-3)}
    return fs.optim.partition(groups, _label)


def _loss(model, params, x, y):
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _as_dict(params, opt_state) -> dict:
    """Every tensor of a one-process state by path: what a bitwise comparison reads."""
    leaves = optree.tree_flatten_with_path((dict(params), opt_state))
    return {str(path): leaf for path, leaf in zip(*leaves[:2], strict=True)}


def _stage(path: str, world: int, placement: str, source: str | None, rank: int):
    """Train 2 steps and save (source None), or load `source` and save it again, on `world`
    ranks with the blocks `placement`; at one process, return the loaded state by path."""
    torch.manual_seed(0)
    model = GPT(_config())
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}), placement={Block: placement})
    params = fs.shard(model, plan, fs.Mesh(shard=world))
    opt = _optimizer()
    opt_state = opt.init(params)
    if source is None:
        for step in range(2):
            x, y = random_tokens(_config(), 6, seed=step)
            mine = x.chunk(world)[rank], y.chunk(world)[rank]
            _, grads = fs.value_and_grad(functools.partial(_loss, model))(params, *mine)
            params, opt_state = opt.step(grads, opt_state, params)
    else:
        params, opt_state, _, _ = fs.checkpoint.load(source, like=(params, opt_state))
    fs.checkpoint.save(path, params, opt_state, step=2)
    return _as_dict(fs.unshard(params), opt_state) if world == 1 else None


def test_owned_at_two_even_at_three_owned_at_four_is_bitwise(tmp_path):
    """Saved owned at 2 ranks, loaded even at 3 (saved), owned at 4 (saved): the last and
    the first, each loaded at one process, hold the same bits (params, Muon's Owned state
    keyed by FQN, AdamW's flat moments)."""
    two, three, four, one = (str(tmp_path / n) for n in ("two", "three", "four", "one"))
    testing.run(functools.partial(_stage, two, 2, "owned", None), world_size=2)
    testing.run(functools.partial(_stage, three, 3, "even", two), world_size=3)
    testing.run(functools.partial(_stage, four, 4, "owned", three), world_size=4)
    first = testing.run(functools.partial(_stage, one + "a", 1, "even", two), world_size=1)[0]
    last = testing.run(functools.partial(_stage, one + "b", 1, "even", four), world_size=1)[0]
    assert first.keys() == last.keys()
    assert any("blocks.0.mlp.fc.weight" in k for k in first)  # Muon's state, by FQN
    for key, value in first.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, last[key]), key
        else:
            assert value == last[key], key
