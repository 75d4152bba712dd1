"""`fs.value_and_grad` on a params dict: a dict with nothing marked differentiates every
floating-point leaf, as jax.grad does; only tensors marked frozen beside trainable ones get
None: no gradient is silently absent (see [Note: value_and_grad of a dict])."""

import functools

import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
from funcshard.testing.compare import assert_trees_close
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens


def _loss(model, params, x, y):
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _gather_once_then_micro_batches(rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=2)
    )
    x, y = random_tokens(model.cfg, 4, seed=rank)
    loss = functools.partial(_loss, model)
    full = fs.unshard(state)  # gathered once: plain tensors, not requiring grad
    total = None
    for mx, my in zip(x.chunk(2), y.chunk(2), strict=True):
        _, grads = fs.value_and_grad(loss)(full, mx, my)
        total = grads if total is None else fs.accumulate(total, grads)
    reduced = fs.reduce(state, {k: g / 2 for k, g in total.items()})
    _, expected = fs.value_and_grad(loss)(state, x, y)
    return {
        "missing": [k for k, g in total.items() if g is None or not g.abs().sum() > 0],
        "reduced": reduced.shards,
        "expected": expected.shards,
    }


def test_grads_of_an_unsharded_dict_are_all_there_and_reduce_to_the_sharded_ones():
    """Gather once with `fs.unshard`, differentiate several micro-batches on the dict, reduce:
    every gradient is present and the result equals `value_and_grad` on the state."""
    for result in testing.run(_gather_once_then_micro_batches, world_size=2):
        assert result["missing"] == []
        assert_trees_close(result["reduced"], result["expected"], rtol=1e-5, atol=1e-7)


def test_tensors_marked_frozen_beside_trainable_ones_get_none():
    """`fs.extract` of a partly frozen model marks the frozen tensors: only they get None."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1))
    model.wpe.weight.requires_grad_(False)
    params, _ = fs.extract(model)
    x, y = random_tokens(model.cfg, 2, seed=1)
    grads = fs.grad(functools.partial(_loss, model))(params, x, y)
    assert [k for k, g in grads.items() if g is None] == ["wpe.weight"]


def test_frozen_tensors_passed_apart_get_no_gradient_and_integer_leaves_get_none():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1))
    params, _ = fs.extract(model)
    frozen = {"wpe.weight": params.pop("wpe.weight")}
    x, y = random_tokens(model.cfg, 2, seed=1)

    def loss(trainable, frozen, x, y):
        trainable = {k: v for k, v in trainable.items() if k != "step"}  # an integer leaf
        return _loss(model, trainable | frozen, x, y)

    grads = fs.grad(loss)({**params, "step": torch.arange(3)}, frozen, x, y)
    assert "wpe.weight" not in grads and grads["step"] is None
    model.zero_grad()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    expected = {k: p.grad for k, p in model.named_parameters() if k in params}
    assert_trees_close({k: grads[k] for k in params}, expected, rtol=1e-5, atol=1e-7)
