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


def _tiny(name: str) -> tuple[type, object, type]:
    """A transformers class, a tiny config of it, and its block class (the plan's unit)."""
    from transformers.models.gpt2 import modeling_gpt2 as gpt2
    from transformers.models.t5 import modeling_t5 as t5

    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel, config, gpt2.GPT2Block
    if name == "t5":
        config = transformers.T5Config(
            vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4
        )
        return transformers.T5ForConditionalGeneration, config, t5.T5Block
    config = _llama().config
    return transformers.LlamaForCausalLM, config, type(_llama().model.layers[0])


def _meta_init(name: str, world: int, rank: int) -> dict:
    cls, config, block = _tiny(name)
    with torch.device("meta"):
        model = cls(config)
    plan = fs.plan(model, policy=fs.policy.module_classes({block}))
    state = fs.shard(model, plan, fs.Mesh(shard=world), seed=5, init=model._init_weights)
    still_meta = all(p.is_meta for p in model.parameters())
    return {"params": fs.unshard(state), "buffers": state.buffers, "untouched": still_meta}


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_transformers_meta_init_is_the_same_at_1_2_3_ranks_and_distributed_as_a_cpu_build(name):
    """`_init_weights` runs children first, parents last, as transformers' own post_init does:
    GPT-2's parents rescale c_proj to std 0.02/sqrt(2 n_layer) and T5's attention sets q's
    std, both on their children's tensors. Values are not bitwise a CPU build's: that build
    also draws at construction (torch's own reset_parameters) before post_init redraws, and a
    meta build has no construction draws. Each tensor's std is within 10% of it (or four
    standard errors, for small tensors), its mean within four standard errors."""
    results = [
        testing.run(functools.partial(_meta_init, name, w), world_size=w)[0] for w in (1, 2, 3)
    ]
    cls, config, _ = _tiny(name)
    torch.manual_seed(5)
    built = dict(cls(config).named_parameters())
    for fqn, value in results[0]["params"].items():
        for other in results[1:]:
            assert torch.equal(value, other["params"][fqn]), fqn
        ref = built[fqn]
        if ref.std() == 0:
            assert torch.equal(value, ref), fqn  # norms at one, biases at zero
            continue
        spread = 4 * (2 / value.numel()) ** 0.5  # four standard errors of two samples' gap
        assert abs(value.std() - ref.std()) <= max(0.1, spread) * ref.std(), fqn
        assert abs(value.mean() - ref.mean()) <= spread * ref.std(), fqn
    assert all(r["untouched"] for r in results)  # the caller's meta model is not changed
    cpu_buffers = dict(cls(config).named_buffers())
    for fqn, value in results[0]["buffers"].items():
        assert torch.equal(value, cpu_buffers[fqn]), fqn  # rotary frequencies, computed


class _TitanBlock(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.w1 = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = torch.nn.Linear(2 * dim, dim, bias=False)

    def init_weights(self, std: float) -> None:
        self.norm.reset_parameters()
        torch.nn.init.trunc_normal_(self.w1.weight, std=0.02)
        torch.nn.init.trunc_normal_(self.w2.weight, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class _Titan(torch.nn.Module):
    """torchtitan's convention: one `init_weights(buffer_device=None)` on the root walks the
    children and computes the non-persistent frequency buffer."""

    def __init__(self, vocab: int = 64, dim: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(_TitanBlock(dim) for _ in range(layers))
        self.out = torch.nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs", torch.empty(dim), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        device = buffer_device or self.freqs.device
        dim = self.freqs.numel()
        self.freqs = 1.0 / 10000 ** (torch.arange(dim, device=device).float() / dim)
        torch.nn.init.normal_(self.tok.weight)
        for i, layer in enumerate(self.layers):
            layer.init_weights(std=0.02 / (2 * (i + 1)) ** 0.5)
        torch.nn.init.trunc_normal_(self.out.weight, std=dim**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) * torch.cos(self.freqs)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def _whole_model_init(world: int, rank: int) -> dict:
    with torch.device("meta"):
        model = _Titan()
    plan = fs.plan(model, policy=fs.policy.module_classes({_TitanBlock}))
    init = fs.whole_model(model.init_weights, buffer_device=torch.device("cpu"))
    state = fs.shard(model, plan, fs.Mesh(shard=world), seed=7, init=init)
    logits = fs.call(model, state, torch.arange(8).view(2, 4))
    return {"params": fs.unshard(state), "buffers": state.buffers, "logits": logits}


@pytest.mark.quick
def test_whole_model_init_is_one_call_on_a_copy_equal_to_a_cpu_build():
    """torchtitan's form: the bound `model.init_weights` acts on the working copy; the result
    is bitwise a CPU build followed by the same call under the seed, at 1, 2 and 3 ranks."""
    torch.manual_seed(123)
    reference = _Titan()
    torch.manual_seed(7)
    reference.init_weights()
    expected = reference(torch.arange(8).view(2, 4))
    for world in (1, 2, 3):
        result = testing.run(functools.partial(_whole_model_init, world), world_size=world)[0]
        for fqn, value in reference.named_parameters():
            assert torch.equal(result["params"][fqn], value), (world, fqn)
        assert torch.equal(result["buffers"]["freqs"], reference.freqs)
        torch.testing.assert_close(result["logits"], expected, rtol=1e-6, atol=1e-6)


def partial_init(model: torch.nn.Module) -> None:
    torch.nn.init.normal_(model.tok.weight)


def _whole_model_error(rank: int) -> str:
    with torch.device("meta"):
        model = _Titan()
    plan = fs.plan(model, policy=fs.policy.module_classes({_TitanBlock}))
    try:
        fs.shard(model, plan, fs.Mesh(shard=1), init=fs.whole_model(partial_init))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_whole_model_init_that_misses_a_tensor_names_it():
    (error,) = testing.run(_whole_model_error, world_size=1)
    assert "layers.0.w1.weight" in error and "partial_init(model)" in error


def _skipped_llama(with_fn: bool, rank: int) -> dict:
    model = _llama()
    plan = fs.plan(model, policy=fs.policy.module_classes({type(model.model.layers[0])}))
    before = torch.random.get_rng_state()
    init = fs.skip(model._init_weights) if with_fn else "skip"
    try:
        state = fs.shard(model, plan, fs.Mesh(shard=2), init=init)
    except RuntimeError as e:
        return {"error": str(e)}
    return {
        "drew": not torch.equal(before, torch.random.get_rng_state()),
        "zero": all(bool(s.eq(0).all()) for s in state.shards),
        "inv_freq": state.buffers["model.rotary_emb.inv_freq"],
    }


def test_skip_computes_the_buffers_no_checkpoint_holds_and_refuses_to_leave_them_zero():
    """A pretrained model's state: zeros where the checkpoint will write, nothing drawn, but
    the rotary frequencies (a non-persistent buffer) computed; plain "skip" on such a model
    raises naming the buffer and the fix."""
    with_fn = testing.run(functools.partial(_skipped_llama, True), world_size=2)
    with torch.device("cpu"):
        built = transformers.LlamaForCausalLM(_llama().config)
    for result in with_fn:
        assert not result["drew"] and result["zero"]
        assert torch.equal(result["inv_freq"], built.model.rotary_emb.inv_freq)
    for result in testing.run(functools.partial(_skipped_llama, False), world_size=2):
        assert "model.rotary_emb.inv_freq" in result["error"]
        assert "fs.skip(model._init_weights)" in result["error"]


def _peak_while_initializing(rank: int) -> dict:
    from funcshard.testing.memory import LiveTensors

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    plan = fs.plan(model, policy=fs.policy.module_classes({type(model.model.layers[0])}))
    with LiveTensors() as meter:
        state = fs.shard(model, plan, fs.Mesh(shard=2), init=model._init_weights)
    return {
        "peak": meter.peak,
        "shards": sum(s.numel() * s.element_size() for s in state.shards),
        "unit": max(f.numel * f.dtype.itemsize for f in state.layout.flats),
    }


def test_a_per_module_init_holds_one_unit_beside_the_shards():
    """Each tensor is real only from its first writer to its last (found by the rehearsal),
    so a block's tensors are sliced and dropped before the next block's are made."""
    for result in testing.run(_peak_while_initializing, world_size=2):
        assert result["peak"] <= result["shards"] + 1.1 * result["unit"], result
