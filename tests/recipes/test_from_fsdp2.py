"""Scenarios of PyTorch's FSDP2 unit tests (test/distributed/_composable/fsdp/), each named
after the test it answers, written with funcshard's API and checked against the same
single-process arithmetic at FSDP2's tolerances.
"""

import copy
import functools

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.comm._fp16_mean import fp16_divisors

WORLD = 2


def _mlps() -> nn.Sequential:
    torch.manual_seed(42)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(3)]
    )


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(43 + rank)).half()


SCALE = 2e-4  # the loss's: many gradient elements then sit among fp16's subnormals, where a
# mean's rounding depends on when it divides (Adam's updates do not depend on the scale)


def _fp16_training(rank: int) -> dict[str, torch.Tensor]:
    model = _mlps()
    plan = fs.plan(model, policy=lambda module, name, numel: name in {"0", "1", "2"})
    state = fs.shard(
        model, plan, fs.Mesh(shard=WORLD), mp=fs.MixedPrecision(param_dtype=torch.float16)
    )
    opt = fs.optim.adam(1e-2)
    opt_state, x = opt.init(state), _inputs(rank)
    grad_fn = fs.value_and_grad(lambda state, x: fs.call(model, state, x).sum() * SCALE)
    for _ in range(10):
        _, grads = grad_fn(state, x)
        state, opt_state = opt.step(grads, opt_state, state)
    return fs.unshard(state)


def _reference_fp16_training() -> dict[str, torch.Tensor]:
    """FSDP2's reference: fp32 master weights and torch.optim.Adam, an fp16 copy computing
    each rank's gradient, their fp16 mean divided before and after the sum."""
    model = _mlps()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before, after = fp16_divisors(WORLD)
    for _ in range(10):
        grads = []
        for rank in range(WORLD):
            half = copy.deepcopy(model).half()
            (half(_inputs(rank)).sum() * SCALE).backward()
            grads.append([p.grad / before for p in half.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads, strict=True):
            p.grad = (functools.reduce(torch.add, per_rank) / after).float()
        opt.step()
    return dict(model.named_parameters())


def test_compute_dtype_fp16_means_divide_before_and_after_the_sum():
    """test_fully_shard_mixed_precision.py::test_compute_dtype, fp16 (bf16 and fp32 means
    are one "avg" reduction, as before)."""
    expected = _reference_fp16_training()
    for params in testing.run(_fp16_training, world_size=WORLD):
        for name, p in params.items():
            torch.testing.assert_close(p, expected[name].detach(), rtol=1.3e-6, atol=1e-5)


class _Patches(nn.Module):
    """A ViT's patch embedding whose parent calls `forward_features`, not forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, 32, kernel_size=4, stride=4)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_features(images).sum(dim=1)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vit, self.projector = _Patches(), nn.Linear(32, 8)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vit.forward_features(images))


def _images(rank: int) -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(7 + rank))


def _forward_method(on_meta: bool, rank: int) -> tuple[float, dict, float, dict]:
    torch.manual_seed(0)
    with torch.device("meta" if on_meta else "cpu"):
        model = _Model()
    units = fs.policy.module_classes({_Patches, nn.Linear})
    plan = fs.plan(model, policy=units, forward_methods={model.vit: "forward_features"})
    state = fs.shard(model, plan, fs.Mesh(shard=WORLD), seed=3)
    loss_fn = lambda state, x: fs.call(model, state, x).sum()  # noqa: E731
    loss, grads = fs.value_and_grad(loss_fn, reduce=False)(state, _images(rank))
    # the same model on one process, from the same values
    plain = _Model()
    plain.load_state_dict(fs.unshard(state))
    plain_loss = plain(_images(rank)).sum()
    plain_loss.backward()
    plain_grads = {k: p.grad for k, p in plain.named_parameters()}
    return loss.item(), grads.grads, plain_loss.item(), plain_grads


def test_register_fsdp_forward_method():
    """test_fully_shard_training.py::test_register_fsdp_forward_method: a unit called through
    `forward_features` is gathered for it, on CPU-built and meta-built models."""
    for on_meta in (False, True):
        for loss, grads, plain_loss, plain_grads in testing.run(
            functools.partial(_forward_method, on_meta), world_size=WORLD
        ):
            assert loss == pytest.approx(plain_loss, rel=1e-5)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-6)


def test_forward_methods_refuses_a_missing_method_and_a_module_that_is_no_unit():
    model, units = _Model(), fs.policy.module_classes({_Patches})
    for methods, words in (
        ({"vit": "encode"}, "names 'encode', which _Patches at 'vit' does not have"),
        ({"vit": "forward"}, "name methods other than forward"),
        ({"projector": "forward_features"}, "does not have as a method"),
        ({"vit.proj": "_conv_forward"}, "'vit.proj', which is not a unit's module"),
        ({"": "forward"}, "name methods other than forward"),
        ({"head": "x"}, "names 'head', which is not a module of this _Model"),
        ({nn.Linear(2, 2): "forward"}, "names a Linear module, which is not a module of"),
    ):
        with pytest.raises(ValueError, match=words):
            fs.plan(model, policy=units, forward_methods=methods)
    with pytest.raises(ValueError, match="'vit', which is not a unit's module"):
        fs.plan(model, policy=fs.policy.buckets(1.0), forward_methods={"vit": "forward_features"})


class _Shifted(nn.Module):
    """A layer whose fp32 buffer, added in bf16 compute, hands the next layer fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("shift", torch.ones(16) / 4)

    def reset_buffers(self) -> None:  # (what a meta-built model's shard writes it with)
        nn.init.constant_(self.shift, 0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.shift


def _cast_inputs_per_unit(rank: int) -> tuple[float, dict, float, dict]:
    with torch.device("meta"):
        model = nn.Sequential(_Shifted(), _Shifted(), _Shifted())
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = fs.plan(model, policy=fs.policy.module_classes({_Shifted}))
    state = fs.shard(model, plan, fs.Mesh(shard=WORLD), mp=mp, seed=5)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    loss_fn = lambda state, x: fs.call(model, state, x).float().sum()  # noqa: E731
    loss, grads = fs.value_and_grad(loss_fn, reduce=False)(state, x)
    # FSDP2's arithmetic on one process: a bf16 copy, each layer's inputs cast to bf16
    plain = nn.Sequential(_Shifted(), _Shifted(), _Shifted())
    plain.load_state_dict(fs.unshard(state), strict=False)
    plain = plain.to(torch.bfloat16)
    for layer in plain:
        layer.shift = layer.shift.float()
        layer.register_forward_pre_hook(lambda m, args: tuple(a.bfloat16() for a in args))
    plain_loss = plain(x).float().sum()
    plain_loss.backward()
    plain_grads = {k: p.grad.float() for k, p in plain.named_parameters()}
    ours = {k: g.float() for k, g in grads.grads.items()}
    return loss.item(), ours, plain_loss.item(), plain_grads


def test_meta_device_1d_init_bf16_compute_casts_each_units_inputs():
    """test_fully_shard_init.py::test_meta_device_1d_init with bf16 compute and fp32 reduce:
    an fp32 buffer added to a unit's output; the next unit casts its inputs to bf16."""
    for loss, grads, plain_loss, plain_grads in testing.run(_cast_inputs_per_unit, WORLD):
        assert loss == pytest.approx(plain_loss, rel=1e-3)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-2, atol=1e-2)


def _undeclared_method(on_meta: bool, rank: int) -> list[str]:
    with torch.device("meta" if on_meta else "cpu"):
        model = _Model()
    plan = fs.plan(model, policy=fs.policy.module_classes({_Patches, nn.Linear}))
    state = fs.shard(model, plan, fs.Mesh(shard=WORLD), seed=3)
    said = []
    for run in (
        lambda: fs.call(model, state, _images(rank)),
        lambda: fs.value_and_grad(lambda s, x: fs.call(model, s, x).sum())(state, _images(rank)),
    ):
        try:
            run()
            said.append("no error")
        except fs.UngatheredParameterError as e:
            said.append(str(e))
    return said


def test_a_unit_read_outside_its_gather_raises_naming_the_unit_and_the_method():
    """Without forward_methods the conv ran on its placeholder's meta kernel and returned an
    uninitialized tensor (losses of 1e21, zero gradients): now it raises, naming it all."""
    for on_meta in (False, True):
        for said in testing.run(functools.partial(_undeclared_method, on_meta), WORLD):
            for message in said:
                assert "read parameter 'vit.proj.weight' of unit 'vit'" in message, message
                assert "(it ran inside _Patches.forward_features)" in message, message
                assert "forward_methods={'vit': 'forward_features'}" in message, message


class _WeightNormed(nn.Module):
    """A unit whose module computes its weight in a pre-hook of its own (old weight_norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norms = nn.Linear(6, 6), []
        self.lin.register_forward_pre_hook(lambda m, args: self.norms.append(m.weight.norm()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _users_pre_hook(rank: int) -> tuple[float, float, float, float]:
    torch.manual_seed(0)
    model = nn.Sequential(_WeightNormed(), nn.Tanh(), nn.Linear(6, 2))
    state = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({nn.Linear})),
                     fs.Mesh(shard=WORLD))  # fmt: skip
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
    ours = fs.call(model, state, x).sum().item()
    read, model[0].norms[:] = model[0].norms[0].item(), []
    return ours, model(x).sum().item(), read, model[0].norms[0].item()


def test_funcshards_gather_runs_before_a_users_own_pre_hook_on_the_unit():
    for ours, plain, read, plain_read in testing.run(_users_pre_hook, WORLD):
        assert ours == pytest.approx(plain, rel=1e-6)
        assert read == pytest.approx(plain_read, rel=1e-6)  # the hook saw the real weight


def _from_rank0(rank: int) -> dict:
    from funcshard.testing.models import GPT, Block, GPTConfig

    cfg = GPTConfig(n_layer=2)
    torch.manual_seed(0)
    plain = GPT(cfg)  # what rank 0 loaded from disk, say
    expected = plain.state_dict()
    with torch.device("meta"):
        structure = GPT(cfg)
    plan = fs.plan(structure, policy=fs.policy.module_classes({Block}))
    out = {}
    for name, model in (("meta-built", structure), ("CPU-built, other values", GPT(cfg))):
        given = expected if rank == 0 else None
        state = fs.from_state_dict(model, given, plan, fs.Mesh(shard=WORLD), from_rank=0)
        full, buffers = fs.unshard(state), state.buffers
        out[name] = all(torch.equal(full[k], v) for k, v in plain.named_parameters()) and all(
            torch.equal(buffers[k], v) for k, v in plain.named_buffers()
        )
    try:  # a wrong dict on rank 0: the same error on every rank, before any weight moves
        bad = {"wte.weight": plain.wte.weight} if rank == 0 else None
        fs.from_state_dict(structure, bad, plan, fs.Mesh(shard=WORLD), from_rank=0)
        out["error"] = "no error"
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_set_model_state_dict_broadcast_from_rank0():
    """test_fully_shard_state_dict.py's broadcast_from_rank0 load: the full dict on rank 0
    alone, sharded on every rank equal to it (meta- and CPU-built models)."""
    for out in testing.run(_from_rank0, WORLD):
        assert out["meta-built"] and out["CPU-built, other values"], out
        assert "missing 'wpe.weight', 'blocks.0.ln1.weight'" in out["error"], out["error"]
