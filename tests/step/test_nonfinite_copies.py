"""Each copy of an all-reduced gradient checked once (see [Note: each copy checked once] in
funcshard/step/_check_parts.py): a NaN or inf in the piece of a DDP bucket or an HSDP shard
that another rank checks is still caught, and named alike on every rank.
"""

import functools
import warnings

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.step import _check_parts as check_parts

WIDTH = 192  # one Linear of 192 x 192 + 192 elements: above check_parts.WHOLE on each shard


class _Poisoned(nn.Linear):
    """A Linear whose weight at `at` is zero and enters the output through a square root,
    whose derivative at zero is inf: one non-finite gradient element, the loss finite."""

    def forward(self, x: torch.Tensor, at: tuple[int, int] | None = None) -> torch.Tensor:
        out = super().forward(x)
        return out if at is None else out + self.weight[at].sqrt()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = _Poisoned(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, at: tuple[int, int] | None) -> torch.Tensor:
        return self.lin(x, at)


def _state(mesh: str, model: nn.Module) -> fs.ShardedState:
    if mesh == "ddp":
        return fs.replicate(model, fs.Mesh(replicate=2))
    plan = fs.plan(model, policy=fs.policy.module_classes({_Poisoned}))
    return fs.shard(model, plan, fs.Mesh(replicate=2, shard=2))


def _placed(layout) -> tuple[tuple[int, int], int]:
    """A weight element that lies in the second half of its shard (the piece the shard's
    second replica checks), and the shard it lies in."""
    flat = next(f for f in layout.flats if "lin.weight" in f.fqns)
    offset = flat.offsets[flat.fqns.index("lin.weight")]
    for row in reversed(range(WIDTH)):
        at = offset + row * WIDTH + 3
        if at % flat.shard_numel >= flat.shard_numel // 2:
            return (row, 3), at // flat.shard_numel
    raise AssertionError("no weight element in a shard's second half")


def _one_inf(mesh: str, rank: int) -> dict:
    torch.manual_seed(0)
    model = _Model()
    probe = _state(mesh, model)
    at, shard = _placed(probe.layout)
    with torch.no_grad():
        model.lin.weight[at] = 0.0
    state = _state(mesh, model)
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(10 + rank))
    loss = functools.partial(lambda m, s, x, at: fs.call(m, s, x, at).square().mean(), model)
    opt = fs.optim.adamw(1e-2)
    before = {k: v.clone() for k, v in fs.unshard(state).items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the inf only on rank 0's gradient: the all-reduce puts it in every copy
        value, grads = fs.value_and_grad(loss)(state, x, at if rank == 0 else None)
        state, _ = opt.step(grads, opt.init(state), state)
    said = [str(w.message) for w in caught if w.category is fs.NonFiniteWarning]
    after = fs.unshard(state)
    return {
        "loss finite": bool(torch.isfinite(value)),
        "said": said,
        "intact": all(torch.equal(before[k], after[k]) for k in before),
        "shard": shard,
        # the element's shard holds the inf on this rank: whether the rank checks it whole
        "own copy": bool(grads.shards[0].isinf().any()),
    }


@pytest.mark.parametrize("mesh", ["ddp", "hsdp"])
def test_a_nan_in_the_piece_another_rank_checks_is_named_alike_on_every_rank(mesh):
    assert (WIDTH * WIDTH + WIDTH) // 2 >= check_parts.WHOLE  # every shard is cut
    results = testing.run(functools.partial(_one_inf, mesh), world_size=2 if mesh == "ddp" else 4)
    shard = results[0]["shard"]
    holders = [0, 1] if mesh == "ddp" else [shard, 2 + shard]  # rank = replica * 2 + shard
    unit = "'lin'" if mesh == "hsdp" else ""
    for rank, out in enumerate(results):
        assert out["loss finite"] and out["intact"], (rank, out)
        assert out["own copy"] == (rank in holders), (rank, out)
        assert len(out["said"]) == 1, (rank, out["said"])
        assert out["said"] == results[0]["said"], (rank, out["said"])
        assert "NaN or inf in gradients of unit " + unit in out["said"][0], out["said"]
        assert f"(on ranks {holders}) first" in out["said"][0], out["said"]
        assert "the loss" not in out["said"][0], out["said"]


def test_pieces_cover_every_element_once():
    t = torch.arange(float(3 * check_parts.WHOLE + 7))
    for pieces in (2, 3, 8):
        cut = check_parts.Parts(("x",), tuple(range(pieces)), ((pieces, 0),), (None,))
        got = [
            check_parts.Parts(cut.names, cut.ranks, ((pieces, i),), cut.copies).of([t])[0]
            for i in range(pieces)
        ]
        assert torch.equal(torch.cat(got), t)
