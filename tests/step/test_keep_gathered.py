"""`fs.keep_gathered`: units gathered once and kept across micro-batches (FSDP2's
`set_reshard_after_backward(False)`) give the gradients regathering gives, with no
collective per micro-batch."""

import functools

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
from funcshard.comm import _collectives as collectives
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

MICRO = 3


def _loss(model, state, x, y):
    return F.cross_entropy(fs.call(model, state, x).float().flatten(0, 1), y.flatten())


def _accumulated(mesh_axes: dict, mp: bool, rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    precision = fs.MixedPrecision(param_dtype=torch.bfloat16) if mp else None
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    state = fs.shard(model, plan, fs.Mesh(**mesh_axes), mp=precision)
    grad_fn = fs.value_and_grad(functools.partial(_loss, model), reduce=False)
    x, y = random_tokens(model.cfg, 2 * MICRO, seed=rank)
    out = {}
    for name in ("regathered", "kept"):
        source = fs.keep_gathered(state) if name == "kept" else state
        total = None
        with collectives.record() as log:
            for mx, my in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True):
                _, local = grad_fn(source, mx, my)
                total = local if total is None else fs.accumulate(total, local)
        size = state.layout.mesh.size
        out[name] = fs.reduce(state, total, divide_factor=size * MICRO).shards
        out[f"{name} gathers"] = sum(r.op == "all_gather" for r in log)
    kept = fs.keep_gathered(state)
    updated = fs.apply_updates(kept, fs.ShardedGrads(shards=out["kept"], layout=state.layout))
    out["updated is plain"] = type(updated) is fs.ShardedState
    return out


@pytest.mark.parametrize(
    ("mesh", "mp"), [({"shard": 2}, False), ({"shard": 2}, True), ({"replicate": 2}, False)]
)
def test_kept_units_give_the_regathered_gradients_without_gathering_per_micro_batch(mesh, mp):
    for result in testing.run(functools.partial(_accumulated, mesh, mp), world_size=2):
        for kept, regathered in zip(result["kept"], result["regathered"], strict=True):
            assert torch.equal(kept, regathered)
        assert result["kept gathers"] == 0
        assert result["regathered gathers"] >= (MICRO if mesh.get("shard") == 2 else 0)
        assert result["updated is plain"]
