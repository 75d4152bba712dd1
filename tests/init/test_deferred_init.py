"""`fs.deferred_init()`: a model built on the meta device with its constructor recorded, then
sharded by replaying that record, bitwise the same constructor run on the CPU."""

import functools
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import funcshard as fs
from funcshard import testing
from funcshard.init._deferred import DeferredInitError
from funcshard.testing.memory import LiveTensors

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


class LayerNorm(nn.Module):
    """nanoGPT's: parameters made in `__init__`, an optional bias, no init method."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        mask = torch.tril(torch.ones(block_size, block_size))
        self.register_buffer("bias", mask.view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (B, nh, T, T)
        att = F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, bias: bool) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, bias)
        self.attn = Attention(n_embd, n_head, block_size)
        self.ln_2 = LayerNorm(n_embd, bias)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU())
        self.mlp.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's constructor: tied embedding and head, `apply` init, scaled projections."""

    def __init__(self, vocab: int = 61, n_layer: int = 2, n_embd: int = 16, bias: bool = True):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(8, n_embd)
        self.h = nn.ModuleList([Block(n_embd, 2, 8, bias) for _ in range(n_layer)])
        self.ln_f = LayerNorm(n_embd, bias)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        # a CPU constant (torch.tensor stays on the CPU in the block) meeting a meta tensor
        self.register_buffer("scale", torch.tensor([0.5, 2.0]).repeat(8) * torch.ones(16))
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def _lora() -> nn.Module:
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(_llama(), lora)


BUILDS = {
    "gpt": GPT,
    "gpt_no_bias": functools.partial(GPT, bias=False),
    "llama": _llama,
    "gpt2": _gpt2,
    "lora": _lora,
}


def _built_both_ways(build) -> tuple[nn.Module, nn.Module, bool]:
    """(CPU model, deferred model, whether the random state after each is the same)."""
    torch.manual_seed(1337)
    cpu = build()
    after_cpu = torch.random.get_rng_state()
    torch.manual_seed(1337)
    with fs.deferred_init():
        deferred = build()
    return cpu, deferred, torch.equal(after_cpu, torch.random.get_rng_state())


def _differences(cpu: nn.Module, state: fs.ShardedState) -> list[str]:
    """Names whose sharded values are not bitwise the CPU model's."""
    expected = dict(cpu.named_parameters())
    expected.update(cpu.named_buffers())
    got = {**fs.unshard(state), **state.buffers}
    return [n for n, v in got.items() if not torch.equal(v, expected[n].detach())]


BLOCKS = ("Block", "DecoderLayer")


def _shard_each(world: int, rank: int) -> dict:
    out: dict = {}
    for name, build in BUILDS.items():
        cpu, deferred, same_rng = _built_both_ways(build)
        blocks = {m for m in deferred.modules() if type(m).__name__.endswith(BLOCKS)}
        policy = fs.policy.module_classes({type(m) for m in blocks})
        plan = fs.plan(deferred, policy=policy, frozen="split")
        state = fs.shard(deferred, plan, fs.Mesh(shard=world))
        out[name] = (same_rng, _differences(cpu, state))
        if name == "gpt":
            ddp = fs.replicate(deferred, fs.Mesh(replicate=world))
            out["gpt_ddp"] = (same_rng, _differences(cpu, ddp))
            owned = fs.plan(deferred, policy=policy, placement={type(b): "owned" for b in blocks})
            in_owners = fs.shard(deferred, owned, fs.Mesh(shard=world))  # each block's owners
            out["gpt_owned"] = (same_rng, _differences(cpu, in_owners))
            tokens = torch.randint(61, (2, 8), generator=torch.Generator().manual_seed(rank))
            out["gpt_call"] = torch.equal(fs.call(deferred, state, tokens), cpu(tokens))
        if name == "lora":
            b = state.buffers | fs.unshard(state)
            out["lora_b_zero"] = all(v.eq(0).all() for n, v in b.items() if "lora_B" in n)
            out["lora_a_random"] = all(v.std() > 0 for n, v in b.items() if "lora_A" in n)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_deferred_models_equal_their_cpu_construction_bitwise(world):
    for rank, result in enumerate(testing.run(functools.partial(_shard_each, world), world)):
        for name in [*BUILDS, "gpt_ddp", "gpt_owned"]:
            same_rng, differ = result[name]
            assert same_rng, f"{name}: the random state after the block is not the CPU build's"
            assert differ == [], f"rank {rank}, {name}: {differ}"
        assert result["gpt_call"] and result["lora_b_zero"] and result["lora_a_random"]


class ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))
        if self.weight.sum().item() > 0:  # a data-dependent branch
            self.weight.data.neg_()


def test_reading_a_value_in_the_constructor_names_module_op_and_line():
    with pytest.raises(DeferredInitError) as caught, fs.deferred_init():
        ReadsAValue()
    message = str(caught.value)
    assert "building ReadsAValue" in message and "_local_scalar_dense" in message
    assert "reads a tensor's value into Python" in message
    assert f"{__file__}:" in message and ".item()" in message


def test_blocks_do_not_nest():
    with fs.deferred_init(), pytest.raises(ValueError, match="do not nest"), fs.deferred_init():
        pass
    with fs.deferred_init():  # the failed inner block left the outer one working
        assert nn.Linear(2, 2).weight.is_meta


class Uninitialized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))  # garbage on the CPU too


def _bad_shards(rank: int) -> list[str]:
    mesh = fs.Mesh(shard=2)
    messages = []
    with fs.deferred_init():
        model = nn.Sequential(Uninitialized())
    with torch.device("meta"):
        model.append(nn.Linear(2, 2))  # after the block: nothing records it
    for bad in (model, model[:1]):
        try:
            fs.shard(bad, fs.plan(bad), mesh)
        except ValueError as e:
            messages.append(str(e))
    for change in ("seed", "init", "to_empty", "to_dtype"):
        with fs.deferred_init():
            model = GPT()
        kwargs: dict = {}
        if change == "seed":
            kwargs["seed"] = 0
        elif change == "init":
            kwargs["init"] = model._init_weights
        elif change == "to_empty":
            model.to_empty(device="cpu")
        else:
            model.to(torch.float64)
        try:
            fs.shard(model, fs.plan(model), mesh, **kwargs)
            messages.append(f"{change}: no error")
        except ValueError as e:
            messages.append(f"{change}: {e}")
    return messages


def test_bad_input_to_shard_is_refused_alike_on_every_rank_before_any_collective():
    first, second = testing.run(_bad_shards, 2)
    assert first == second
    outside, never_written, seed, init, to_empty, to_dtype = first
    assert "'1.weight', '1.bias' are on the meta device but were not built in" in outside
    assert (
        "'0.weight' are made by torch.empty in the constructor and never written" in never_written
    )
    assert "seed=0 does not apply" in seed and "torch.manual_seed" in seed
    assert "init=" in init and "does not apply" in init
    for text in (to_empty, to_dtype):
        assert "replaced after the deferred_init block" in text and "'wte.weight'" in text


def _peak_while_sharding(rank: int) -> dict:
    with fs.deferred_init():
        model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(8)])
    plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
    with LiveTensors() as live:
        state = fs.shard(model, plan, fs.Mesh(shard=2))
    local = sum(s.numel() * s.element_size() for s in state.shards)
    return {"peak": live.peak, "local": local, "largest": 64 * 64 * 4, "whole": 8 * 64 * 64 * 4}


def test_peak_memory_while_sharding_is_one_parameter_plus_the_local_shards():
    for r in testing.run(_peak_while_sharding, 2):
        assert r["local"] == r["whole"] // 2
        assert r["peak"] <= r["largest"] + r["local"] + 16 * 1024, r  # small: random states
        assert r["peak"] < r["whole"], r


def _as_template(path: str, rank: int) -> dict:
    """A sharded deferred model serves as the template a meta model does."""
    with fs.deferred_init():
        model = _gpt2().eval()  # no dropout, to compare the forward
    plan = fs.plan(model)
    state = fs.checkpoint.load_hf(path, like=fs.shard(model, plan, fs.Mesh(shard=2)))
    torch.manual_seed(5)
    saved = _gpt2().eval()
    tokens = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(rank))
    logits = fs.call(model, state, input_ids=tokens).logits
    estimate = fs.estimate(plan, 2, model=model)
    return {
        "loaded": _differences(saved, state) == [],
        "call": torch.allclose(logits, saved(input_ids=tokens).logits, rtol=1e-5, atol=1e-6),
        "estimate": estimate.peak > 0,
    }


def test_a_sharded_deferred_model_is_a_template_for_call_estimate_and_load_hf(tmp_path):
    torch.manual_seed(5)
    _gpt2().save_pretrained(tmp_path)
    for result in testing.run(functools.partial(_as_template, str(tmp_path)), 2):
        assert result == {"loaded": True, "call": True, "estimate": True}


def deferred_mlp() -> nn.Module:
    with fs.deferred_init():
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def mlp_batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(4, 8, generator=g),), torch.randn(4, 4, generator=g)


def test_testing_check_takes_a_deferred_model():
    small = {"world_sizes": (2,), "steps": 2, "recipes": False, "shrink_budget": 1}
    report = fs.testing.check(deferred_mlp, mlp_batch, examples=1, meta=True, **small)
    assert report.ok
