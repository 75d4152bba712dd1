"""`fs.shard(..., init=fn)`: a meta-device model whose initialization is not
`reset_parameters()` (a transformers model's `_init_weights`) is initialized straight into
local shards, the same values at every world size."""

import functools

import pytest
import torch

import funcshard as fs
from funcshard import testing

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.05,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _initialized(world: int, with_init: bool, rank: int) -> dict:
    model = _llama()
    layers = {type(model.model.layers[0])}
    plan = fs.plan(model, policy=fs.policy.module_classes(layers))
    init = model._init_weights if with_init else None
    try:
        state = fs.shard(model, plan, fs.Mesh(shard=world), seed=3, init=init)
    except RuntimeError as e:
        return {"error": str(e)}
    tokens = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = fs.call(model, state, input_ids=tokens, labels=tokens).loss
    return {"params": fs.unshard(state), "buffers": state.buffers, "loss": loss.item()}


def test_a_transformers_model_initializes_from_the_meta_device_with_its_own_init():
    (one,) = testing.run(functools.partial(_initialized, 1, True), world_size=1)
    two = testing.run(functools.partial(_initialized, 2, True), world_size=2)[0]
    for fqn, value in one["params"].items():
        assert torch.equal(value, two["params"][fqn]), fqn  # any world size, same values
        assert value.isfinite().all(), fqn
    assert torch.equal(
        one["buffers"]["model.rotary_emb.inv_freq"], two["buffers"]["model.rotary_emb.inv_freq"]
    )
    weight = one["params"]["model.layers.0.mlp.up_proj.weight"]
    assert abs(weight.std().item() - 0.05) < 0.01  # its own init: normal(0, initializer_range)
    assert torch.equal(one["params"]["model.norm.weight"], torch.ones(32))
    with torch.device("cpu"):
        built = transformers.LlamaForCausalLM(_llama().config)
    assert torch.equal(one["buffers"]["model.rotary_emb.inv_freq"], built.model.rotary_emb.inv_freq)
    assert 3.5 < one["loss"] < 5.0  # about log(64): an untrained model, not NaN


def test_without_init_the_error_names_init_as_the_fix():
    (result,) = testing.run(functools.partial(_initialized, 1, False), world_size=1)
    assert "init=model._init_weights" in result["error"]


def _save_then_load_into_a_skipped_state(path: str, rank: int) -> dict:
    from funcshard.testing.models import GPT, Block, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    saved = fs.shard(model, plan, fs.Mesh(shard=2))
    fs.checkpoint.save(path, saved, step=1)
    with torch.device("meta"):
        meta = GPT(GPTConfig(n_layer=2))
    before = torch.random.get_rng_state()
    skipped = fs.shard(meta, plan, fs.Mesh(shard=2), init="skip")
    drew = not torch.equal(before, torch.random.get_rng_state())
    zero = all(bool(s.eq(0).all()) for s in skipped.shards)
    loaded, _, step, _ = fs.checkpoint.load(path, like=(skipped, None))
    same = all(torch.equal(a, b) for a, b in zip(loaded.shards, saved.shards, strict=True))
    return {"drew": drew, "zero": zero, "same": same, "step": step}


def test_init_skip_draws_nothing_and_a_checkpoint_fills_it(tmp_path):
    """A meta-built state for a checkpoint to fill: zeros, no random numbers drawn, then
    exactly the saved values."""
    for result in testing.run(
        functools.partial(_save_then_load_into_a_skipped_state, str(tmp_path)), world_size=2
    ):
        assert result == {"drew": False, "zero": True, "same": True, "step": 1}
