"""Ignored parameters train: kept whole on every rank, given gradients, all-reduced as DDP's
(or left to each rank with `reduce_ignored=False`), updated by every optimizer."""

import functools

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.testing.compare import assert_trees_close

STEPS, LR, WD = 3, 1e-2, 0.1


class Tagger(nn.Module):
    """Embeddings, a position table held by the root as a bare parameter, and two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.pos = nn.Parameter(torch.randn(6, 8))
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def _model() -> Tagger:
    torch.manual_seed(0)
    return Tagger()


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(11, (rows, 6), generator=g)
    return x, torch.randint(11, (rows, 6), generator=g)


def _loss(model, params, x, y):
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _state(kind: str, model: nn.Module, world: int, **plan_options) -> fs.ShardedState:
    if kind == "ddp":
        return fs.replicate(model, fs.Mesh(replicate=world), ignored=["pos"], **plan_options)
    mesh = fs.Mesh(shard=world) if kind == "fsdp" else fs.Mesh(replicate=2, shard=world // 2)
    policy = fs.policy.module_classes({nn.Linear})
    return fs.shard(model, fs.plan(model, policy=policy, ignored=["pos"], **plan_options), mesh)


def _train(kind: str, world: int, rank: int) -> dict:
    model = _model()
    state = _state(kind, model, world)
    opt = fs.optim.adamw(LR, weight_decay=WD)
    opt_state = opt.init(state)
    grad_fn = fs.value_and_grad(lambda s, x, y: _loss(model, s, x, y))
    shapes_line_up = []
    for step in range(STEPS):
        x, y = _batch(step, 2 * world)
        _, grads = grad_fn(state, x.chunk(world)[rank], y.chunk(world)[rank])
        shapes_line_up.append(
            [None if g is None else g.shape for g in grads.leaves()]
            == [p.shape for p in state.leaves()]
            and len(optree.tree_leaves(grads)) == len(optree.tree_leaves(state))
        )
        if step == STEPS - 1:  # the last step through the tree-mapped, fused path
            state, opt_state = opt.step(grads, opt_state, state)
        else:
            updates, opt_state = opt.update(grads, opt_state, state)
            state = fs.apply_updates(state, updates)
    return {"params": fs.unshard(state), "lined_up": all(shapes_line_up)}


def _reference(world: int) -> dict[str, torch.Tensor]:
    """One process, torch.optim.AdamW, the global batch."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        x, y = _batch(step, 2 * world)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize(("kind", "world"), [("fsdp", 2), ("ddp", 2), ("hsdp", 4)])
def test_ignored_parameters_train_like_one_process(kind, world):
    """`ignored=["pos"]` on FSDP, DDP and HSDP: `pos` gets the mean gradient over every rank
    and moves as torch.optim.AdamW moves it on one process; grads line up with the state."""
    results = testing.run(functools.partial(_train, kind, world), world_size=world)
    expected = _reference(world)
    for result in results:
        assert result["lined_up"]
        assert_trees_close(result["params"], expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(results[0]["params"]["pos"], _model().pos.detach())


def _local_pos_grads(reduce_ignored: bool, rank: int) -> dict:
    model = _model()
    state = _state("fsdp", model, 2, reduce_ignored=reduce_ignored)
    x, y = _batch(0, 4)
    mine = x.chunk(2)[rank], y.chunk(2)[rank]
    _, grads = fs.value_and_grad(lambda s, x, y: _loss(model, s, x, y))(state, *mine)
    _, local = fs.value_and_grad(lambda s, x, y: _loss(model, s, x, y), reduce=False)(state, *mine)
    return {
        "pos": grads.replicated["pos"],
        "via_reduce": fs.reduce(state, local).replicated["pos"],
        "table": state.layout.reduce_replicated,
    }


def _pos_grad(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model = _model()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return model.pos.grad


@pytest.mark.parametrize("reduce_ignored", [True, False])
def test_reduce_ignored_false_leaves_each_rank_its_own_gradient(reduce_ignored):
    """By default an ignored parameter's gradient is the mean over ranks (the global batch's
    gradient), through `value_and_grad` and through `reduce=False` + `fs.reduce` alike; with
    `reduce_ignored=False` each rank keeps the gradient of its own micro-batch."""
    results = testing.run(functools.partial(_local_pos_grads, reduce_ignored), world_size=2)
    x, y = _batch(0, 4)
    for rank, result in enumerate(results):
        mine = _pos_grad(x.chunk(2)[rank], y.chunk(2)[rank])
        expected = _pos_grad(x, y) if reduce_ignored else mine
        torch.testing.assert_close(result["pos"], expected, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(result["via_reduce"], expected, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(results[0]["pos"], results[1]["pos"]) or reduce_ignored


def _frozen_pos(rank: int) -> dict:
    model = _model()
    model.pos.requires_grad_(False)
    plan = fs.plan(model, ignored=["pos"])
    state = fs.shard(model, plan, fs.Mesh(shard=1))
    _, grads = fs.value_and_grad(lambda s, x, y: _loss(model, s, x, y))(state, *_batch(0, 2))
    opt = fs.optim.adamw(LR, weight_decay=WD)
    updates, _ = opt.update(grads, opt.init(state), state)
    return {
        "frozen": plan.ignored_frozen,
        "grad": grads.replicated["pos"],
        "pos": fs.apply_updates(state, updates).replicated["pos"],
    }


def test_frozen_ignored_parameters_get_no_gradient_and_do_not_move():
    """An ignored parameter with requires_grad=False stays where it is, in grads as None."""
    (result,) = testing.run(_frozen_pos, world_size=1)
    assert result["frozen"] == ("pos",)
    assert result["grad"] is None
    assert torch.equal(result["pos"], _model().pos.detach())


def _save_or_resume(path: str, world: int, save: bool, rank: int) -> dict:
    model = _model()
    state = _state("fsdp", model, world)
    opt = fs.optim.adamw(LR, weight_decay=WD)
    opt_state = opt.init(state)
    if save:
        x, y = _batch(0, 2 * world)
        mine = x.chunk(world)[rank], y.chunk(world)[rank]
        _, grads = fs.value_and_grad(lambda s, x, y: _loss(model, s, x, y))(state, *mine)
        state, opt_state = opt.step(grads, opt_state, state)
        fs.checkpoint.save(path, state, opt_state, step=1)
    else:
        state, opt_state, _, _ = fs.checkpoint.load(path, like=(state, opt_state))
    at = len(state.layout.flats) + state.layout.replicated.index("pos")
    return {
        "pos": state.replicated["pos"],
        "m": opt_state.exp_avg[at],
        "v": opt_state.exp_avg_sq[at],
    }


def test_an_ignored_parameters_optimizer_state_is_saved_by_fqn_and_loads_at_another_size(
    tmp_path,
):
    saved = testing.run(functools.partial(_save_or_resume, str(tmp_path), 2, True), world_size=2)
    (loaded,) = testing.run(functools.partial(_save_or_resume, str(tmp_path), 1, False), 1)
    assert loaded["m"].abs().sum() > 0
    for key in ("pos", "m", "v"):
        assert torch.equal(loaded[key], saved[0][key])
