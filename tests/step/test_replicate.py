"""fs.replicate (functional DDP) against torch's DistributedDataParallel, and its buckets."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.comm import _collectives as collectives
from funcshard.testing.models import GPT, GPTConfig

STEPS = 3


def _batches(cfg: GPTConfig, rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        t = torch.randint(cfg.vocab_size, (2, cfg.block_size + 1), generator=g)
        yield t[:, :-1], t[:, 1:]


def _loss(model, params, x, y):
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _against_ddp(comm_dtype, rank: int) -> dict:
    cfg = GPTConfig(n_layer=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state = fs.replicate(
        model, fs.Mesh(replicate=2), bucket_mb=0.05, first_bucket_mb=0.01, comm_dtype=comm_dtype
    )
    opt = fs.optim.sgd(0.1, momentum=0.9)
    opt_state = opt.init(state)
    for x, y in _batches(cfg, rank):
        torch_opt.zero_grad()
        F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
        torch_opt.step()
        _, grads = fs.value_and_grad(functools.partial(_loss, model))(state, x, y)
        updates, opt_state = opt.update(grads, opt_state, state)
        state = fs.apply_updates(state, updates)
    full = fs.unshard(state)
    errors = {
        k: ((full[k] - p).abs().max() / p.abs().max()).item()
        for k, p in ddp.module.named_parameters()
    }
    return {"errors": errors, "buckets": len(state.layout.flats)}


@pytest.mark.quick
def test_replicate_matches_ddp_after_three_sgd_momentum_steps():
    for rank, r in enumerate(testing.run(functools.partial(_against_ddp, None), world_size=2)):
        assert r["buckets"] >= 3
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] < 1e-5, f"rank {rank}: {worst} off by {r['errors'][worst]:.2e}"


def test_replicate_with_bf16_communication_stays_within_bf16_tolerance():
    results = testing.run(functools.partial(_against_ddp, torch.bfloat16), world_size=2)
    for r in results:
        assert max(r["errors"].values()) < 2e-2


def _event_order(rank: int) -> list:
    cfg = GPTConfig(n_layer=3)
    torch.manual_seed(0)
    model = GPT(cfg)
    state = fs.replicate(model, fs.Mesh(replicate=2), bucket_mb=0.02, first_bucket_mb=0.005)
    x, y = next(_batches(cfg, rank))
    with collectives.record() as log:

        def mark_embedding_backward(module, args, out):
            out.register_hook(lambda g: log.append("wte backward"))

        handle = model.wte.register_forward_hook(mark_embedding_backward)
        try:
            fs.value_and_grad(functools.partial(_loss, model))(state, x, y)
        finally:
            handle.remove()
    return [e if isinstance(e, str) else e.op for e in log]


def test_the_first_bucket_is_all_reduced_before_backward_reaches_the_first_layer():
    events = testing.run(_event_order, world_size=2)[0]
    first_reduce = events.index("all_reduce")
    assert first_reduce < events.index("wte backward"), events
    assert events.count("all_reduce") >= 3  # several buckets, each on its own


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.kept = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kept(self.frozen(self.used(x)))


def _unused_and_frozen(rank: int) -> tuple:
    torch.manual_seed(0)
    model = _Unused()
    state = fs.replicate(model, fs.Mesh(replicate=2), ignored=[model.kept])
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    with collectives.record() as log:
        _, grads = fs.value_and_grad(lambda s: fs.call(model, s, x).square().sum())(state)
    names = {f.unit: g for f, g in zip(state.layout.flats, grads.shards, strict=True)}
    bucket = state.layout.flats[0]
    at = bucket.fqns.index("unused.weight")
    start = bucket.offsets[at]
    unused = [names["<bucket 0>"][start : start + bucket.numels[at]]]
    reduced = sum(r.numel for r in log if r.dtype != torch.int64)  # (not the verdict's flags)
    return (
        sorted(names),
        names["<frozen>"] is None,
        bool(unused[0].eq(0).all()) if unused else None,
        reduced,
        state.layout.replicated,
        state.buckets_table(),
    )


def test_unused_params_get_zero_grads_frozen_ones_are_not_reduced_ignored_ones_are():
    units, frozen_none, unused_zero, reduced, replicated, table = testing.run(
        _unused_and_frozen, world_size=2, timeout=30
    )[0]
    assert units == ["<bucket 0>", "<frozen>"] and frozen_none and unused_zero
    # used + unused linear in the bucket, then the ignored one on its own; frozen never travel
    assert reduced == 2 * (4 * 4 + 4) + (4 * 4 + 4)
    assert replicated == ("kept.weight", "kept.bias")
    assert "<bucket 0>" in table and "first params" in table


def _sharded_mesh(rank: int) -> None:
    fs.replicate(nn.Linear(2, 2), fs.Mesh(shard=2))


def test_replicate_needs_a_mesh_with_shard_one():
    with pytest.raises(ValueError, match=r"the mesh must have shard=1"):
        testing.run(_sharded_mesh, world_size=2)


class _ParentReads(nn.Module):
    """Reads a child's weight itself before the child runs, and then runs the child."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.b.weight)  # before b's forward: the bucket's first gather node
        return self.b(torch.tanh(self.a(h)))  # in b's forward: the bucket's later one


def _parent_reads(rank: int) -> tuple:
    torch.manual_seed(0)
    model = _ParentReads()
    state = fs.replicate(model, fs.Mesh(replicate=2), bucket_mb=1e-4, first_bucket_mb=1e-4)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(7))[2 * rank : 2 * rank + 2]
    with collectives.record() as log:
        _, grads = fs.value_and_grad(lambda s: fs.call(model, s, x).square().mean())(state)
    full = fs.unshard(state.replace(shards=grads.shards))
    # (the last all-reduce is the non-finite verdict's: see funcshard/comm/_host_rows.py)
    reductions = [r for r in log if r.op == "all_reduce" and r.dtype != torch.int64]
    return full, len(reductions), len(state.layout.flats)


def test_a_parameter_read_before_its_module_runs_still_gets_its_whole_gradient():
    """A bucket's gather is renewed when its first module starts (so its all-reduce overlaps
    backward); a read before that keeps the first node, and the two reductions add up."""
    torch.manual_seed(0)
    reference = _ParentReads()
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(7))
    reference(x).square().mean().backward()
    for full, all_reduces, buckets in testing.run(_parent_reads, world_size=2):
        for name, p in reference.named_parameters():
            torch.testing.assert_close(full[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
        assert all_reduces == buckets + 1  # b.weight's bucket reduces its two parts


class _NoReset(nn.Module):
    """A module whose own weight no `reset_parameters()` initializes."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4))
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def _init_scale(module: nn.Module) -> None:
    if isinstance(module, _NoReset):
        nn.init.normal_(module.scale, generator=None)
    elif isinstance(module, nn.Linear):
        module.reset_parameters()


def _meta_replicated_and_sharded(rank: int) -> dict:
    """One meta-built GPT and one needing `init=`, replicated and sharded under one seed,
    and one step of each in bf16."""
    with torch.device("meta"):
        gpt, custom = GPT(GPTConfig(n_layer=2)), _NoReset()
    mesh = fs.Mesh(replicate=2)
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    replicated = fs.replicate(gpt, mesh, seed=7, mp=mp)
    sharded = fs.shard(gpt, fs.plan(gpt), mesh, seed=7, mp=mp, reshard_after_forward=False)
    custom_replicated = fs.replicate(custom, mesh, seed=3, init=_init_scale)
    custom_sharded = fs.shard(custom, fs.plan(custom), mesh, seed=3, init=_init_scale)
    x, y = next(_batches(gpt.cfg, rank))
    loss = functools.partial(_loss, gpt)
    grads = [
        fs.unshard(s.replace(shards=fs.value_and_grad(loss)(s, x, y)[1].shards))
        for s in (replicated, sharded)
    ]
    return {
        "gpt": (fs.unshard(replicated), fs.unshard(sharded)),
        "custom": (fs.unshard(custom_replicated), fs.unshard(custom_sharded)),
        "grads": grads,
        "dtypes": {g.dtype for g in grads[0].values()},
    }


def test_a_meta_model_replicates_to_the_values_shard_gives_it():
    """replicate had no init= or mp=, and its StillOnMeta advice named shard's init=."""
    for r in testing.run(_meta_replicated_and_sharded, world_size=2):
        for name in ("gpt", "custom"):
            replicated, sharded = r[name]
            assert replicated.keys() == sharded.keys()
            for k in replicated:
                assert torch.equal(replicated[k], sharded[k]), f"{name}: {k} differs"
        for k, g in r["grads"][0].items():
            torch.testing.assert_close(g, r["grads"][1][k], rtol=1e-5, atol=1e-6, msg=k)
        assert r["dtypes"] == {torch.float32}


def _still_on_meta(rank: int) -> None:
    with torch.device("meta"):
        model = _NoReset()
    fs.replicate(model, fs.Mesh(replicate=2))


def _both_reduce_dtypes(rank: int) -> None:
    mp = fs.MixedPrecision(reduce_dtype=torch.float32)
    fs.replicate(nn.Linear(2, 2), fs.Mesh(replicate=2), comm_dtype=torch.bfloat16, mp=mp)


def test_replicate_errors_name_replicate_and_its_own_arguments():
    advice = r"funcshard.replicate: .*scale.*replicate\(\.\.\., init"
    with pytest.raises(RuntimeError, match=advice):
        testing.run(_still_on_meta, world_size=2)
    both = r"comm_dtype=torch.bfloat16 and mp.reduce_dtype=torch.float32"
    with pytest.raises(ValueError, match=both):
        testing.run(_both_reduce_dtypes, world_size=2)
