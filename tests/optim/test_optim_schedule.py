"""Learning-rate schedules: `lr(step)` is called once per update with the 0-based count of
updates done before it, so `fs.optim.adamw(lambda s: BASE * factor(s))` takes the steps of
`torch.optim.AdamW(lr=BASE)` with `LambdaLR(opt, factor)` stepped after each step, on a dict
of parameters and on a 2-rank FSDP state, and a run resumed from a checkpoint continues the
schedule where it stopped.

Regression: the schedule was called with 1, 2, 3, ... (one step ahead of LambdaLR and optax)
and two or more times per update.

Run: `.venv/bin/python -m pytest tests/optim/test_optim_schedule.py -q`.
"""

import functools
import math

import pytest
import torch
from torch import nn

import funcshard as fs

STEPS, BASE = 5, 1e-2


def factor(step: int) -> float:
    """Linear warmup over 2 steps, then cosine decay: a different rate at every step."""
    if step < 2:
        return (step + 1) / 3
    return 0.5 * (1 + math.cos(math.pi * (step - 2) / 4))


class Recorded:
    """`BASE * factor(step)`, recording each step it is called with."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, step: int) -> float:
        self.calls.append(step)
        return BASE * factor(step)


def _no_decay_on_vectors(fqn: str, p: torch.Tensor) -> bool:
    return p.ndim >= 2


CASES = {
    "adamw": (
        lambda lr: fs.optim.adamw(lr, eps=1e-3, weight_decay=0.05),
        lambda w, b: torch.optim.AdamW([w, b], lr=BASE, eps=1e-3, weight_decay=0.05),
    ),
    "adamw, decay masked": (
        lambda lr: fs.optim.adamw(
            lr, eps=1e-3, weight_decay=0.05, weight_decay_mask=_no_decay_on_vectors
        ),
        lambda w, b: torch.optim.AdamW(
            [{"params": [w]}, {"params": [b], "weight_decay": 0.0}],
            lr=BASE, eps=1e-3, weight_decay=0.05,
        ),
    ),
    "adam": (
        lambda lr: fs.optim.adam(lr, weight_decay=0.1),
        lambda w, b: torch.optim.Adam([w, b], lr=BASE, weight_decay=0.1),
    ),
    "sgd": (
        lambda lr: fs.optim.sgd(lr, momentum=0.9, weight_decay=0.01),
        lambda w, b: torch.optim.SGD([w, b], lr=BASE, momentum=0.9, weight_decay=0.01),
    ),
}  # fmt: skip


def _problem():
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(7, 5, generator=g), "b": torch.randn(5, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(5)]
    return params, grads


def _torch_trajectory(theirs, params: dict, grads: list) -> list[dict]:
    """torch.optim with LambdaLR stepped after each optimizer step: the params after each."""
    w, b = (params[k].clone().requires_grad_() for k in ("w", "b"))
    optimizer = theirs(w, b)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    out = []
    for step_grads in grads:
        w.grad, b.grad = step_grads["w"].clone(), step_grads["b"].clone()
        optimizer.step()
        scheduler.step()
        out.append({"w": w.detach().clone(), "b": b.detach().clone()})
    return out


@pytest.mark.parametrize("how", ["update", "step"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_schedule_on_a_dict_equals_torch_optim_with_lambda_lr_step_by_step(case, how):
    ours, theirs = CASES[case]
    params, grads = _problem()
    expected = _torch_trajectory(theirs, params, grads)
    lr = Recorded()
    opt = ours(lr)
    opt_state = opt.init(params)
    params = {k: v.clone() for k, v in params.items()}  # step() writes them in place
    for step, step_grads in enumerate(grads):
        if how == "step":
            params, opt_state = opt.step(step_grads, opt_state, params)
        else:
            updates, opt_state = opt.update(step_grads, opt_state, params)
            params = fs.apply_updates(params, updates)
        assert lr.calls == list(range(step + 1))  # once per update, from 0
        for k in params:
            torch.testing.assert_close(params[k], expected[step][k], rtol=1e-6, atol=1e-7)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)  # the same on every rank: mean of equal grads
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _reference() -> list[dict]:
    """One process: AdamW with LambdaLR, the parameters after each step."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE, eps=1e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    out = []
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
        scheduler.step()
        out.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return out


def _sharded_run(directory: str, rank: int) -> dict:
    """5 steps on 2 ranks; then 2 steps, a save, a load into fresh like, 3 more steps."""
    model = _model()
    plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))

    def fresh(lr: Recorded):
        opt = fs.optim.adamw(lr, eps=1e-3, weight_decay=0.05)
        state = fs.shard(model, plan, fs.Mesh(shard=2))
        return opt, state, opt.init(state)

    def loss_fn(s, x, y):
        return ((fs.call(model, s, x) - y) ** 2).mean()

    def steps(opt, state, opt_state, first: int, last: int, trajectory: list):
        for step in range(first, last):
            _, grads = fs.value_and_grad(loss_fn)(state, *_batch(step))
            updates, opt_state = opt.update(grads, opt_state, state)
            state = fs.apply_updates(state, updates)
            trajectory.append(fs.unshard(state))
        return state, opt_state

    whole, whole_lr = [], Recorded()
    steps(*fresh(whole_lr), 0, STEPS, whole)
    resumed, before, after = [], Recorded(), Recorded()
    opt, state, opt_state = fresh(before)
    state, opt_state = steps(opt, state, opt_state, 0, 2, resumed)
    fs.checkpoint.save(directory, state, opt_state, step=2)
    opt, like, like_opt = fresh(after)
    state, opt_state, saved_step, _ = fs.checkpoint.load(directory, like=(like, like_opt))
    steps(opt, state, opt_state, saved_step, STEPS, resumed)
    return {
        "whole": whole,
        "resumed": resumed,
        "calls": (whole_lr.calls, before.calls, after.calls),
    }


def test_a_schedule_on_a_2_rank_state_equals_lambda_lr_and_resumes_after_a_checkpoint(tmp_path):
    expected = _reference()
    results = fs.testing.run(functools.partial(_sharded_run, str(tmp_path / "ckpt")), 2)
    for result in results:
        assert result["calls"] == ([0, 1, 2, 3, 4], [0, 1], [2, 3, 4])
        for run in ("whole", "resumed"):
            for got, want in zip(result[run], expected, strict=True):
                for k in want:
                    torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
