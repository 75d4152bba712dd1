"""Masks and parameter groups, the optax way, on flat shards and dicts: `adamw(weight_decay_mask=)`,
`masked`, `partition`; and a user's `(init, update)` pair without `donate` inside `chain` and
`step`."""

import functools

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
from funcshard.testing.compare import assert_trees_close
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

# eps well above the float noise on gradients that are zero in exact arithmetic (attention's
# key bias), which Adam would otherwise blow up to whole steps of either sign
STEPS, LR, WD, EPS = 5, 1e-2, 0.1, 1e-3


def matrices(fqn: str, p: torch.Tensor) -> bool:
    """Decay weight matrices; not biases, norm weights (all 1-D)."""
    return p.ndim >= 2


def embeddings(fqn: str, p: torch.Tensor) -> str:
    return "embeddings" if fqn.startswith(("wte", "wpe")) else "rest"


OPTIMIZERS = {
    "masked adamw": lambda: fs.optim.adamw(
        LR, eps=EPS, weight_decay=WD, weight_decay_mask=matrices
    ),
    "partition": lambda: fs.optim.partition(
        {
            "embeddings": fs.optim.adamw(10 * LR, eps=EPS, weight_decay=0.0),
            "rest": fs.optim.adamw(LR, eps=EPS),
        },
        embeddings,
    ),
}


def _torch_groups(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    if kind == "masked adamw":
        groups = [
            {"params": [p for f, p in named if matrices(f, p)]},
            {"params": [p for f, p in named if not matrices(f, p)], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=LR, eps=EPS, weight_decay=WD)
    groups = [
        {
            "params": [p for f, p in named if embeddings(f, p) == "embeddings"],
            "lr": 10 * LR,
            "weight_decay": 0.0,
        },
        {"params": [p for f, p in named if embeddings(f, p) == "rest"]},
    ]
    return torch.optim.AdamW(groups, lr=LR, eps=EPS)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2))


def _loss(model, params, x, y):
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _train(kind: str, mesh: str, fused: bool, rank: int) -> dict:
    model = _model()
    if mesh == "ddp":
        state = fs.replicate(model, fs.Mesh(replicate=2))
    else:
        state = fs.shard(
            model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=2)
        )
    opt = OPTIMIZERS[kind]()
    opt_state = opt.init(state)
    for step in range(STEPS):
        x, y = random_tokens(model.cfg, 4, seed=step)
        mine = x.chunk(2)[rank], y.chunk(2)[rank]
        _, grads = fs.value_and_grad(functools.partial(_loss, model))(state, *mine)
        if fused:
            state, opt_state = opt.step(grads, opt_state, state)
        else:
            updates, opt_state = opt.update(grads, opt_state, state)
            state = fs.apply_updates(state, updates)
    return fs.unshard(state)


def _reference(kind: str) -> dict:
    model = _model()
    opt = _torch_groups(kind, model)
    for step in range(STEPS):
        x, y = random_tokens(model.cfg, 4, seed=step)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    return {f: p.detach() for f, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("kind", "mesh", "fused"),
    [
        ("masked adamw", "fsdp", True),
        ("masked adamw", "fsdp", False),
        ("masked adamw", "ddp", True),
        ("partition", "fsdp", False),
        ("partition", "ddp", False),
    ],
)
def test_masks_and_groups_equal_torch_param_groups(kind, mesh, fused):
    """No decay on biases and norm weights, and a 10x learning rate for the embeddings, equal
    torch.optim.AdamW with two param groups over 5 steps on FSDP-2 and DDP-2 (the masks cut
    through flat buffers: a block's unit holds weights, biases and norms together)."""
    result = testing.run(functools.partial(_train, kind, mesh, fused), world_size=2)[0]
    assert_trees_close(result, _reference(kind), rtol=1e-6, atol=1e-6)


def test_masked_applies_a_transform_only_where_the_mask_holds():
    """On a dict: SGD with momentum on the matrices, the raw gradient elsewhere (optax.masked)."""
    model = _model()
    params, _ = fs.extract(model)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = fs.optim.masked(fs.optim.sgd(0.5), matrices)
    updates, _ = opt.update(grads, opt.init(params), params)
    for fqn, p in params.items():
        expected = -0.5 * grads[fqn] if p.ndim >= 2 else grads[fqn]
        torch.testing.assert_close(updates[fqn], expected)


def test_masks_and_labels_that_name_unknown_or_unlabelled_parameters_raise():
    params, _ = fs.extract(_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = fs.optim.adamw(LR, weight_decay_mask={"wte.weight": True, "blocks.9.bias": False})
    with pytest.raises(ValueError, match=r"'blocks\.9\.bias'.*not parameters"):
        opt.update(grads, opt.init(params), params)
    groups = fs.optim.partition({"rest": fs.optim.sgd(LR)}, embeddings)
    with pytest.raises(ValueError, match=r"wte\.weight -> 'embeddings'.*no optimizer"):
        groups.update(grads, groups.init(params), params)


def sign_sgd(lr: float) -> fs.optim.Optimizer:
    """A user's pair with the three-argument update the README documents (no `donate`)."""

    def init(params):
        return ()

    def update(grads, state, params):
        return fs.tree_map(lambda g: -lr * torch.sign(g), grads), state

    return fs.optim.Optimizer(init, update)


def test_a_user_pair_without_donate_runs_inside_chain_and_step():
    params, _ = fs.extract(_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), sign_sgd(0.1))
    new, _ = opt.step(dict(grads), opt.init(params), {k: v.clone() for k, v in params.items()})
    for fqn, p in params.items():
        torch.testing.assert_close(new[fqn], p - 0.1 * torch.sign(grads[fqn]))


def test_each_group_sees_only_its_own_gradients():
    """A global-norm clip inside one group measures that group's gradients alone."""
    params, _ = fs.extract(_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    clipped = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.sgd(1.0))
    opt = fs.optim.partition({"embeddings": clipped, "rest": fs.optim.sgd(1.0)}, embeddings)
    updates, _ = opt.update(grads, opt.init(params), params)
    mine = {k: g for k, g in grads.items() if embeddings(k, g) == "embeddings"}
    scale = 0.5 / (fs.global_norm(mine) + 1e-6)
    for fqn, g in grads.items():
        expected = -g * scale if fqn in mine else -g
        torch.testing.assert_close(updates[fqn], expected)


def _kept_bytes(kind: str, rank: int) -> tuple[int, int]:
    """Bytes a masked AdamW keeps alive across two steps beyond the state and moments (the
    state's own tensors adopted first), and the shard's elements; a model of shapes no
    other test uses, so no cache of an earlier test holds anything for it."""
    from funcshard.testing.memory import LiveTensors

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.LayerNorm(53))
    state = fs.shard(model, fs.plan(model), fs.Mesh(shard=2))
    step_fn = fs.value_and_grad(lambda s, x: fs.call(model, s, x).square().mean())
    mask = (lambda fqn, p: p.ndim >= 2) if kind == "masked" else None
    opt = fs.optim.adamw(LR, weight_decay=WD, weight_decay_mask=mask)
    opt_state, x = opt.init(state), torch.randn(4, 37)
    with LiveTensors() as live:
        live.adopt((state, opt_state))
        start = live.live
        for _ in range(2):
            _, grads = step_fn(state, x)
            state, opt_state = opt.step(grads, opt_state, state)
        del grads
        kept = live.live - start
    return kept, sum(s.numel() for s in state.shards)


def test_a_weight_decay_mask_keeps_no_per_element_tensor_between_steps():
    """issue 52: a mask is a per-parameter choice applied to slices of the shard, not a bool
    tensor and an int64 owner index per element kept across steps (17 bytes per element)."""
    masked = testing.run(functools.partial(_kept_bytes, "masked"), world_size=2)
    plain = testing.run(functools.partial(_kept_bytes, "plain"), world_size=2)
    for (kept, numel), (kept_plain, _) in zip(masked, plain, strict=True):
        assert kept - kept_plain < numel // 2, (kept, kept_plain, numel)
