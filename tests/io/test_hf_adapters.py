"""`fs.checkpoint.load_hf(..., strict=False)`: a pretrained base (transformers' Llama from a
tiny config, saved with `save_pretrained`) loaded into a model with new LoRA-like adapters,
sharded over 2 ranks with the adapters' own initialization, and the warning for trainable
parameters that nothing initialized (a `like` built with `init=fs.skip`).

Run: `.venv/bin/python -m pytest tests/io/test_hf_adapters.py -q`.
"""

import functools
import math
import warnings

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import testing

transformers = pytest.importorskip("transformers")

RANK = 2  # of each adapter
ADAPTED = ("q_proj", "v_proj")


class LoraLinear(nn.Linear):
    """A linear layer plus a low-rank update `B @ A`, B zero at init as in LoRA (peft is not
    a dependency): its weight keeps the base layer's FQN, the adapters are new keys."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.lora_A = nn.Parameter(torch.empty(RANK, in_features))
        self.lora_B = nn.Parameter(torch.empty(out_features, RANK))
        self.reset_adapters()

    def reset_adapters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "lora_A"):  # nn.Linear.__init__ calls this before they exist
            self.reset_adapters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.lora_A.T @ self.lora_B.T


def _config():
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip


def _pretrained() -> nn.Module:
    """The base model as saved: built on the CPU, every parameter perturbed off its init."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _with_adapters(model: nn.Module) -> nn.Module:
    """The base frozen, LoRA adapters on every attention's q and v projections."""
    for layer in model.model.layers:
        for name in ADAPTED:
            old = getattr(layer.self_attn, name)
            setattr(layer.self_attn, name, LoraLinear(old.in_features, old.out_features))
    for fqn, p in model.named_parameters():
        p.requires_grad_("lora_" in fqn)
    return model


def _adapter_fqns() -> list[str]:
    return [
        f"model.layers.{i}.self_attn.{name}.lora_{ab}"
        for i in range(2)
        for name in ADAPTED
        for ab in "AB"
    ]


def _shard(model: nn.Module, mesh: fs.Mesh, init=None) -> fs.ShardedState:
    policy = fs.policy.module_classes({transformers.models.llama.modeling_llama.LlamaDecoderLayer})
    return fs.shard(model, fs.plan(model, policy=policy, frozen="split"), mesh, init=init)


def _full(state: fs.ShardedState) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in fs.unshard(state).items()}


def _recorded(load):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = load()
    return state, [(w.category.__name__, str(w.message)) for w in caught]


def _load_into_adapters(directory: str, rank: int) -> dict:
    torch.manual_seed(1)  # the adapters' own init, on a model built on the CPU
    model = _with_adapters(transformers.LlamaForCausalLM(_config()))
    like = _shard(model, fs.Mesh(shard=2))
    state, caught = _recorded(lambda: fs.checkpoint.load_hf(directory, like=like, strict=False))
    try:
        fs.checkpoint.load_hf(directory, like=like)
        strict_error = None
    except ValueError as e:
        strict_error = str(e)
    return {
        "like": _full(like),
        "model": {k: v.detach().clone() for k, v in model.named_parameters()},
        "loaded": _full(state),
        "warnings": caught,
        "strict_error": strict_error,
    }


def test_strict_false_keeps_the_adapters_init_and_loads_the_base_bitwise(tmp_path):
    """Base weights are the file's, adapters the `like` state's (LoRA's B, zero by design,
    starts no second warning), one warning names the adapters; strict=True names them in
    its error."""
    base = _pretrained()
    base.save_pretrained(str(tmp_path), safe_serialization=True)
    adapters = _adapter_fqns()
    results = testing.run(functools.partial(_load_into_adapters, str(tmp_path)), world_size=2)
    for result in results:
        loaded = result["loaded"]
        assert sorted(loaded) == sorted([*dict(base.named_parameters()), *adapters])
        for fqn, value in base.named_parameters():
            assert torch.equal(loaded[fqn], value), fqn
        for fqn in adapters:
            assert torch.equal(loaded[fqn], result["like"][fqn]), fqn
            assert torch.equal(loaded[fqn], result["model"][fqn]), fqn
        assert loaded["model.layers.0.self_attn.q_proj.lora_A"].ne(0).any()
        ((category, message),) = result["warnings"]
        assert category == "UserWarning"
        assert message.startswith("funcshard.checkpoint.load_hf(strict=False): ")
        assert f"lacks {len(adapters)} of the model's tensors" in message
        assert all(repr(fqn) in message for fqn in adapters), message
        assert "q_proj.weight" not in message
        error = result["strict_error"]
        assert error is not None
        assert all(repr(fqn) in error for fqn in adapters[:8]), error
        assert "pass strict=False" in error
    assert results[0]["warnings"] == results[1]["warnings"]


def _load_into_skipped(directory: str, rank: int) -> list:
    with torch.device("meta"):
        model = _with_adapters(transformers.LlamaForCausalLM(_config()))
    like = _shard(model, fs.Mesh(shard=2), init=fs.skip(model._init_weights))
    state, caught = _recorded(lambda: fs.checkpoint.load_hf(directory, like=like, strict=False))
    return {"loaded": _full(state), "warnings": caught}


def test_trainable_parameters_nothing_initialized_are_named_after_a_skip_init(tmp_path):
    """`like` from init=fs.skip holds zeros everywhere: the adapters the file lacks would
    train from zero (A and B both zero get no gradient), so a second warning names them."""
    base = _pretrained()
    base.save_pretrained(str(tmp_path), safe_serialization=True)
    adapters = _adapter_fqns()
    results = testing.run(functools.partial(_load_into_skipped, str(tmp_path)), world_size=2)
    for result in results:
        for fqn, value in base.named_parameters():
            assert torch.equal(result["loaded"][fqn], value), fqn
        assert all(result["loaded"][fqn].eq(0).all() for fqn in adapters)
        caught = result["warnings"]
        assert [category for category, _ in caught] == ["UserWarning", "UserWarning"]
        kept, zeros = (message for _, message in caught)
        assert "keep like's values" in kept
        assert "are all zeros" in zeros and "init=fs.skip" in zeros
        assert all(repr(fqn) in zeros for fqn in adapters), zeros
        assert "weight" not in zeros.split(" are all zeros")[0]  # the frozen base: not named
    assert results[0]["warnings"] == results[1]["warnings"]


def _load_with_extra_key(directory: str, rank: int) -> dict:
    model = _with_adapters(transformers.LlamaForCausalLM(_config()))
    like = _shard(model, fs.Mesh(shard=2))
    try:
        fs.checkpoint.load_hf(directory, like=like, strict=False)
        error = None
    except ValueError as e:
        error = str(e)
    drop = lambda key: None if key == "model.extra.weight" else key  # noqa: E731
    _, caught = _recorded(
        lambda: fs.checkpoint.load_hf(directory, like=like, rename=drop, strict=False)
    )
    return {"error": error, "warnings": len(caught)}


def test_strict_false_still_rejects_unexpected_keys_unless_rename_drops_them(tmp_path):
    from safetensors.torch import save_file

    tensors = {k: v.clone() for k, v in _pretrained().state_dict().items()}
    save_file({**tensors, "model.extra.weight": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    for result in testing.run(functools.partial(_load_with_extra_key, str(tmp_path)), 2):
        assert result["error"] is not None
        assert "unexpected 'model.extra.weight'" in result["error"]
        assert "missing none" in result["error"]  # strict=False: missing is no error
        assert result["warnings"] == 1
