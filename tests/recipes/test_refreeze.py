"""Changing which parameters train between steps (`fs.refreeze`), the scenarios of FSDP2's
test_fully_shard_frozen.py where `requires_grad_` changes on a live model: checked against
torch.optim.Adam on one process, whose frozen parameters have no gradient and so no step.

torch.optim makes a parameter's state when it first steps, with its own step count at 0;
`refreeze` gives a newly trainable parameter fresh moments and Adam restarts its own count
(`AdamState.skipped_steps`), while the state's step count, which schedules read, goes on.
"""

import functools

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import testing

WORLD = 2
LR, EPS = 1e-2, 1e-3  # eps as DESIGN.md's invariant 4 advises for Adam parity
FIRST = {"1.2.weight", "2.0.weight", "2.0.bias", "2.2.weight", "2.2.bias"}  # frozen at first


def _model(frozen: set[str] = FIRST) -> nn.Sequential:
    torch.manual_seed(42)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(4)]
    )
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return model


def _newly_frozen(fqn: str, p: torch.Tensor) -> bool:
    """BitFit on block 0: its weights stop training, its biases go on."""
    return fqn.startswith("0.") and p.ndim == 2


NEWLY_TRAINABLE = ("1.2.weight", "2")  # a parameter, and a module's (all frozen so far)
AFTER = (FIRST - {"1.2.weight"} - {f for f in FIRST if f.startswith("2.")}) | {
    "0.0.weight",
    "0.2.weight",
}


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model: nn.Module, state: fs.ShardedState, x: torch.Tensor) -> torch.Tensor:
    return fs.call(model, state, x).pow(2).sum()


def _units(module: nn.Module, fqn: str, numel: int) -> bool:
    return fqn in {"0", "1", "2", "3"}


def _train(state, opt, opt_state, model, rank, steps):
    grad_fn = fs.value_and_grad(functools.partial(_loss, model))
    losses = []
    for step in steps:
        loss, grads = grad_fn(state, _batch(rank, step))
        state, opt_state = opt.step(grads, opt_state, state)
        losses.append(fs.pmean(loss.detach(), state.layout.mesh).item())
    return state, opt_state, losses


def _numel(opt_state) -> int:
    leaves = torch.utils._pytree.tree_leaves(opt_state)
    return sum(t.numel() for t in leaves if isinstance(t, torch.Tensor) and t.ndim == 1)


def _optimizer(groups: bool) -> fs.optim.Optimizer:
    """Adam, or Adam in two parameter groups (biases at twice the rate): a partition's
    groups share flat buffers, so its moments are packed leaves."""
    if not groups:
        return fs.optim.adam(LR, eps=EPS)
    groups_of = {"w": fs.optim.adam(LR, eps=EPS), "b": fs.optim.adam(2 * LR, eps=EPS)}
    return fs.optim.partition(groups_of, lambda fqn, p: "b" if fqn.endswith("bias") else "w")


def _sharded_run(replicate: bool, groups: bool, rank: int) -> dict:
    model = _model()
    if replicate:
        state = fs.replicate(model, fs.Mesh(replicate=WORLD))
    else:
        plan = fs.plan(model, policy=_units, frozen="split")
        state = fs.shard(model, plan, fs.Mesh(shard=WORLD))
    opt = _optimizer(groups)
    state, opt_state, losses = _train(state, opt, opt.init(state), model, rank, range(2))
    new_state, new_opt_state = fs.refreeze(
        state, opt_state, opt=opt, frozen=_newly_frozen, trainable=NEWLY_TRAINABLE
    )
    kept = groups or _kept(state, opt_state, new_state, new_opt_state, "3")
    out = {"kept": kept, "frozen": _frozen_of(new_state.layout)}
    if not replicate and not groups:  # the memory of a state planned with the new frozen set
        fresh_model = _model(AFTER)
        fresh = fs.shard(fresh_model, fs.plan(fresh_model, policy=_units, frozen="split"),
                         fs.Mesh(shard=WORLD))  # fmt: skip
        out["same_flats"] = fresh.layout.flats == new_state.layout.flats
        trainable = [
            sum(s.numel() for s, f in zip(st.shards, st.layout.flats, strict=True) if not f.frozen)
            for st in (new_state, fresh)
        ]
        out["trainable_numel"] = trainable
        out["moments_numel"] = [_numel(new_opt_state), _numel(opt.init(fresh))]
    new_state, _, more = _train(new_state, opt, new_opt_state, model, rank, range(2, 4))
    out["losses"] = losses + more
    out["params"] = fs.unshard(new_state)
    return out


def _kept(state, opt_state, new_state, new_opt_state, unit: str) -> bool:
    """Whether `unit`'s shards and moments are the very tensors they were."""
    old = [i for i, f in enumerate(state.layout.flats) if f.unit == unit]
    new = [i for i, f in enumerate(new_state.layout.flats) if f.unit == unit]
    return all(
        new_state.shards[j] is state.shards[i]
        and new_opt_state.exp_avg[j] is opt_state.exp_avg[i]
        and new_opt_state.exp_avg_sq[j] is opt_state.exp_avg_sq[i]
        for i, j in zip(old, new, strict=True)
    )


def _frozen_of(layout: fs.Layout) -> set[str]:
    return {f for flat in layout.flats if flat.frozen for f in flat.fqns}


def _reference(groups: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    params = dict(model.named_parameters())
    weights = [p for f, p in params.items() if not f.endswith("bias")]
    biases = [p for f, p in params.items() if f.endswith("bias")]
    opt = torch.optim.Adam(
        [{"params": weights}, {"params": biases, "lr": 2 * LR if groups else LR}], lr=LR, eps=EPS
    )
    losses = []
    for step in range(4):
        if step == 2:  # requires_grad_ between steps, as under FSDP2
            for name, p in params.items():
                if _newly_frozen(name, p):
                    p.requires_grad_(False)
                elif name == "1.2.weight" or name.startswith("2."):
                    p.requires_grad_(True)
        opt.zero_grad(set_to_none=True)
        loss = sum(model(_batch(rank, step)).pow(2).sum() for rank in range(WORLD)) / WORLD
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: p.detach() for k, p in params.items()}


def _check_parity(results: list[dict], groups: bool = False) -> None:
    losses, expected = _reference(groups)
    for out in results:
        assert out["kept"], "an unchanged unit's shards or moments were rebuilt"
        assert out["frozen"] == AFTER
        torch.testing.assert_close(out["losses"], losses, rtol=1e-5, atol=0)
        for name, p in out["params"].items():
            torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_train_mixed_requires_grad_per_group_after_init():
    """test_fully_shard_frozen.py::test_train_mixed_requires_grad_per_group with
    freeze_after_init, and ..._across_groups with unfreeze_params: after two Adam steps,
    block 0's weights freeze (BitFit), a frozen member of block 1 and the frozen block 2
    start training; FSDP on 2 ranks equals torch.optim.Adam on one process, block 3 keeps
    its very shards and moments, and the state holds what one planned with the new frozen
    set (frozen="split") holds."""
    results = testing.run(functools.partial(_sharded_run, False, False), world_size=WORLD)
    _check_parity(results)
    for out in results:
        assert out["same_flats"]
        assert out["trainable_numel"][0] == out["trainable_numel"][1]
        assert out["moments_numel"][0] == out["moments_numel"][1]


def test_train_mixed_requires_grad_per_group_after_init_replicated():
    """The same scenario under DDP (`fs.replicate`), where frozen members of a bucket get a
    flat buffer of their own."""
    _check_parity(testing.run(functools.partial(_sharded_run, True, False), world_size=WORLD))


def test_train_mixed_requires_grad_per_group_after_init_param_groups():
    """The same scenario with two parameter groups (`fs.optim.partition`, biases at twice
    the rate, torch.optim's param groups in the reference), whose moments are packed
    leaves of the groups' pieces: moved parameter by parameter too."""
    run = functools.partial(_sharded_run, False, True)
    _check_parity(testing.run(run, world_size=WORLD), groups=True)


class _MultiForward(nn.Module):
    """FSDP2's test_multi_forward_mixed_requires_grad model: units called three times a
    forward, once more each time under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.layer_0, self.layer_no_grad, self.layer_with_grad = (nn.Linear(5, 5) for _ in range(3))
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(torch.relu(self.layer_with_grad(x)))
            with torch.no_grad():
                extra = torch.relu(self.layer_with_grad(x))
            x = x + extra
        return x


MULTI_FROZEN, MULTI_TRAINABLE = ("layer_0.weight",), ("layer_no_grad",)


def _multi_batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(7 * step + rank))


def _multi_forward(path: str, rank: int) -> dict:
    model = _MultiForward()
    units = fs.policy.module_classes({nn.Linear})
    plan = fs.plan(model, policy=units, frozen="split")
    mesh = fs.Mesh(shard=WORLD)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1e3), fs.optim.adam(LR, eps=EPS))
    refreeze = functools.partial(
        fs.refreeze, opt=opt, frozen=MULTI_FROZEN, trainable=MULTI_TRAINABLE
    )
    grad_fn = fs.value_and_grad(lambda state, x: fs.call(model, state, x).sum())
    state = fs.shard(model, plan, mesh)
    opt_state = opt.init(state)
    for step in range(4):
        if step == 2:
            state, opt_state = refreeze(state, opt_state)
        _, grads = grad_fn(state, _multi_batch(rank, step))
        state, opt_state = opt.step(grads, opt_state, state)
    fs.checkpoint.save(path, state, opt_state, step=4)
    like = fs.shard(model, plan, mesh)  # a fresh start, refrozen the same way
    like_state, like_opt = refreeze(like, opt.init(like))
    loaded, loaded_opt, step, _ = fs.checkpoint.load(path, like=(like_state, like_opt))
    same = [
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for a, b in zip(
            torch.utils._pytree.tree_leaves((state, opt_state)),
            torch.utils._pytree.tree_leaves((loaded, loaded_opt)),
            strict=True,
        )
    ]
    # and into a state planned with the new frozen set: the same keys, no others
    fresh_model = _MultiForward()
    fresh_model.layer_0.weight.requires_grad_(False)
    fresh_model.layer_no_grad.requires_grad_(True)
    fresh = fs.shard(fresh_model, fs.plan(fresh_model, policy=units, frozen="split"), mesh)
    replanned, replanned_opt, _, _ = fs.checkpoint.load(path, like=(fresh, opt.init(fresh)))
    same.append(torch.equal(replanned_opt.states[1].step, opt_state.states[1].step))
    same.extend(
        torch.equal(a, b)
        for a, b in zip(fs.unshard(replanned).values(), fs.unshard(state).values(), strict=True)
    )
    loaded_ok = step == 4 and all(same) and loaded.layout == state.layout
    return {"loaded": loaded_ok, "params": fs.unshard(state)}


def _multi_forward_reference() -> dict[str, torch.Tensor]:
    model = _MultiForward()
    params = dict(model.named_parameters())
    opt = torch.optim.Adam(params.values(), lr=LR, eps=EPS)
    for step in range(4):
        if step == 2:
            params["layer_0.weight"].requires_grad_(False)
            for p in model.layer_no_grad.parameters():
                p.requires_grad_(True)
        opt.zero_grad(set_to_none=True)
        sum(model(_multi_batch(rank, step)).sum() for rank in range(WORLD)).div(WORLD).backward()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def test_multi_forward_mixed_requires_grad_refrozen_and_resumed(tmp_path):
    """test_fully_shard_frozen.py::test_multi_forward_mixed_requires_grad, refrozen after
    two steps (layer_0's weight frozen, layer_no_grad unfrozen; chained clipping and Adam):
    equal to torch.optim.Adam on one process, and a checkpoint saved afterwards loads
    bitwise into a fresh state refrozen the same way, and into one planned with the new
    frozen set."""
    expected = _multi_forward_reference()
    run = functools.partial(_multi_forward, str(tmp_path / "ckpt"))
    for out in testing.run(run, world_size=WORLD):
        assert out["loaded"]
        for name, p in out["params"].items():
            torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def _bad_inputs(rank: int) -> list[str]:
    model = _model()
    model.register_parameter("count", nn.Parameter(torch.arange(3), requires_grad=False))
    plan = fs.plan(model, policy=_units, frozen="split", ignored=["count"])
    state = fs.shard(model, plan, fs.Mesh(shard=WORLD))
    opt = fs.optim.adam(LR)
    opt_state = opt.init(state)
    errors = []
    with fs.comm.record() as records:
        for kwargs in (
            {"frozen": ["0.0.weight", "nope.weight"]},
            {"trainable": ["count"]},
            {"frozen": ["0"], "trainable": ["0.0.bias"]},
        ):
            with pytest.raises(ValueError) as error:
                fs.refreeze(state, opt_state, opt=opt, **kwargs)
            errors.append(str(error.value))
        with pytest.raises(TypeError) as error:
            fs.refreeze(state, opt_state, frozen=["0.0.weight"])
        errors.append(str(error.value))
    assert not records, "refreeze communicated before refusing its input"
    return errors


def test_refreeze_refuses_bad_input_on_every_rank_before_communicating():
    """An FQN the state lacks, a non-floating parameter made trainable, a parameter both
    frozen and trainable, an optimizer state without its optimizer: errors naming them,
    the same on every rank, before any collective."""
    first, second = testing.run(_bad_inputs, world_size=WORLD)
    assert first == second
    assert "'nope.weight'" in first[0]
    assert "'count'" in first[1] and "torch.int64" in first[1]
    assert "'0.0.bias'" in first[2]
    assert "opt=" in first[3]
