"""`funcshard.estimate` planning a GPU step on a machine without one: the attention kernel
torch would pick there, grouped-query attention, activation checkpointing in the dry run
(its LiveTensors check is in test_estimate.py), and `funcshard plan --device cuda`."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import funcshard as fs
from funcshard.cli import _main as cli
from funcshard.planning._attention_kernels import Target, _Call, choose
from funcshard.planning._estimate import estimate

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

BF16 = fs.MixedPrecision(param_dtype=torch.bfloat16)


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return model, fs.plan(model, policy=fs.policy.module_classes({LlamaDecoderLayer}))


def _llama_loss(model, params, x):
    logits = fs.call(model, params, input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())


def _llama_peak(model, plan, length: int, **options) -> int:
    x = torch.zeros(2, length, dtype=torch.long)
    loss_fn = functools.partial(_llama_loss, model)
    return estimate(plan, 8, mp=BF16, model=model, loss_fn=loss_fn, args=(x,), **options).peak


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_a_gpu_step_is_planned_without_a_gpu_and_gqa_keeps_no_scores():
    """device="cuda" raised "Torch not compiled with CUDA enabled" on a machine without
    CUDA, and grouped-query attention fell back to the math kernel's S x S scores."""
    model, plan = _llama()
    flash = [_llama_peak(model, plan, s, device="cuda") for s in (256, 512, 1024)]
    math = _llama_peak(model, plan, 1024, device="cuda", attention="math")
    scores = 2 * 8 * 1024 * 1024 * 4  # one layer's fp32 (B, H, S, S) attention matrix
    assert math - flash[-1] > 2 * scores
    first, second = flash[1] - flash[0], flash[2] - flash[1]
    assert abs(second - 2 * first) < 0.02 * second  # linear in the sequence: no S x S


def test_the_kernel_follows_torchs_rules_for_the_assumed_gpu():
    q, kv = _meta(2, 8, 512, 64), _meta(2, 2, 512, 64)

    def kernel(query, key, mask=False, gqa=True, target=None):
        return choose(target or Target(), _Call(query, key, key, mask, 0.0, not mask, gqa))

    assert kernel(q, kv) == "flash"  # bf16, causal, GQA on sm90
    assert kernel(q, kv, gqa=False) == "math"  # unequal heads without enable_gqa
    assert kernel(q, kv, mask=True) == "efficient"  # flash takes no mask
    assert kernel(q.float(), kv.float()) == "efficient"  # flash is 16-bit only
    assert kernel(q, kv, target=Target(capability=(7, 5))) == "math"  # no bf16 before sm80
    assert kernel(q, kv, target=Target(attention="cudnn")) == "cudnn"
    with sdpa_kernel(SDPBackend.MATH):  # torch's own context is honoured
        assert kernel(q, kv) == "math"
    with pytest.raises(ValueError, match="device must be 'cuda' or 'cpu', got 'tpu'"):
        Target("tpu")
    with pytest.raises(ValueError, match="attention must be one of"):
        Target(attention="fast")


def test_checkpointed_transformers_llama_plans_and_is_lower():
    """With checkpointing on, transformers' mask code asked a meta tensor `.all()` and the
    dry run failed: "Tensor.item() cannot be called on meta tensors"."""
    model, plan = _llama()
    plain = _llama_peak(model, plan, 512, device="cuda")
    model.train()
    model.activation_checkpointing_enable()
    try:
        checkpointed = _llama_peak(model, plan, 512, device="cuda")
        model.activation_checkpointing_disable()
        with pytest.warns(FutureWarning, match="deprecated"):
            model.gradient_checkpointing_enable()  # the alias, same checkpointing
        assert _llama_peak(model, plan, 512, device="cuda") == checkpointed
        with pytest.warns(FutureWarning, match="deprecated"):
            model.gradient_checkpointing_enable({"use_reentrant": True})
        with pytest.raises(RuntimeError, match="set use_reentrant=False"):  # torch's own
            _llama_peak(model, plan, 512, device="cuda")
    finally:
        model.activation_checkpointing_disable()
    assert checkpointed < 0.8 * plain


def test_plan_takes_a_config_json_device_and_checkpointing(tmp_path, capsys):
    config = tmp_path / "config.json"
    transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2,
    ).to_json_file(config)  # fmt: skip
    argv = ["plan", str(config), "--world-size", "8", "--mp", "bf16", "--tokens", "2x256"]
    assert cli.main([*argv, "--device", "cuda"]) == 0
    plain = capsys.readouterr().out
    assert cli.main([*argv, "--device", "cuda", "--checkpointing"]) == 0
    checkpointed = capsys.readouterr().out
    assert "on cuda sm90" in plain and "LlamaDecoderLayer" in plain and "peak:" in plain
    assert "activation checkpointing" in checkpointed
    with pytest.raises(SystemExit, match="--checkpointing: add --tokens"):
        cli.main(["plan", str(config), "--world-size", "8", "--checkpointing"])
