"""Checkpoints: save at one world size, load at another, atomic saves, clear mismatches."""

import functools
import os

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
from funcshard.io import _checkpoint as checkpoint
from funcshard.testing.models import GPT, Block, GPTConfig

CFG = GPTConfig(n_layer=2)
GLOBAL_BATCH = 6  # divides world sizes 1, 2 and 3


def _batch(step: int, world: int, rank: int):
    g = torch.Generator().manual_seed(1000 + step)
    t = torch.randint(CFG.vocab_size, (GLOBAL_BATCH, CFG.block_size + 1), generator=g)
    return t[:, :-1].chunk(world)[rank], t[:, 1:].chunk(world)[rank]


def _setup(world: int):
    with torch.device("meta"):
        model = GPT(CFG)
    state = fs.shard(
        model,
        fs.plan(model, policy=fs.policy.module_classes({Block})),
        fs.Mesh(shard=world),
        seed=0,
    )
    opt = fs.optim.adamw(1e-2, eps=1e-3)
    return model, state, opt, opt.init(state)


def _steps(model, state, opt, opt_state, steps, world, rank):
    losses = []
    for step in steps:
        x, y = _batch(step, world, rank)
        loss, grads = fs.value_and_grad(
            lambda s, x=x, y=y: F.cross_entropy(fs.call(model, s, x).flatten(0, 1), y.flatten())
        )(state)
        updates, opt_state = opt.update(grads, opt_state, state)
        state = fs.apply_updates(state, updates)
        losses.append(loss.item())
    return state, opt_state, losses


def _train_and_save(path: str, rank: int) -> dict:
    world = 2
    model, state, opt, opt_state = _setup(world)
    state, opt_state, _ = _steps(model, state, opt, opt_state, [0, 1], world, rank)
    checkpoint.save(path, state, opt_state, step=2, extra={"note": "after two steps"})
    full = {k: v.clone() for k, v in fs.unshard(state).items()}
    _, _, later = _steps(model, state, opt, opt_state, [2, 3], world, rank)
    return {"full": full, "later": later}


def _resume(path: str, world: int, rank: int) -> dict:
    model, state, opt, opt_state = _setup(world)
    state, opt_state, step, extra = checkpoint.load(path, like=(state, opt_state))
    full = fs.unshard(state)
    _, _, later = _steps(model, state, opt, opt_state, [step, step + 1], world, rank)
    padding = all(
        s[max(0, f.numel - state.layout.mesh.shard_rank * f.shard_numel) :].eq(0).all().item()
        for s, f in zip(state.shards, state.layout.flats, strict=True)
    )
    return {"full": full, "later": later, "step": step, "extra": extra, "padding": padding}


def _mean(results, key):
    return [sum(r[key][i] for r in results) / len(results) for i in range(len(results[0][key]))]


@pytest.mark.parametrize("world", [3, 1])
@pytest.mark.quick
def test_a_checkpoint_from_two_ranks_resumes_on_another_world_size(tmp_path, world):
    path = str(tmp_path / "ckpt")
    saved = testing.run(functools.partial(_train_and_save, path), world_size=2, timeout=120)
    resumed = testing.run(functools.partial(_resume, path, world), world_size=world, timeout=120)
    for r in resumed:
        assert r["step"] == 2 and r["extra"] == {"note": "after two steps"} and r["padding"]
        for k, v in saved[0]["full"].items():
            assert torch.equal(r["full"][k], v), k  # bitwise, whatever the world size
    for ours, uninterrupted in zip(_mean(resumed, "later"), _mean(saved, "later"), strict=True):
        assert ours == pytest.approx(uninterrupted, rel=1e-5)


def _killed_save(path: str, rank: int) -> dict:
    model, state, opt, opt_state = _setup(2)
    checkpoint.save(path, state, opt_state, step=1)
    state2, opt_state2, _ = _steps(model, state, opt, opt_state, [0], 2, rank)
    real = checkpoint.dcp.dcp_save

    def dies_after_writing(state_dict, directory, *rest):
        real(state_dict, directory, *rest)
        raise RuntimeError("killed while saving")

    checkpoint.dcp.dcp_save = dies_after_writing
    try:
        checkpoint.save(path, state2, opt_state2, step=2)
    except RuntimeError as e:
        error = str(e)
    finally:
        checkpoint.dcp.dcp_save = real
    loaded, _, step, _ = checkpoint.load(path, like=(state, opt_state))
    same = all(torch.equal(a, b) for a, b in zip(loaded.shards, state.shards, strict=True))
    return {"error": error, "step": step, "same": same, "dirs": sorted(os.listdir(path))}


def test_a_save_that_dies_half_way_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = str(tmp_path / "ckpt")
    r = testing.run(functools.partial(_killed_save, path), world_size=2, timeout=120)[0]
    assert r["error"] == "killed while saving"
    assert r["step"] == 1 and r["same"]
    assert any(d.startswith("step-2-") for d in r["dirs"])  # partial, never named by LATEST


def _load_into_another_model(path: str, rank: int) -> None:
    _, state, _, opt_state = _setup(2)
    checkpoint.save(path, state, opt_state, step=0)
    with torch.device("meta"):
        other = GPT(GPTConfig(n_layer=3))
    other_state = fs.shard(
        other, fs.plan(other, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=2)
    )
    checkpoint.load(path, like=(other_state, None))


def test_loading_into_another_model_names_the_keys(tmp_path):
    with pytest.raises(ValueError, match=r"missing 'params/blocks\.2\.attn\.proj\.bias'"):
        testing.run(functools.partial(_load_into_another_model, str(tmp_path / "c")), world_size=2)


def _replicate_round_trip(path: str, rank: int) -> bool:
    torch.manual_seed(0)
    model = GPT(CFG)
    state = fs.replicate(model, fs.Mesh(replicate=2), bucket_mb=0.05, first_bucket_mb=0.01)
    opt = fs.optim.sgd(0.1, momentum=0.9)
    opt_state = opt.init(state)
    checkpoint.save(path, state, opt_state)
    loaded, _, _, _ = checkpoint.load(path, like=(state, opt_state))
    return all(torch.equal(a, b) for a, b in zip(loaded.shards, state.shards, strict=True))


def test_replicated_states_save_and_load(tmp_path):
    assert all(testing.run(functools.partial(_replicate_round_trip, str(tmp_path / "r")), 2))


def _save_hsdp(path: str, rank: int) -> dict:
    with torch.device("meta"):
        model = GPT(CFG)
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    state = fs.shard(model, plan, fs.Mesh(replicate=2, shard=2), seed=7)
    checkpoint.save(path, state, step=5)
    return fs.unshard(state)


def _load_fsdp(path: str, rank: int) -> dict:
    _, state, _, _ = _setup(2)
    loaded, _, step, _ = checkpoint.load(path, like=(state, None))
    return {"full": fs.unshard(loaded), "step": step}


def test_an_hsdp_checkpoint_loads_on_a_plain_fsdp_mesh(tmp_path):
    path = str(tmp_path / "hsdp")
    saved = testing.run(functools.partial(_save_hsdp, path), world_size=4, timeout=120)[0]
    for r in testing.run(functools.partial(_load_fsdp, path), world_size=2, timeout=120):
        assert r["step"] == 5
        assert all(torch.equal(r["full"][k], v) for k, v in saved.items())


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_metadata_is_not_unpickled_beyond_checkpoint_types(tmp_path):
    """DCP reads its .metadata with plain pickle; funcshard reads it with an allowlist."""
    import pickle

    directory = tmp_path / "evil"
    directory.mkdir()
    marker = tmp_path / "pwned"
    (directory / ".metadata").write_bytes(pickle.dumps(_Exploit(str(marker))))
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load (posix|os)\.system"):
        checkpoint.dcp.dcp_sizes(str(directory))
    assert not marker.exists()


def _full_state_dict(rank: int) -> tuple:
    torch.manual_seed(0)
    model = GPT(CFG)
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=2)
    )
    sd = fs.full_state_dict(state)
    if sd is None:
        return None, None
    fresh = GPT(CFG)  # other random values
    fresh.load_state_dict(sd, strict=True)
    same = all(torch.equal(p, model.get_parameter(n)) for n, p in fresh.named_parameters())
    return list(sd) == list(model.state_dict()), same


def test_full_state_dict_loads_strictly_into_a_fresh_module_on_the_first_rank():
    (same_keys, same_values), (other, _) = testing.run(_full_state_dict, world_size=2)
    assert same_keys and same_values and other is None


def _from_state_dict(rank: int) -> bool:
    torch.manual_seed(0)
    plain = GPT(CFG)  # trained or loaded with plain PyTorch, say
    with torch.device("meta"):
        structure = GPT(CFG)
    plan = fs.plan(structure, policy=fs.policy.module_classes({Block}))
    state = fs.from_state_dict(structure, plain.state_dict(), plan, fs.Mesh(shard=2))
    full = fs.unshard(state)
    try:
        fs.from_state_dict(structure, {"wte.weight": plain.wte.weight}, plan, fs.Mesh(shard=2))
    except ValueError as e:
        error = str(e)
    return all(torch.equal(full[k], v) for k, v in plain.named_parameters()), error


def test_from_state_dict_shards_a_plain_state_dict_and_names_what_is_missing():
    for same, error in testing.run(_from_state_dict, world_size=2):
        assert same
        assert "missing 'wpe.weight', 'blocks.0.ln1.weight'" in error and "and 20 more" in error


def _resave_same_step_then_die(path: str, rank: int) -> dict:
    _, state, _, _ = _setup(2)
    checkpoint.save(path, state, step=3)
    real = checkpoint.dcp.dcp_save

    def dies(state_dict, directory, *rest):
        raise RuntimeError("killed before writing")

    checkpoint.dcp.dcp_save = dies
    try:
        checkpoint.save(path, state, step=3)  # the same step again
    except RuntimeError:
        pass
    finally:
        checkpoint.dcp.dcp_save = real
    try:
        checkpoint.save(path, state, extra={"bad": object()})  # neither JSON nor a tensor
    except TypeError as e:
        error = str(e)
    _, _, step, _ = checkpoint.load(path, like=(state, None))
    return {"step": step, "error": error}


def test_resaving_a_step_never_destroys_the_checkpoint_that_loads(tmp_path):
    """Regression: re-saving step n deleted the live step-n directory before writing."""
    for r in testing.run(functools.partial(_resave_same_step_then_die, str(tmp_path / "c")), 2):
        assert r["step"] == 3
        assert "extra['bad'] is a builtins.object" in r["error"]
