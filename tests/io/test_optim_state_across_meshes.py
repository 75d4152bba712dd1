"""Optimizer states load on another mesh and plan whatever their leaves are (momentum-less
SGD's None entries, SGD's momentum, AdamW's moments, a reduce's carry kept beside them), or are
refused naming the leaf: saved on FSDP-2, FSDP-1, DDP-2, HSDP 2x2 and FSDP-2 under another
plan, loaded on each of the others."""

import functools

import torch
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.testing.resume import PerFlat, unsharded_moments

TARGETS = {"fsdp2": 2, "fsdp1": 1, "ddp2": 2, "hsdp": 4, "other_plan": 2}
OPTIMIZERS = ("sgd", "momentum", "adamw", "carry")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))


def _state(target: str) -> fs.ShardedState:
    model = _model()
    if target == "ddp2":
        return fs.replicate(model, fs.Mesh(replicate=2))
    if target == "other_plan":  # the whole model one unit
        return fs.shard(model, fs.plan(model), fs.Mesh(shard=2))
    mesh = fs.Mesh(replicate=2, shard=2) if target == "hsdp" else fs.Mesh(shard=TARGETS[target])
    plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
    return fs.shard(model, plan, mesh)


def _optimizer(name: str) -> fs.optim.Optimizer:
    if name == "sgd":
        return fs.optim.sgd(0.1)
    if name == "momentum":
        return fs.optim.sgd(0.1, momentum=0.9)
    return fs.optim.adamw(1e-2, weight_decay=0.1)


def _fresh(target: str, name: str, rank: int):
    state = _state(target)
    opt_state = _optimizer(name).init(state)
    if name == "carry":  # a reduce's carry kept in the optimizer state, per rank
        opt_state = (opt_state, fs.carry_zeros(state))
    return state, opt_state


def _trained(target: str, name: str, rank: int):
    """Two steps on the same fresh random batch on every rank; the carry differs per rank."""
    model, (state, opt_state) = _model(), _fresh(target, name, rank)
    opt = _optimizer(name)
    inner = opt_state[0] if name == "carry" else opt_state
    for step in range(2):
        g = torch.Generator().manual_seed(10 + step)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        _, grads = fs.value_and_grad(functools.partial(_loss, model))(state, x, y)
        updates, inner = opt.update(grads, inner, state)
        state = fs.apply_updates(state, updates)
    if name == "carry":
        g = torch.Generator().manual_seed(100 + rank)
        carry = tuple(torch.randn(c.shape, generator=g) for c in opt_state[1])
        return state, (inner, carry)
    return state, inner


def _loss(model: nn.Module, state: fs.ShardedState, x, y):
    return ((fs.call(model, state, x) - y) ** 2).mean()


def _numbers(state, opt_state, name):
    inner = opt_state[0] if name == "carry" else opt_state
    # moments per flat come as (which flats have one, values by FQN): the flats are the plan's
    # and momentum-less SGD's None entries, one per flat, are nothing
    moments = {
        k: v.values if isinstance(v, PerFlat) else v
        for k, v in unsharded_moments(state, inner).items()
        if v is not None
    }
    return fs.unshard(state), moments


def _save(root: str, targets: tuple, rank: int) -> dict:
    out = {}
    for target in targets:
        for name in OPTIMIZERS:
            state, opt_state = _trained(target, name, rank)
            fs.checkpoint.save(f"{root}/{target}-{name}", state, opt_state, step=2)
            out[target, name] = _numbers(state, opt_state, name)
            if name == "carry":
                out[target, name, "carry"] = _by_fqn(state, opt_state[1])
    return out


def _by_fqn(state: fs.ShardedState, carry: tuple) -> dict:
    """A carry's values per parameter (padding left out): comparable across plans."""
    return {
        fqn: c[offset : offset + numel].clone()
        for flat, c in zip(state.layout.flats, carry, strict=True)
        for fqn, offset, numel in zip(flat.fqns, flat.offsets, flat.numels, strict=True)
    }


def _load(root: str, target: str, sources: tuple, rank: int) -> dict:
    """Every save loaded here: its numbers, or the refusal's text (for a carry, also with
    per_rank='like')."""
    out = {}
    for source in sources:
        for name in OPTIMIZERS:
            for per_rank in ("refuse", "like") if name == "carry" else ("refuse",):
                like = _fresh(target, name, rank)
                try:
                    state, opt_state, _, _ = fs.checkpoint.load(
                        f"{root}/{source}-{name}", like=like, per_rank=per_rank
                    )
                except ValueError as e:
                    out[source, name, per_rank] = str(e)
                    continue
                out[source, name, per_rank] = _numbers(state, opt_state, name)
                if name == "carry":
                    out[source, name, per_rank, "carry"] = _by_fqn(state, opt_state[1])
    return out


def _save_and_load(root: str, rank: int) -> dict:
    """On HSDP 2x2 (the one 4-rank call): save, then load every target's save."""
    return {"saved": _save(root, ("hsdp",), rank), "loaded": _load(root, "hsdp", TARGETS, rank)}


def _shape(target: str) -> tuple:
    return {"hsdp": (2, 2), "ddp2": (2, 1), "fsdp1": (1, 1)}.get(target, (1, 2))


def test_optimizer_states_load_on_every_other_mesh_and_plan(tmp_path):
    root = str(tmp_path)
    two = ("fsdp2", "ddp2", "other_plan")  # the targets of 2 ranks: one call saves them all
    saved = {"fsdp1": testing.run(functools.partial(_save, root, ("fsdp1",)), world_size=1)}
    saved.update(dict.fromkeys(two, testing.run(functools.partial(_save, root, two), 2)))
    hsdp = testing.run(functools.partial(_save_and_load, root), world_size=4)
    saved["hsdp"] = [r["saved"] for r in hsdp]
    loaded = {"hsdp": [r["loaded"] for r in hsdp]}
    by_rank = testing.run(functools.partial(_load_each, root, two), 2)
    loaded.update({t: [r[i] for r in by_rank] for i, t in enumerate(two)})
    loaded["fsdp1"] = testing.run(functools.partial(_load, root, "fsdp1", TARGETS), 1)
    for target, ranks in loaded.items():
        for rank, results in enumerate(ranks):
            _judge(target, rank, results, saved)


def _load_each(root: str, targets: tuple, rank: int) -> tuple:
    return tuple(_load(root, t, TARGETS, rank) for t in targets)


def _judge(target: str, rank: int, results: dict, saved: dict) -> None:
    """Numbers equal the saved ones exactly; a refusal only for a per-rank carry on a mesh
    of another shape, naming it; per_rank='like' then keeps like's (zero) carry."""
    for source in TARGETS:
        for name in OPTIMIZERS:
            for per_rank in ("refuse", "like") if name == "carry" else ("refuse",):
                got = results[source, name, per_rank]
                where = f"{source} -> {target} rank {rank}, {name}, per_rank={per_rank}"
                same_shape = _shape(source) == _shape(target)
                once = source == "fsdp1"  # one rank saved it: stored once, loads anywhere
                if isinstance(got, str):
                    refusable = not same_shape and not once
                    assert name == "carry" and per_rank == "refuse" and refusable, (
                        where + ": " + got
                    )
                    assert "'optim/[1]/0.weight'" in got and "differed across ranks" in got, got
                    continue
                params, moments = saved[source][0][source, name]
                torch.testing.assert_close(got[0], params, rtol=0, atol=0, msg=where)
                torch.testing.assert_close(got[1], moments, rtol=0, atol=0, msg=where)
                if name != "carry":
                    continue
                carry = results[source, name, per_rank, "carry"]
                if once:
                    want = saved[source][0][source, name, "carry"]
                elif same_shape and per_rank == "refuse":
                    want = saved[source][rank][source, name, "carry"]
                else:
                    want = {k: torch.zeros_like(v) for k, v in carry.items()}
                torch.testing.assert_close(carry, want, rtol=0, atol=0, msg=where)
