"""fs.optim against torch.optim on the same tensors, and its laws (pure, padding, frozen)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard as fs
from funcshard.testing.models import GPT, Block, GPTConfig

STEPS = 5


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(7, 5, generator=g), "b": torch.randn(5, generator=g)}
    grads = [
        {k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(STEPS)
    ]
    return params, grads


def _torch_run(make, params, grads):
    tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
    optimizer = make(list(tensors.values()))
    for step_grads in grads:
        for k, t in tensors.items():
            t.grad = step_grads[k].clone()
        optimizer.step()
    return {k: v.detach() for k, v in tensors.items()}


def _fs_run(opt, params, grads):
    state = opt.init(params)
    for step_grads in grads:
        updates, state = opt.update(step_grads, state, params)
        params = fs.apply_updates(params, updates)
    return params


CASES = [
    (fs.optim.sgd(0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (
        fs.optim.sgd(0.1, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    ),
    (
        fs.optim.sgd(0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    ),
    (
        fs.optim.adam(1e-2, betas=(0.8, 0.99), weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
    ),
    (
        fs.optim.adamw(3e-3, eps=1e-3, weight_decay=0.05),
        lambda p: torch.optim.AdamW(p, lr=3e-3, eps=1e-3, weight_decay=0.05),
    ),
]


@pytest.mark.parametrize(("ours", "theirs"), CASES)
@pytest.mark.quick
def test_optimizers_match_torch_optim_after_several_steps(ours, theirs):
    params, grads = _problem()
    expected = _torch_run(theirs, params, grads)
    got = _fs_run(ours, params, grads)
    for k in params:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-6, atol=1e-7)


def test_learning_rate_schedules_are_called_with_the_0_based_step():
    """As LambdaLR and optax count: the first update gets lr(0) (see test_optim_schedule.py)."""
    seen = []
    schedule = lambda step: seen.append(step) or 0.1 / (step + 1)  # noqa: E731
    params, grads = _problem()
    got = _fs_run(fs.optim.sgd(schedule), params, grads)
    assert seen == [0, 1, 2, 3, 4]
    expected = dict(params)
    for step, g in enumerate(grads):
        expected = {k: expected[k] - 0.1 / (step + 1) * g[k] for k in params}
    for k in params:
        torch.testing.assert_close(got[k], expected[k])


def test_clip_by_global_norm_matches_clip_grad_norm_and_chains():
    params, grads = _problem()
    tensors = [v.clone().requires_grad_() for v in params.values()]
    for t, g in zip(tensors, grads[0].values(), strict=True):
        t.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(tensors, max_norm=0.5)
    clipped, _ = fs.optim.clip_by_global_norm(0.5).update(grads[0], fs.optim.EmptyState(), params)
    for t, c in zip(tensors, clipped.values(), strict=True):
        torch.testing.assert_close(c, t.grad)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.sgd(1.0))
    updates, _ = opt.update(grads[0], opt.init(params), params)
    for u, c in zip(updates.values(), clipped.values(), strict=True):
        torch.testing.assert_close(u, -c)


def test_update_is_pure_and_frozen_leaves_get_no_update():
    params, grads = _problem()
    step_grads = dict(grads[0], b=None)
    opt = fs.optim.adamw(1e-2)
    state = opt.init(params)
    before = ({k: v.clone() for k, v in params.items()}, [t.clone() for t in state.exp_avg])
    updates, new_state = opt.update(step_grads, state, params)
    assert updates["b"] is None and updates["w"].ne(0).any()
    assert all(torch.equal(params[k], before[0][k]) for k in params)
    assert all(torch.equal(a, b) for a, b in zip(state.exp_avg, before[1], strict=True))
    assert new_state.step.item() == 1 and state.step.item() == 0
    new = fs.apply_updates(params, updates)
    assert torch.equal(new["b"], params["b"])


def test_bad_hyperparameters_are_named():
    with pytest.raises(ValueError, match=r"optim\.adamw: eps must be >= 0, got -1"):
        fs.optim.adamw(1e-3, eps=-1)
    with pytest.raises(TypeError, match="grads must be ShardedGrads or a dict"):
        fs.optim.sgd(0.1).update([torch.zeros(1)], fs.optim.sgd(0.1).init({}), {})


@pytest.mark.parametrize(("ours", "theirs"), CASES)
def test_donating_gives_the_same_numbers_and_writes_the_moments_in_place(ours, theirs):
    params, grads = _problem()
    kept = _fs_run(ours, params, grads)
    state = ours.init(params)
    for step_grads in grads:
        donated = {k: g.clone() for k, g in step_grads.items()}
        updates, state = ours.update(donated, state, params, donate=True)
        params = fs.apply_updates(params, updates, donate=False)
    for k in params:
        torch.testing.assert_close(params[k], kept[k], rtol=0, atol=0)


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_on_dtypes_without_a_fused_kernel_matches_torch_optim(decoupled):
    """Complex tensors take the per-leaf path, written after torch's single-tensor kernel."""
    g = torch.Generator().manual_seed(3)
    params = {"z": torch.randn(6, generator=g, dtype=torch.complex64)}
    grads = [{"z": torch.randn(6, generator=g, dtype=torch.complex64)} for _ in range(STEPS)]
    ours = (fs.optim.adamw if decoupled else fs.optim.adam)(1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW if decoupled else torch.optim.Adam
    expected = _torch_run(lambda p: theirs(p, lr=1e-2, weight_decay=0.1), params, grads)
    torch.testing.assert_close(
        _fs_run(ours, params, grads)["z"], expected["z"], rtol=1e-6, atol=1e-7
    )


def _fs_steps(opt, params, grads):
    """The same run through `Optimizer.step` (update and apply in one, everything donated)."""
    params = {k: v.clone() for k, v in params.items()}
    state = opt.init(params)
    for step_grads in grads:
        params, state = opt.step({k: g.clone() for k, g in step_grads.items()}, state, params)
    return params


@pytest.mark.parametrize(("ours", "theirs"), CASES)
def test_step_matches_torch_optim_like_update_then_apply(ours, theirs):
    params, grads = _problem(seed=3)
    expected = _torch_run(theirs, params, grads)
    for k, v in _fs_steps(ours, params, grads).items():
        torch.testing.assert_close(v, expected[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (
            fs.optim.adam(1e-2, weight_decay=0.1),
            lambda p: torch.optim.Adam(p, 1e-2, fused=True, weight_decay=0.1),
        ),
        (
            fs.optim.adamw(3e-3, eps=1e-3),
            lambda p: torch.optim.AdamW(p, 3e-3, eps=1e-3, fused=True),
        ),
    ],
)
def test_adam_step_is_torch_fused_adam_bitwise(ours, theirs):
    params, grads = _problem(seed=4)
    expected = _torch_run(theirs, params, grads)
    for k, v in _fs_steps(ours, params, grads).items():
        assert torch.equal(v, expected[k]), k


def test_a_chained_step_equals_chained_update_then_apply():
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.adamw(1e-2, eps=1e-3))
    params, grads = _problem(seed=5)
    for k, v in _fs_steps(opt, params, grads).items():
        torch.testing.assert_close(v, _fs_run(opt, params, grads)[k], rtol=1e-6, atol=1e-7)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor) and args[0].numel() > 1:
            self.names.append(str(func))  # ops on parameter-sized tensors, not step counters
        return func(*args, **(kwargs or {}))


def test_an_adamw_step_writes_the_parameters_in_place_without_materializing_updates():
    params, grads = _problem(seed=6)
    opt = fs.optim.adamw(1e-2)
    state = opt.init(params)
    before = {k: v.data_ptr() for k, v in params.items()}
    with _Ops() as ops:
        new, _ = opt.step(grads[0], state, params)
    assert {k: v.data_ptr() for k, v in new.items()} == before
    assert not [n for n in ops.names if n.startswith(("aten.sub", "aten.add"))], ops.names


def _sharded_steps(fused: bool, rank: int) -> list:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=2)
    )
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(1e-2, eps=1e-3))
    opt_state = opt.init(state)

    def loss_fn(s, x):
        return F.cross_entropy(fs.call(model, s, x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

    for step in range(3):
        x = torch.randint(61, (2, 17), generator=torch.Generator().manual_seed(10 * step + rank))
        _, grads = fs.value_and_grad(loss_fn)(state, x)
        if fused:
            old = state
            state, opt_state = opt.step(grads, opt_state, state)
            with pytest.raises(fs.DonatedError):
                fs.unshard(old)
        else:
            updates, opt_state = opt.update(grads, opt_state, state)
            state = fs.apply_updates(state, updates)
    return list(state.shards)


@pytest.mark.quick
def test_a_sharded_step_equals_update_then_apply_on_two_ranks():
    fused = fs.testing.run(functools.partial(_sharded_steps, True))
    plain = fs.testing.run(functools.partial(_sharded_steps, False))
    for a, b in zip(fused, plain, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "opt", [fs.optim.adamw(1e-2), fs.optim.sgd(0.1, momentum=0.9)], ids=["adamw", "sgd"]
)
def test_step_on_a_dict_of_parameters_that_require_grad_matches_update_then_apply(opt):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    params = dict(model.named_parameters())
    _, grads = fs.value_and_grad(lambda p: fs.call(model, p, torch.randn(2, 4)).sum())(params)
    updates, _ = opt.update(grads, opt.init(params), params)
    expected = fs.apply_updates(params, updates)
    new, _ = opt.step(grads, opt.init(params), params)
    for k, v in new.items():
        torch.testing.assert_close(v, expected[k])
        assert v.requires_grad and v.is_leaf


def test_sgd_with_dampening_starts_a_buffer_at_the_first_gradient_like_torch():
    params = {"w": torch.zeros(3)}
    grads = [{"w": None}, {"w": torch.tensor([1.0, 2.0, 3.0])}, {"w": torch.ones(3)}]
    w = torch.zeros(3, requires_grad=True)
    theirs = torch.optim.SGD([w], lr=0.1, momentum=0.9, dampening=0.5)
    for g in grads:
        w.grad = None if g["w"] is None else g["w"].clone()
        theirs.step()
    ours = fs.optim.sgd(0.1, momentum=0.9, dampening=0.5)
    state = ours.init(params)
    for g in grads:
        updates, state = ours.update(g, state, params)
        params = fs.apply_updates(params, updates)
    torch.testing.assert_close(params["w"], w.detach())


def test_hundreds_of_plain_dict_steps_build_no_autograd_history_and_hold_memory_flat():
    """The one-process loop the README offers (extract, value_and_grad, update, apply):
    each step's leaves are fresh (no grad_fn, still requiring grad), so neither history
    depth nor live tensor memory grows with the step count.

    300 steps (it was 1000): live bytes must be equal at steps 10 and 300, so one leaked
    tensor of any size in any of the 290 steps between fails it, i.e. a leak of one tensor
    every 290 steps or more often; kept history fails the grad_fn check on its first step.
    Checked by holding a reference to one step's `loss` (and, apart, one grad every 100
    steps): both fail."""
    from funcshard.testing.memory import LiveTensors

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    params, _ = fs.extract(model)
    opt = fs.optim.adamw(1e-2)
    opt_state = opt.init(params)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    step = fs.value_and_grad(lambda p: ((fs.call(model, p, x) - y) ** 2).mean())
    live = {}
    steps = 300
    with LiveTensors() as memory:
        memory.adopt((params, opt_state))
        for i in range(1, steps + 1):
            loss, grads = step(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = fs.apply_updates(params, updates)
            assert all(p.grad_fn is None and p.requires_grad for p in params.values()), i
            del loss, grads, updates
            if i in (10, steps):
                live[i] = memory.live
    assert live[steps] == live[10], live


def test_updates_that_carry_history_keep_it_for_a_differentiable_inner_step():
    w = torch.randn(3, requires_grad=True)
    lr = torch.tensor(0.1, requires_grad=True)
    (g,) = torch.autograd.grad((w**2).sum(), w, create_graph=True)
    inner = fs.apply_updates({"w": w}, {"w": -lr * g})  # MAML's inner step
    torch.autograd.grad((inner["w"] ** 2).sum(), lr)  # differentiable through the update


@pytest.mark.parametrize(
    ("ours", "theirs", "message"),
    [
        (lambda: fs.optim.adamw(1e-3, betas=(1.5, 0.999)),
         lambda p: torch.optim.AdamW(p, betas=(1.5, 0.999)),
         r"optim\.adamw: betas\[0\] must be in \[0, 1\), got 1\.5"),
        (lambda: fs.optim.adam(1e-3, betas=(0.9, 1.0)),
         lambda p: torch.optim.Adam(p, betas=(0.9, 1.0)),
         r"optim\.adam: betas\[1\] must be in \[0, 1\), got 1\.0"),
        (lambda: fs.optim.adamw(1e-3, betas=(-0.1, 0.999)),
         lambda p: torch.optim.AdamW(p, betas=(-0.1, 0.999)), r"betas\[0\] must be in \[0, 1\)"),
        (lambda: fs.optim.adamw(-1e-3), lambda p: torch.optim.AdamW(p, lr=-1e-3),
         r"optim\.adamw: lr must be >= 0"),
        (lambda: fs.optim.adam(1e-3, eps=-1e-8), lambda p: torch.optim.Adam(p, eps=-1e-8),
         r"optim\.adam: eps must be >= 0"),
        (lambda: fs.optim.adamw(1e-3, weight_decay=-0.1),
         lambda p: torch.optim.AdamW(p, weight_decay=-0.1),
         r"optim\.adamw: weight_decay must be >= 0"),
        (lambda: fs.optim.sgd(0.1, momentum=-0.9), lambda p: torch.optim.SGD(p, momentum=-0.9),
         r"optim\.sgd: momentum must be >= 0"),
        (lambda: fs.optim.sgd(0.1, weight_decay=-1), lambda p: torch.optim.SGD(p, weight_decay=-1),
         r"optim\.sgd: weight_decay must be >= 0"),
        (lambda: fs.optim.sgd(0.1, nesterov=True), lambda p: torch.optim.SGD(p, nesterov=True),
         r"optim\.sgd: nesterov=True needs momentum > 0 and dampening 0, got momentum=0\.0"),
        (lambda: fs.optim.sgd(0.1, momentum=0.9, nesterov=True, dampening=0.1),
         lambda p: torch.optim.SGD(p, momentum=0.9, nesterov=True, dampening=0.1),
         r"nesterov=True needs momentum > 0 and dampening 0, got momentum=0\.9, dampening=0\.1"),
    ],
)  # fmt: skip
def test_hyperparameters_torch_optim_refuses_are_refused_naming_them(ours, theirs, message):
    """`adamw(betas=(1.5, 0.999))` was accepted (its first moment grew 4x10^4 in 25 steps),
    as were a beta of 1 and nesterov without momentum; torch.optim refuses each."""
    with pytest.raises(ValueError):
        theirs([torch.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match=message):
        ours()


def test_betas_that_are_not_a_pair_are_named():
    with pytest.raises(TypeError, match=r"optim\.adamw: betas must be a pair \(beta1, beta2\)"):
        fs.optim.adamw(1e-3, betas=0.9)
