"""extract/call against calling the module directly: tied, frozen, BatchNorm, other methods."""

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard.testing.models import GPT, ConvNet, GPTConfig, frozen_embedding_gpt


def _tokens(cfg: GPTConfig, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(cfg.vocab_size, (3, cfg.block_size), generator=g)


def _snapshot(tensors: dict) -> dict:
    return {k: v.detach().clone() for k, v in tensors.items()}


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_extract_lists_tied_weight_once_under_first_fqn():
    model = GPT()
    params, buffers = fs.extract(model)
    assert "wte.weight" in params and "head.weight" not in params
    assert list(params) == [n for n, _ in model.named_parameters()]
    assert buffers == {}
    for name, p in params.items():  # detached leaves that share the module's storage
        assert p is not model.get_parameter(name) and not isinstance(p, nn.Parameter)
        assert p.grad_fn is None and p.data_ptr() == model.get_parameter(name).data_ptr()


@pytest.mark.quick
def test_call_matches_module_on_gpt_with_tied_embedding():
    torch.manual_seed(0)
    model = GPT()
    params, _ = fs.extract(model)
    x = _tokens(model.cfg)
    assert torch.equal(fs.call(model, params, x), model(x))


def test_call_feeds_both_uses_of_a_tied_weight():
    torch.manual_seed(0)
    model = GPT()
    params, _ = fs.extract(model)
    x = _tokens(model.cfg)
    new = dict(params, **{"wte.weight": torch.randn_like(params["wte.weight"])})
    out = fs.call(model, new, x)
    model.wte.weight.data.copy_(new["wte.weight"])  # the head shares it, so both change
    assert torch.equal(out, model(x))


def test_gradients_flow_to_trainable_params_and_not_to_frozen_ones():
    torch.manual_seed(0)
    model = frozen_embedding_gpt()
    params, _ = fs.extract(model)
    assert not params["wpe.weight"].requires_grad and params["wte.weight"].requires_grad
    loss = fs.call(model, params, _tokens(model.cfg)).square().mean()
    trainable = [p for p in params.values() if p.requires_grad]
    grads = torch.autograd.grad(loss, trainable)
    ref_loss = model(_tokens(model.cfg)).square().mean()
    ref = torch.autograd.grad(ref_loss, [p for p in model.parameters() if p.requires_grad])
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_mutable_call_returns_new_batchnorm_stats_and_leaves_inputs_alone():
    torch.manual_seed(0)
    model = ConvNet().train()
    params, buffers = fs.extract(model)
    before_params, before_buffers = _snapshot(params), _snapshot(buffers)
    x = torch.randn(4, 3, 8, 8)
    out, new_buffers = fs.call(model, params, x, buffers=buffers, mutable=True)
    _assert_bitwise_equal(params, before_params)
    _assert_bitwise_equal(buffers, before_buffers)
    assert torch.equal(out, model(x))  # the module updates its own buffers in place
    _assert_bitwise_equal(new_buffers, dict(model.named_buffers()))
    assert new_buffers["features.1.num_batches_tracked"].item() == 1


def test_call_with_default_buffers_does_not_write_the_module():
    torch.manual_seed(0)
    model = ConvNet().train()
    params, _ = fs.extract(model)
    before = _snapshot(dict(model.named_buffers()))
    fs.call(model, params, torch.randn(2, 3, 8, 8))
    _assert_bitwise_equal(dict(model.named_buffers()), before)


def test_call_runs_another_method():
    torch.manual_seed(0)
    model = GPT()
    params, _ = fs.extract(model)
    new = {k: torch.randn_like(v) for k, v in params.items()}
    x = _tokens(model.cfg)[:, :4]
    out = fs.call(model, new, x, 5, method="generate")
    for k, v in new.items():
        model.get_parameter(k).data.copy_(v)
    assert torch.equal(out, model.generate(x, 5))


def test_call_names_unknown_method():
    model = GPT()
    with pytest.raises(ValueError, match="has no method 'sample'"):
        fs.call(model, fs.extract(model)[0], _tokens(model.cfg), method="sample")


def test_call_names_missing_and_unexpected_fqns():
    model = GPT()
    params, _ = fs.extract(model)
    bad = {k: v for k, v in params.items() if k != "ln_f.bias"}
    bad["blocks.9.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing 'ln_f.bias'; unexpected 'blocks.9.weight'"):
        fs.call(model, bad, _tokens(model.cfg))


def test_call_explains_a_tied_alias_passed_instead_of_the_first_fqn():
    model = GPT()
    params, _ = fs.extract(model)
    params["head.weight"] = params.pop("wte.weight")
    with pytest.raises(ValueError, match=r"'head\.weight' is tied to 'wte\.weight'"):
        fs.call(model, params, _tokens(model.cfg))


def test_call_checks_buffer_keys():
    model = ConvNet()
    params, buffers = fs.extract(model)
    buffers.pop("features.1.running_mean")
    with pytest.raises(ValueError, match=r"buffers .* missing 'features\.1\.running_mean'"):
        fs.call(model, params, torch.randn(2, 3, 8, 8), buffers=buffers)


def test_call_rejects_a_non_dict():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="params must be a dict"):
        fs.call(model, list(model.parameters()), torch.randn(1, 2))


def test_extract_of_a_meta_model_gives_meta_tensors_and_call_runs_on_meta():
    with torch.device("meta"):
        model = ConvNet()
    params, buffers = fs.extract(model)
    assert all(t.is_meta for t in (*params.values(), *buffers.values()))
    out = fs.call(model, params, torch.empty(2, 3, 8, 8, device="meta"), buffers=buffers)
    assert out.is_meta and out.shape == (2, 10)


def test_call_leaves_a_module_registered_twice_intact():
    """Regression: functional_call(tie_weights=True) left the caller's tensor in place of the
    Parameter of a module reached under two names, corrupting the user's model."""
    linear = nn.Linear(3, 3)
    model = nn.Sequential(linear, nn.Tanh(), linear)
    params, _ = fs.extract(model)
    assert list(params) == ["0.weight", "0.bias"]
    new = {k: torch.randn_like(v) for k, v in params.items()}
    x = torch.randn(2, 3)
    out = fs.call(model, new, x)
    assert isinstance(linear.weight, nn.Parameter) and linear.weight is not new["0.weight"]
    expected = torch.nn.functional.linear(
        torch.tanh(torch.nn.functional.linear(x, new["0.weight"], new["0.bias"])),
        new["0.weight"],
        new["0.bias"],
    )
    assert torch.equal(out, expected)


class _Counter(nn.Module):
    """Updates its buffers by reassignment, not in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        self.ema = 0.9 * self.ema + 0.1 * x.mean(0)
        return x


def test_mutable_call_keeps_buffers_updated_by_reassignment():
    """Regression: buffers reassigned in forward were restored before being read back."""
    model = _Counter()
    params, buffers = fs.extract(model)
    x = torch.tensor([[1.0, 3.0]])
    _, new = fs.call(model, params, x, buffers=buffers, mutable=True)
    assert new["steps"].item() == 1 and torch.allclose(new["ema"], torch.tensor([0.1, 0.3]))
    assert buffers["steps"].item() == 0 and model.steps.item() == 0
