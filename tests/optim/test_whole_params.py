"""fs.optim.whole_params and fs.optim.muon: optimizers written per whole parameter take the
steps one process takes, on FSDP, HSDP and DDP; a partition keeps torch.optim's state."""

import functools

import hypothesis.strategies as st
import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given

import funcshard as fs
from funcshard import testing
from funcshard.core import _placement as placement
from funcshard.optim._muon import orthogonalized
from funcshard.testing.compare import assert_trees_close
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

STEPS = 3
WORLD = {"fsdp": 2, "hsdp": 4, "ddp": 2}


def _config() -> GPTConfig:
    return GPTConfig(n_layer=2)


def _label(fqn: str, p: torch.Tensor) -> str:
    return "muon" if p.ndim == 2 and not fqn.startswith(("wte", "wpe")) else "adamw"


def lars(lr: float = 0.1, trust: float = 0.01) -> fs.optim.Optimizer:
    """LARS as written for one process: each parameter's step scaled by ||w|| / ||g||."""

    def init(params):
        return fs.optim.EmptyState()

    def update(grads, state, params):
        def one(g, w):
            return -lr * trust * w.norm() / (g.norm() + 1e-8) * g

        return fs.tree_map(one, grads, params), state

    return fs.optim.Optimizer(init, update)


def muon_fp32(lr: float = 0.02, momentum: float = 0.95) -> fs.optim.Optimizer:
    """A user's Muon, Newton-Schulz in float32, written for one process's dicts."""

    def init(params):
        return {f: torch.zeros_like(p) for f, p in params.items()}

    def update(grads, state, params):
        buffers = {f: state[f].lerp(g, 1 - momentum) for f, g in grads.items()}
        updates = {
            f: -lr * orthogonalized(g.lerp(buffers[f], momentum), dtype=torch.float32)
            for f, g in grads.items()
        }
        return updates, buffers

    return fs.optim.Optimizer(init, update)


def _optimizers() -> dict[str, fs.optim.Optimizer]:
    # eps 1e-3: Adam's first steps on a gradient near zero (attention's key bias) divide
    # rounding noise by itself, which a different batch split changes
    adamw_well_posed = fs.optim.adamw(3e-3, eps=1e-3, weight_decay_mask=_1d)
    groups = {"muon": fs.optim.muon(0.02), "adamw": fs.optim.adamw(3e-3)}
    return {
        "lars": fs.optim.whole_params(lars(), chunk_numel=3000),  # several chunks a step
        "muon_fp32": fs.optim.partition(
            {"muon": fs.optim.whole_params(muon_fp32()), "adamw": fs.optim.sgd(0.0)}, _label
        ),
        "muon_adamw": fs.optim.partition(groups, _label),
        # groups that reduce over their own elements: a clip by the group's norm, a skip
        "clipped_groups": fs.optim.partition(
            {
                "muon": fs.optim.chain(fs.optim.clip_by_global_norm(0.05), fs.optim.sgd(0.1)),
                "adamw": fs.optim.skip_nonfinite(adamw_well_posed),
            },
            _label,
        ),
    }


def _1d(fqn: str, p: torch.Tensor) -> bool:
    return p.ndim == 1


def _params(mesh: str, model: GPT):
    if mesh == "dict":
        return fs.extract(model)[0]
    if mesh == "ddp":
        return fs.replicate(model, fs.Mesh(replicate=2), bucket_mb=0.01)
    shape = fs.Mesh(shard=2) if mesh == "fsdp" else fs.Mesh(replicate=2, shard=2)
    return fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), shape)


def _loss(model, params, x, y):
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _state_bytes(opt_state) -> int:
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(opt_state))


def _train(mesh: str, rank: int) -> dict:
    """Every optimizer of `_optimizers`, STEPS steps each: final params and state bytes."""
    world = WORLD.get(mesh, 1)  # every rank a different slice of the batch
    out = {}
    for name, opt in _optimizers().items():
        torch.manual_seed(0)
        model = GPT(_config())
        params = _params(mesh, model)
        opt_state = opt.init(params)
        state_bytes = _state_bytes(opt_state)
        for step in range(STEPS):
            x, y = random_tokens(_config(), 4, seed=step)
            mine = x.chunk(world)[rank], y.chunk(world)[rank]
            _, grads = fs.value_and_grad(functools.partial(_loss, model))(params, *mine)
            params, opt_state = opt.step(grads, opt_state, params)
        out[name] = (dict(params if mesh == "dict" else fs.unshard(params)), state_bytes)
    return out


def _torch_muon_adamw() -> tuple[dict, int]:
    """torch.optim.Muon on the matrices and torch.optim.AdamW on the rest, one process."""
    torch.manual_seed(0)
    model = GPT(_config())
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([p for f, p in named.items() if _label(f, p) == "muon"], lr=0.02)
    adamw = torch.optim.AdamW([p for f, p in named.items() if _label(f, p) != "muon"], lr=3e-3)
    for step in range(STEPS):
        x, y = random_tokens(_config(), 4, seed=step)
        model.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        muon.step()
        adamw.step()
    states = [*muon.state.values(), *adamw.state.values()]
    nbytes = sum(t.numel() * t.element_size() for s in states for t in s.values())
    return {f: p.detach() for f, p in named.items()}, nbytes


@pytest.fixture(scope="module")
def one_process() -> dict:
    return testing.run(functools.partial(_train, "dict"), world_size=1)[0]


@pytest.mark.parametrize("mesh", ["fsdp", "hsdp", "ddp"])
def test_whole_param_optimizers_equal_one_process(mesh, one_process):
    """LARS and an fp32 Muon through whole_params, and groups that clip by their own norm,
    skip non-finite steps and mask their decay, equal the same optimizers on one process's
    params dict to 1e-5; muon + adamw in a partition is within Muon's own bf16
    noise (1e-2 relative per parameter) of torch.optim.Muon + AdamW; and the partition's
    state per rank is torch.optim's divided by the shard size (plus padding), not twice it."""
    results = testing.run(functools.partial(_train, mesh), world_size=WORLD[mesh])
    for name in ("lars", "muon_fp32", "clipped_groups"):
        for got in results:
            assert_trees_close(got[name][0], one_process[name][0], rtol=1e-5, atol=1e-6)
    reference, torch_bytes = _torch_muon_adamw()
    got, state_bytes = results[0]["muon_adamw"]
    for fqn, want in reference.items():
        error = ((got[fqn] - want).norm() / want.norm()).item()
        assert error < 1e-2, f"{fqn}: {error:.2e} relative to torch.optim.Muon + AdamW"
    shard = 1 if mesh == "ddp" else 2
    assert state_bytes <= torch_bytes / shard * 1.05 + 64, (state_bytes, torch_bytes)


def test_muon_refuses_a_vector_naming_it():
    opt = fs.optim.muon(0.02)
    with pytest.raises(ValueError, match=r"ln\.bias has shape \(4,\).*partition"):
        opt.init({"w": torch.randn(4, 3), "ln.bias": torch.randn(4)})


def test_whole_params_refuses_a_state_of_other_parameters():
    opt = fs.optim.whole_params(lars())
    params = {"a": torch.randn(3, 2), "b": torch.randn(2)}
    state = opt.init({"a": params["a"]})
    grads = {f: torch.randn_like(p) for f, p in params.items()}
    with pytest.raises(ValueError, match=r"missing 'b'"):
        opt.update(grads, state, params)
    with pytest.raises(TypeError, match=r"funcshard\.optim\.Optimizer"):
        fs.optim.whole_params(lambda g: g)


@given(numels=st.lists(st.integers(1, 10_000), min_size=1, max_size=40), size=st.integers(1, 8))
def test_owners_are_balanced_within_one_parameter(numels, size):
    """Largest-first greedy: the most and least loaded ranks differ by at most the largest
    parameter, and every parameter has exactly one owner in the group."""
    owner = placement.owners(tuple(numels), size)
    load = [sum(n for n, o in zip(numels, owner, strict=True) if o == r) for r in range(size)]
    assert all(0 <= o < size for o in owner)
    assert max(load) - min(load) <= max(numels)


def _muon_adamw() -> fs.optim.Optimizer:
    groups = {"muon": fs.optim.muon(0.02), "adamw": fs.optim.adamw(3e-3)}
    return fs.optim.partition(groups, _label)


def _as_dict(params, opt_state) -> dict:
    """Every tensor of a one-process state by path: what a bitwise comparison reads."""
    leaves = optree.tree_flatten_with_path((dict(params), opt_state))
    return {str(path): leaf for path, leaf in zip(*leaves[:2], strict=True)}


def _checkpointed(path: str, world: int, source: str | None, rank: int):
    """Train 2 steps and save (source None), or load `source` and save it again here; at
    one process, return the loaded state by path."""
    torch.manual_seed(0)
    model = GPT(_config())
    mesh = "dict" if world == 1 else "fsdp"
    params = (
        fs.shard(
            model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=world)
        )
        if mesh == "fsdp"
        else None
    )
    if world == 1:
        params = fs.shard(model, fs.plan(model), fs.Mesh(shard=1))
    opt = _muon_adamw()
    opt_state = opt.init(params)
    if source is None:
        for step in range(2):
            x, y = random_tokens(_config(), 6, seed=step)
            mine = x.chunk(world)[rank], y.chunk(world)[rank]
            _, grads = fs.value_and_grad(functools.partial(_loss, model))(params, *mine)
            params, opt_state = opt.step(grads, opt_state, params)
    else:
        params, opt_state, _, _ = fs.checkpoint.load(source, like=(params, opt_state))
    fs.checkpoint.save(path, params, opt_state, step=2)
    if world == 1:
        return _as_dict(fs.unshard(params), opt_state)
    return None


def test_muon_adamw_state_saved_at_two_ranks_loads_at_three_and_one_bitwise(tmp_path):
    """Owned Muon buffers and packed AdamW moments: saved at 2 ranks, loaded at 3 (and saved
    there), both loaded at 1 process hold the same bits."""
    first, second, alone = (str(tmp_path / n) for n in ("two", "three", "one"))
    testing.run(functools.partial(_checkpointed, first, 2, None), world_size=2)
    testing.run(functools.partial(_checkpointed, second, 3, first), world_size=3)
    direct = testing.run(functools.partial(_checkpointed, alone, 1, first), world_size=1)[0]
    via_three = testing.run(functools.partial(_checkpointed, alone, 1, second), world_size=1)[0]
    assert direct.keys() == via_three.keys()
    for key, value in direct.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, via_three[key]), key
        else:
            assert value == via_three[key], key


def _nested_partition(rank: int) -> str:
    model = GPT(_config())
    inner = fs.optim.partition({"a": fs.optim.sgd(0.1)}, lambda f, p: "a")
    outer = fs.optim.partition({"muon": inner, "adamw": fs.optim.sgd(0.1)}, _label)
    try:
        outer.init(_params("fsdp", model))
    except TypeError as e:
        return str(e)
    return "accepted"


def test_a_partition_inside_a_partition_group_is_refused_naming_the_fix():
    for error in testing.run(_nested_partition, world_size=2):
        assert "one label per inner group" in error


def _tensor_storages(tree) -> set[int]:
    """The storages of a tree's tensors of more than one element (not the step counts)."""
    leaves = optree.tree_leaves(tree)
    return {t.untyped_storage().data_ptr() for t in leaves if t.numel() > 1}


def _donated_and_kept(rank: int) -> dict:
    """Two steps of muon + adamw in a partition on FSDP-2, donated (`opt.step`) and not
    (`update`, `apply_updates`): the final parameters, and whether each donated step left
    the optimizer state in the memory it was given."""
    torch.manual_seed(0)
    model = GPT(_config())
    start = _params("fsdp", model)
    opt = _muon_adamw()
    out: dict = {"in place": []}
    for donate in (False, True):
        params, opt_state = start, opt.init(start)
        for step in range(2):
            x, y = random_tokens(_config(), 4, seed=step)
            mine = x.chunk(2)[rank], y.chunk(2)[rank]
            _, grads = fs.value_and_grad(functools.partial(_loss, model))(params, *mine)
            if donate:
                before = _tensor_storages(opt_state)
                params, opt_state = opt.step(grads, opt_state, params)
                out["in place"].append(before == _tensor_storages(opt_state))
            else:
                updates, opt_state = opt.update(grads, opt_state, params)
                params = fs.apply_updates(params, updates)
        out[donate] = dict(fs.unshard(params))
    return out


def test_a_donated_partition_steps_its_groups_in_place_to_the_same_bits():
    """Broke: `partition` did not pass donation on, so `opt.step` built each group's new
    moments (and Muon its new momentum buffers) beside the old ones: at 2 ranks the
    optimizer step peaked 10% above FSDP2 + torch.optim's whole training step."""
    for got in testing.run(_donated_and_kept, world_size=2):
        assert got["in place"] == [True, True]
        for fqn, kept in got[False].items():
            assert torch.equal(got[True][fqn], kept), fqn


def _muon_pieces_packed(rank: int) -> list[str]:
    """The Muon group's parameters whose pieces were packed into a group leaf (a copy)
    during one update of muon + adamw in a partition on FSDP-2."""
    from funcshard.core import _groups as groups

    torch.manual_seed(0)
    model = GPT(_config())
    params = _params("fsdp", model)
    opt = _muon_adamw()
    opt_state = opt.init(params)
    x, y = random_tokens(_config(), 2, seed=rank)
    _, grads = fs.value_and_grad(functools.partial(_loss, model))(params, x, y)
    packed, pack = [], groups._packed

    def counting(leaf, layout, rank, part):
        packed.extend(f for f in part.fqns if _label(f, model.get_parameter(f)) == "muon")
        return pack(leaf, layout, rank, part)

    groups._packed = counting
    try:
        opt.update(grads, opt_state, params)
    finally:
        groups._packed = pack
    return packed


def test_whole_params_in_a_partition_reads_its_pieces_unpacked():
    """Broke: the wrapper that runs an update without autograd recording asked every group
    view for its leaves to see whether they require grad, which packed the Muon group's
    gradients (a copy of the group's gradient shards) that whole_params reads unpacked."""
    assert testing.run(_muon_pieces_packed, world_size=2) == [[], []]


def test_gradients_a_whole_params_step_took_cannot_be_read_again():
    """Donated, Muon's transform writes its look-ahead into the gradient it is given (for a
    dict, the caller's tensor): reading the grads after `opt.step` must raise, not return
    those numbers."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 4, generator=g)}
    grads = {"w": torch.randn(8, 4, generator=g)}
    opt = fs.optim.muon(0.02)
    before = params["w"].clone()
    new_params, _ = opt.step(grads, opt.init(params), params)
    assert not torch.equal(new_params["w"], before)
    with pytest.raises(fs.DonatedError, match="donated"):
        grads["w"] + 1


def test_muon_on_a_dict_beside_a_frozen_base_equals_torch_muon_on_the_adapters():
    """A LoRA base (requires_grad=False, so a None gradient) beside its trained adapters in
    one process's params dict: the base keeps its state and does not move, the adapters
    step as torch.optim.Muon steps them (see [Note: a dict's entries without a gradient])."""
    torch.manual_seed(0)
    base, a, b = torch.randn(6, 5), torch.randn(2, 5) * 0.1, torch.randn(6, 2) * 0.1
    params = {"base": base.clone(), "lora_a": a.clone(), "lora_b": b.clone()}
    ours = fs.optim.muon(0.02)
    state = ours.init(params)
    theirs = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    torch_muon = torch.optim.Muon(theirs, lr=0.02)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 6, generator=g)
        trained = [params["lora_a"].requires_grad_(), params["lora_b"].requires_grad_()]
        loss = _lora_loss(params["base"], *trained, x, y)
        grads = dict(zip(("lora_a", "lora_b"), torch.autograd.grad(loss, trained), strict=True))
        updates, state = ours.update({"base": None, **grads}, state, params)
        params = fs.optim.apply_updates({k: v.detach() for k, v in params.items()}, updates)
        torch_muon.zero_grad()
        _lora_loss(base, *theirs, x, y).backward()
        torch_muon.step()
    torch.testing.assert_close(params["base"], base, rtol=0, atol=0)
    for name, want in zip(("lora_a", "lora_b"), theirs, strict=True):
        torch.testing.assert_close(params[name], want.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert set(state.states) == {"base", "lora_a", "lora_b"}


def _lora_loss(base, a, b, x, y):
    return ((x @ (base + b @ a).T - y) ** 2).mean()
