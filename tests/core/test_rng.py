"""Random streams per data-parallel rank (funcshard/core/_rng.py)."""

import functools

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import funcshard as fs
from funcshard import testing
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

SEEDS = st.integers(0, 2**63 - 1)


@given(SEEDS, st.lists(st.integers(0, 2**40), max_size=3))
def test_fold_in_is_a_seed_torch_takes_and_depends_on_every_input(seed, data):
    folded = fs.fold_in(seed, *data)
    assert 0 <= folded < 2**63 and folded == fs.fold_in(seed, *data)
    torch.manual_seed(folded)
    assert fs.fold_in(seed, *data, 0) != folded
    if data:
        assert fs.fold_in(seed, *data[:-1], data[-1] + 1) != folded
    assert fs.fold_in(seed + 1, *data) != folded


def test_fold_in_spreads_neighbouring_inputs_over_the_whole_range():
    seeds = [fs.fold_in(0, rank, step) for rank in range(8) for step in range(64)]
    assert len(set(seeds)) == len(seeds)
    high_bits = [s >> 59 for s in seeds]  # the top 4 of 63 bits: every value shows up
    assert set(high_bits) == set(range(16))


def _dropout_masks(mesh_kwargs: dict, per_rank: bool, rank: int) -> dict:
    mesh = fs.Mesh(**mesh_kwargs)

    def reseed() -> int:
        return fs.manual_seed(0, mesh, step=3) if per_rank else torch.manual_seed(0).initial_seed()

    seed = reseed()
    first = F.dropout(torch.ones(64), 0.5)
    reseed()
    again = F.dropout(torch.ones(64), 0.5)
    generated = torch.rand(4, generator=fs.rank_generator(0, mesh, step=3))
    return {
        "index": fs.rng.data_parallel_index(mesh),
        "seed": seed,
        "mask": first,
        "reproduced": torch.equal(first, again),
        "generator": generated,
    }


def test_identical_seeds_give_every_rank_the_same_dropout_mask():
    """What the README warns of: torch.manual_seed(0) on each rank is one stream, everywhere."""
    a, b = testing.run(functools.partial(_dropout_masks, {"shard": 2}, False))
    assert torch.equal(a["mask"], b["mask"])


def test_rank_seeds_give_each_rank_of_an_hsdp_mesh_its_own_reproducible_stream():
    results = testing.run(
        functools.partial(_dropout_masks, {"replicate": 2, "shard": 2}, True), world_size=4
    )
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    assert len({r["seed"] for r in results}) == 4
    assert all(r["reproduced"] for r in results)
    for i, r in enumerate(results):
        for other in results[i + 1 :]:
            assert not torch.equal(r["mask"], other["mask"])
            assert not torch.equal(r["generator"], other["generator"])
        assert r["seed"] == fs.fold_in(0, r["index"], 3)


def _dropout_training(directory: str, resume_at: int | None, rank: int) -> list[float]:
    """Three AdamW steps of a GPT with dropout, re-seeded per rank and step; with
    `resume_at`, saved there, loaded into a fresh state, and continued."""
    torch.manual_seed(0)
    mesh = fs.Mesh(shard=2)
    model = GPT(GPTConfig(n_layer=2, dropout=0.3)).train()
    state = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), mesh)
    opt = fs.optim.adamw(1e-2)
    opt_state = opt.init(state)

    def loss_fn(state, x, y):
        return F.cross_entropy(fs.call(model, state, x).flatten(0, 1), y.flatten())

    losses = []
    for step in range(3):
        if step == resume_at:
            fs.checkpoint.save(directory, state, opt_state, step=step)
            fresh = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), mesh)
            state, opt_state, step_loaded, _ = fs.checkpoint.load(
                directory, like=(fresh, opt.init(fresh))
            )
            assert step_loaded == step
        fs.manual_seed(1234, mesh, step)
        x, y = random_tokens(model.cfg, 2, seed=step)  # the same batch on both ranks
        loss, grads = fs.value_and_grad(loss_fn)(state, x, y)
        state, opt_state = opt.step(grads, opt_state, state)
        losses.append(loss.item())
    return losses


def test_a_run_resumed_from_a_checkpoint_draws_the_same_dropout_as_an_uninterrupted_one(
    tmp_path,
):
    straight = testing.run(functools.partial(_dropout_training, str(tmp_path / "a"), None))
    resumed = testing.run(functools.partial(_dropout_training, str(tmp_path / "b"), 1))
    assert straight == resumed
    ranks = straight
    assert ranks[0] != ranks[1]  # the same batch, different masks: different losses
