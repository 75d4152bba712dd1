"""fs.optim.whole_params on owned units: each parameter already lies whole on its owner, so
the transform runs there with no collective, and Muon equals one process."""

import functools

import optree
import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
from funcshard.comm import _collectives as collectives
from funcshard.optim._muon import orthogonalized
from funcshard.testing.compare import assert_trees_close
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

STEPS = 3
LR, MOMENTUM, ADAM_LR, EPS = 0.02, 0.95, 3e-3, 1e-3  # eps: see DESIGN.md §10.4
MESHES = {"fsdp2": (None, 2), "hsdp2x2": (2, 2), "fsdp3": (None, 3), "fsdp2_bf16": (None, 2)}
# whole_params' transform: an fp32 Muon, a LARS, fs.optim.muon (torch.optim.Muon's bf16)
WHOLE = {"fsdp2": "muon", "hsdp2x2": "muon", "fsdp3": "lars", "fsdp2_bf16": "torch_muon"}


def _config() -> GPTConfig:
    return GPTConfig(n_layer=2)


def _label(fqn: str, p: torch.Tensor) -> str:
    return "muon" if p.ndim == 2 and fqn.startswith("blocks.") else "adamw"


def _lars_label(fqn: str, p: torch.Tensor) -> str:
    return "lars" if fqn.startswith("blocks.") else "adamw"


def lars(lr: float = 0.1, trust: float = 0.01) -> fs.optim.Optimizer:
    """A user's LARS, written for one process: each step scaled by ||w|| / ||g||."""

    def init(params):
        return fs.optim.EmptyState()

    def update(grads, state, params):
        def one(g, w):
            return -lr * trust * w.norm() / (g.norm() + 1e-8) * g

        return fs.tree_map(one, grads, params), state

    return fs.optim.Optimizer(init, update)


def muon_fp32() -> fs.optim.Optimizer:
    """A user's Muon, Newton-Schulz in float32, written for one process's dicts."""

    def init(params):
        return {f: torch.zeros_like(p) for f, p in params.items()}

    def update(grads, state, params):
        buffers = {f: state[f].lerp(g, 1 - MOMENTUM) for f, g in grads.items()}
        updates = {
            f: -LR * orthogonalized(g.lerp(buffers[f], MOMENTUM), dtype=torch.float32)
            for f, g in grads.items()
        }
        return updates, buffers

    return fs.optim.Optimizer(init, update)


def _optimizer(whole: str) -> fs.optim.Optimizer:
    """`whole` ("muon" or "lars") through whole_params on the blocks, AdamW on the rest."""
    adamw = fs.optim.adamw(ADAM_LR, eps=EPS)
    if whole == "lars":
        return fs.optim.partition(
            {"lars": fs.optim.whole_params(lars()), "adamw": adamw}, _lars_label
        )
    if whole == "torch_muon":
        return fs.optim.partition({"muon": fs.optim.muon(LR), "adamw": adamw}, _label)
    return fs.optim.partition({"muon": fs.optim.whole_params(muon_fp32()), "adamw": adamw}, _label)


def _loss(model, params, x, y):
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _train(mesh: str, placement: str, rank: int, offload: bool = False) -> dict:
    """Muon (whole_params) on the blocks' matrices, AdamW on the rest, STEPS steps; the
    collectives each `opt.step` issued and this rank's Muon state keys."""
    replicate, shard = MESHES[mesh]
    world = shard * (replicate or 1)
    torch.manual_seed(0)
    model = GPT(_config())
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}), placement={Block: placement})
    mesh_ = fs.Mesh(shard=shard) if replicate is None else fs.Mesh(replicate=replicate, shard=shard)
    state = fs.shard(model, plan, mesh_, offload=offload)
    opt = _optimizer(WHOLE[mesh])
    opt_state = opt.init(state)
    issued = []
    for step in range(STEPS):
        x, y = random_tokens(_config(), 12, seed=step)
        mine = x.chunk(world)[rank], y.chunk(world)[rank]
        _, grads = fs.value_and_grad(functools.partial(_loss, model))(state, *mine)
        with collectives.record() as log:
            state, opt_state = opt.step(grads, opt_state, state)
        issued.append([r.op for r in log])
    (muon_state,) = [s for s in optree_states(opt_state) if isinstance(s, fs.optim.Owned)]
    owners = {
        f: flat.owners[i]
        for flat in state.layout.flats
        if flat.owners
        for i, f in enumerate(flat.fqns)
    }
    return {
        "params": fs.unshard(state),
        "issued": issued,
        "keys": sorted(muon_state.states),
        "owned_here": sorted(
            f
            for f, o in owners.items()
            if o == state.layout.mesh.shard_rank and f in muon_state.states
        ),
        "shard_rank": state.layout.mesh.shard_rank,
    }


def optree_states(opt_state) -> list:
    """The optimizer state's leaves, each `Owned` state as one."""
    return optree.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, fs.optim.Owned))


def _one_process(whole: str) -> dict:
    torch.manual_seed(0)
    model = GPT(_config())
    params = fs.extract(model)[0]
    opt = _optimizer(whole)
    opt_state = opt.init(params)
    for step in range(STEPS):
        x, y = random_tokens(_config(), 12, seed=step)
        _, grads = fs.value_and_grad(functools.partial(_loss, model))(params, x, y)
        params, opt_state = opt.step(grads, opt_state, params)
    return dict(params)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_owned_whole_param_optimizers_step_without_collectives_and_equal_one_process(mesh):
    """An fp32 Muon (FSDP-2, HSDP 2x2) or a user's LARS (FSDP-3) through whole_params, plus
    AdamW, blocks owned: every opt.step issues no collective, each rank's Owned state holds
    exactly the parameters its shard owns, and the result equals one process to 1e-5. On
    HSDP 2x2 owned parameters are exchanged to owners over the whole mesh, as even ones
    (faster than each replica repeating its owners' math: benchmarks.muon_hsdp), each held
    by one rank of the mesh. With even blocks the same optimizer exchanges (all-to-alls) and
    agrees too. fs.optim.muon (torch.optim.Muon's bf16 Newton-Schulz, whose rounding turns
    the gradients' fp32 roundoff between a sharded and a one-process run into bf16 steps) is
    compared with the even placement on the same mesh, whose gradients are the same."""
    whole = WHOLE[mesh]
    world = MESHES[mesh][1] * (MESHES[mesh][0] or 1)
    owned = testing.run(functools.partial(_train, mesh, "owned"), world_size=world)
    if mesh.startswith("fsdp2"):
        even = testing.run(functools.partial(_train, mesh, "even"), world_size=world)
    expected = even[0]["params"] if whole == "torch_muon" else _one_process(whole)
    label = _lars_label if whole == "lars" else _label
    matrices = {
        f for f, p in expected.items() if label(f, p) == ("lars" if whole == "lars" else "muon")
    }
    held: dict[int, set] = {}
    replicas = MESHES[mesh][0] is not None
    for rank, got in enumerate(owned):
        assert_trees_close(got["params"], expected, rtol=1e-5, atol=1e-6)
        if replicas:  # HSDP: owners over the whole mesh, exchanged (see _owners.py's Note)
            assert all("all_to_all" in " ".join(ops) for ops in got["issued"])
            held[rank] = set(got["keys"])
            continue
        assert got["issued"] == [[]] * STEPS
        assert got["keys"] == got["owned_here"]
        held.setdefault(got["shard_rank"], set()).update(got["keys"])
    assert set().union(*held.values()) == matrices
    assert sum(len(k) for k in held.values()) == len(matrices)  # one owner per shard axis
    if mesh.startswith("fsdp2"):
        for got in even:
            assert_trees_close(got["params"], expected, rtol=1e-5, atol=1e-6)
            assert all("all_to_all" in " ".join(ops) for ops in got["issued"])


def _offloaded_and_even(rank: int) -> tuple[dict, dict]:
    return _train("fsdp2", "owned", rank, offload=True), _train("fsdp2", "even", rank)


def test_owned_units_offloaded_to_the_cpu_train_as_even_units():
    """CPU offload with owned blocks: the same values as the even placement without offload
    after STEPS Muon + AdamW steps (1e-5), and opt.step still issues no collective."""
    for owned, even in testing.run(_offloaded_and_even, world_size=2):
        assert_trees_close(owned["params"], even["params"], rtol=1e-5, atol=1e-6)
        assert owned["issued"] == [[]] * STEPS
