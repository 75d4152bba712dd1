"""Trainable parameters that start all zero and get exactly zero gradients warn once, naming
them (see [Note: parameters stuck at zero] in funcshard/step/_zero_start.py): the LoRA trap
of adapters A and B both zero under a skip-init, without false alarms on B alone."""

import warnings

import torch
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.comm import _failures as failures


class _Lora(nn.Module):
    """A linear layer plus a rank-2 adapter B(A(x)), as peft wraps one."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.A = nn.Linear(8, 2, bias=False)
        self.B = nn.Linear(2, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.B(self.A(x))


def _peft_init(module: nn.Module) -> None:
    """peft's start: A drawn at random, B zero; the base layer its own way."""
    if isinstance(module, _Lora):
        nn.init.kaiming_uniform_(module.A.weight)
        nn.init.zeros_(module.B.weight)
    elif module.__class__ is nn.Linear and module.out_features == 8 and module.in_features == 8:
        module.reset_parameters()


def _steps(init, build: str, rank: int) -> dict:
    with torch.device("meta"):
        model = _Lora()
    if build == "replicate":
        state = fs.replicate(model, fs.Mesh(replicate=2), init=init)
    else:
        plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
        state = fs.shard(model, plan, fs.Mesh(shard=2), init=init)
    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    step = fs.value_and_grad(lambda s: (fs.call(model, s, x) - y).square().mean())
    opt = fs.optim.sgd(0.1)
    opt_state = opt.init(state)
    issued = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            before = failures.count_issued()
            _, grads = step(state)
            issued.append(failures.count_issued() - before)
            state, opt_state = opt.step(grads, opt_state, state)
    stuck = [str(w.message) for w in seen if issubclass(w.category, fs.StuckAtZeroWarning)]
    return {"stuck": stuck, "issued": issued}


def _cases(rank: int) -> dict:
    return {
        "skip": _steps("skip", "shard", rank),
        "skip ddp": _steps("skip", "replicate", rank),
        "peft": _steps(_peft_init, "shard", rank),
    }


def test_adapters_both_zero_warn_once_naming_them_and_b_alone_does_not():
    """Law: under `init="skip"` (FSDP-2 and DDP-2) the adapters A and B start zero and get
    exactly zero gradients: one StuckAtZeroWarning names both (and not the base layer, zero
    too but with gradients), on the first step only; with A random and B zero (peft's
    start) nothing warns. The check adds no collective: the first step issues as many as
    the second. Regression: nothing warned, and nothing trained."""
    for rank, r in enumerate(testing.run(_cases, world_size=2)):
        for case in ("skip", "skip ddp"):
            (message,) = r[case]["stuck"]
            assert "'A.weight'" in message and "'B.weight'" in message, (rank, case, message)
            assert "base" not in message, (rank, case, message)
            assert "init" in message, message  # the fix
        assert r["peft"]["stuck"] == [], (rank, r["peft"]["stuck"])
        for case, got in r.items():
            first, second = got["issued"]
            assert first == second > 0, (rank, case, got["issued"])
