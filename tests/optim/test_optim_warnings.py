"""A reduction over a flat shard that mixes parameters, inside a user's optimizer update, warns
once (funcshard/optim/_mixed_reduction.py): LARS written per leaf (`w.norm() / g.norm()`) is right
on a params dict and silently wrong once sharded. Boolean reductions, per-parameter math through
`fs.optim.segments`, and funcshard's own optimizers never warn, and after the first update no
detection runs at all.

`naive_lars` and `lars` are module-level factories: tests/optim/test_check_optimizer.py hands them
to `fs.testing.check`, whose ranks unpickle them by reference.
"""

import functools
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import funcshard as fs
from funcshard import testing

LR, MOMENTUM, WEIGHT_DECAY, ETA = 0.1, 0.9, 1e-4, 0.02


@dataclass
class LarsState:
    momentum: tuple[Tensor, ...]  # one buffer per leaf of the optimizer's view


torch.utils._pytree.register_dataclass(LarsState)


def _ratio(w_norm: Tensor, g_norm: Tensor) -> Tensor:
    """LARS's trust ratio eta * |w| / (|g| + wd * |w|), 1 where either norm is zero."""
    ratio = ETA * w_norm / (g_norm + WEIGHT_DECAY * w_norm)
    return torch.where((w_norm > 0) & (g_norm > 0), ratio, 1.0)


def _lars(trust_of) -> fs.optim.Optimizer:
    """LARS with momentum; `trust_of(grads, params)` gives each leaf's trust ratios (a number
    or one per element), lined up with the grads."""

    def init(params):
        return LarsState(tuple(torch.zeros_like(w) for w in fs.optim.leaves(params)))

    def update(grads, state, params):
        leaves = zip(
            fs.optim.leaves(grads),
            fs.optim.leaves(params),
            fs.optim.leaves(trust_of(grads, params)),
            state.momentum,
            strict=True,
        )
        momentum = tuple(
            m if g is None else m.mul(MOMENTUM).add_(LR * t * (g + WEIGHT_DECAY * w))
            for g, w, t, m in leaves
        )
        return fs.tree_map(lambda g, m: -m, grads, list(momentum)), LarsState(momentum)

    return fs.optim.Optimizer(init, update)


def naive_lars() -> fs.optim.Optimizer:
    """LARS as one writes it for whole tensors: the trust ratio of each leaf's own norms."""
    return _lars(
        lambda grads, params: fs.tree_map(lambda g, w: _ratio(w.norm(), g.norm()), grads, params)
    )


def _per_parameter_trust(grads, params):
    """Each parameter's trust ratio from its norms over all of it, spread over its elements."""
    seg = fs.optim.segments(params)
    pairs = list(zip(fs.optim.leaves(grads), fs.optim.leaves(params), strict=True))
    w_sq = seg.sum([None if g is None else w.square() for g, w in pairs])
    g_sq = seg.sum([None if g is None else g.square() for g, _ in pairs])
    ratios = [
        None if w is None else _ratio(w.sqrt(), g.sqrt()) for w, g in zip(w_sq, g_sq, strict=True)
    ]
    return fs.tree_map(lambda g, t: t, grads, seg.expand(ratios))


def lars() -> fs.optim.Optimizer:
    """LARS with per-parameter trust ratios through `fs.optim.segments`: right on any mesh."""
    return _lars(_per_parameter_trust)


def _nonfinite_guard() -> fs.optim.Optimizer:
    """SGD that zeroes a leaf's update when it holds NaN or inf: a boolean reduction."""

    def update(grads, state, params):
        def step(g):
            return torch.where(g.isfinite().all(), -LR * g, torch.zeros_like(g))

        return fs.tree_map(step, grads), state

    return fs.optim.Optimizer(lambda params: (), update)


def _clipped_by_funcshard() -> fs.optim.Optimizer:
    """A user's update that calls funcshard's own whole-leaf reductions (a global norm)."""

    def update(grads, state, params):
        scale = 1.0 / (fs.global_norm(grads) + 1.0)
        return fs.tree_map(lambda g: -LR * scale * g, grads), state

    return fs.optim.Optimizer(lambda params: (), update)


def _recording_modes(optimizer: fs.optim.Optimizer, seen: list[int]) -> fs.optim.Optimizer:
    """`optimizer` inside a user's update that records how many torch function modes are on."""

    def update(grads, state, params):
        seen.append(torch._C._len_torch_function_stack())
        return optimizer.update(grads, state, params)

    return fs.optim.Optimizer(optimizer.init, update)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _state_and_grads(seed: int, mesh: fs.Mesh | None):
    """A small MLP's params (FSDP on `mesh`, one flat buffer: every parameter split over its
    ranks; a dict for None) and gradients of a fresh random batch."""
    torch.manual_seed(seed)
    model = _mlp()
    params = fs.extract(model)[0] if mesh is None else fs.shard(model, fs.plan(model), mesh)
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)

    def loss(p):
        return (fs.call(model, p, x) - y).square().mean()

    return params, fs.grad(loss)(params)


def _updates_warned(optimizers, seed: int, mesh: fs.Mesh | None) -> list[list[str]]:
    """Per optimizer, the mixed-reduction warnings of two updates (as `file:line: message`)."""
    params, grads = _state_and_grads(seed, mesh)
    out = []
    for make in optimizers:
        opt = make()
        state = opt.init(params)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                _, state = opt.update(grads, state, params)
        out.append(
            [
                f"{w.filename}:{w.lineno}: {w.message}"
                for w in caught
                if issubclass(w.category, fs.optim.MixedParameterReductionWarning)
            ]
        )
    return out


def _naive_on_fsdp(seed: int, rank: int) -> tuple[list[str], list[int], list[str]]:
    """The warnings of two naive updates and the modes on in each; a third optimizer's first
    update under an error filter for every warning but this class (raises if it leaks); the
    warnings of naive LARS as one group of a partition."""
    modes: list[int] = []
    recorded = functools.partial(_recording_modes, naive_lars(), modes)
    caught = _updates_warned([recorded], seed, fs.Mesh(shard=2))[0]
    params, grads = _state_and_grads(seed, fs.Mesh(shard=2))
    opt = naive_lars()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=fs.optim.MixedParameterReductionWarning)
        opt.update(grads, opt.init(params), params)
    grouped = functools.partial(
        fs.optim.partition,
        {"matrices": naive_lars(), "others": fs.optim.sgd(LR)},
        lambda fqn, p: "matrices" if p.dim() == 2 else "others",
    )
    return caught, modes, _updates_warned([grouped], seed, fs.Mesh(shard=2))[0]


def test_a_per_leaf_norm_on_flat_shards_warns_once_naming_the_leaf_and_whole_params():
    """LARS's `w.norm() / g.norm()` per leaf on FSDP-2 (one buffer of four parameters, each
    split over both ranks) warns on the first update only, at the line of the norm; the second
    update runs under no torch function mode at all; a filter by its class silences it; as
    one group of a `partition` it warns naming that group's parameters."""
    seed = int(torch.randint(1000, ()))
    for caught, modes, grouped in testing.run(
        functools.partial(_naive_on_fsdp, seed), world_size=2
    ):
        assert len(caught) == 1, caught
        message = caught[0]
        assert __file__ in message  # the user's line, not funcshard's
        assert "fs.optim.whole_params" in message and "fs.optim.segments" in message
        assert "norm at test_optim_warnings.py:" in message
        assert "over leaf '<root>[float32]'" in message
        assert "'0.weight', '0.bias', '2.weight', '2.bias'" in message
        assert "split over 2 ranks" in message
        assert modes == [1, 0]  # detection on for the first update, gone after it
        assert issubclass(fs.optim.MixedParameterReductionWarning, UserWarning)
        # inside a partition, the group's packed leaf of its own two parameters
        assert len(grouped) == 1 and "holds '0.weight', '2.weight', split over 2" in grouped[0]


def test_the_same_lars_on_a_params_dict_does_not_warn():
    """On a dict every leaf is one whole parameter: the per-leaf norm is right there."""
    assert _updates_warned([naive_lars, lars], int(torch.randint(1000, ())), None) == [[], []]


def _quiet_on_fsdp(seed: int, rank: int) -> list[list[str]]:
    optimizers = [
        lars,
        _nonfinite_guard,
        _clipped_by_funcshard,
        functools.partial(fs.optim.adamw, LR),
        functools.partial(fs.optim.chain, fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(LR)),
        functools.partial(fs.optim.whole_params, naive_lars()),
    ]
    return _updates_warned(optimizers, seed, fs.Mesh(shard=2))


def test_per_parameter_math_boolean_reductions_and_funcshard_optimizers_do_not_warn():
    """LARS through `fs.optim.segments`, `isfinite().all()` per leaf, a user's update calling
    `fs.global_norm`, `adamw`, `chain(clip_by_global_norm, adamw)` and the per-leaf LARS as a
    `whole_params` transform (its leaves are whole parameters), on FSDP-2."""
    seed = int(torch.randint(1000, ()))
    for caught in testing.run(functools.partial(_quiet_on_fsdp, seed), world_size=2):
        assert caught == [[]] * 6
