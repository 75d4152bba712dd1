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
SMALL = 8  # one of 8 x 8 + 8: below it, so each copy is checked whole by one of its holders


class _Poisoned(nn.Linear):
    """A Linear whose weight at `at` is zero and enters the output through a square root,
    whose derivative at zero is inf: one non-finite gradient element, the loss finite."""

    def forward(self, x: torch.Tensor, at: tuple[int, int] | None = None) -> torch.Tensor:
        out = super().forward(x)
        return out if at is None else out + self.weight[at].sqrt()


class _Model(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = _Poisoned(width, width)

    def forward(self, x: torch.Tensor, at: tuple[int, int] | None) -> torch.Tensor:
        return self.lin(x, at)


def _state(mesh: str, model: nn.Module) -> fs.ShardedState:
    if mesh == "ddp":
        return fs.replicate(model, fs.Mesh(replicate=2))
    plan = fs.plan(model, policy=fs.policy.module_classes({_Poisoned}))
    return fs.shard(model, plan, fs.Mesh(replicate=2, shard=2))


def _placed(layout, width: int) -> tuple[tuple[int, int], int]:
    """A weight element that lies in the second half of its shard (the piece the shard's
    second replica checks, when shards are cut), and the shard it lies in."""
    flat = next(f for f in layout.flats if "lin.weight" in f.fqns)
    offset = flat.offsets[flat.fqns.index("lin.weight")]
    for row in reversed(range(width)):
        at = offset + row * width + 3
        if at % flat.shard_numel >= flat.shard_numel // 2:
            return (row, 3), at // flat.shard_numel
    raise AssertionError("no weight element in a shard's second half")


def _one_inf(mesh: str, width: int, rank: int) -> dict:
    torch.manual_seed(0)
    model = _Model(width)
    probe = _state(mesh, model)
    at, shard = _placed(probe.layout, width)
    with torch.no_grad():
        model.lin.weight[at] = 0.0
    state = _state(mesh, model)
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(10 + rank))
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


@pytest.mark.parametrize("width", [WIDTH, SMALL])
@pytest.mark.parametrize("mesh", ["ddp", "hsdp"])
def test_a_nan_in_the_piece_another_rank_checks_is_named_alike_on_every_rank(mesh, width):
    # WIDTH: every shard is cut; SMALL: every copy is checked whole by one of its holders
    assert ((width * width + width) // 2 >= check_parts.WHOLE) == (width == WIDTH)
    task = functools.partial(_one_inf, mesh, width)
    results = testing.run(task, world_size=2 if mesh == "ddp" else 4)
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
        cut = check_parts.Parts(("x",), tuple(range(pieces)), ((pieces, 0),), (None,), ())
        got = [
            check_parts.Parts(cut.names, cut.ranks, ((pieces, i),), cut.copies, ()).of([t])[0]
            for i in range(pieces)
        ]
        assert torch.equal(torch.cat(got), t)


def test_small_leaves_are_checked_whole_by_one_holder_in_turn():
    """Below `WHOLE` elements a leaf is not cut: holder `j mod k` of leaf j checks it whole,
    the others skip it, so each small leaf is still checked exactly once."""
    small = [torch.randn(10) for _ in range(5)]
    for holders in (2, 3):
        checked = [
            check_parts.Parts(
                tuple("abcde"), tuple(range(holders)), ((holders, i),) * 5, (None,) * 5, ()
            ).of(small)
            for i in range(holders)
        ]
        for leaf, t in enumerate(small):
            by = [i for i in range(holders) if checked[i][leaf] is not None]
            assert by == [leaf % holders] and checked[by[0]][leaf] is t
