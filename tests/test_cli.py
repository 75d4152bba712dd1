"""`funcshard plan`: its estimates against a real 2-rank run, and the command itself."""

import subprocess
import sys

import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import collectives, testing
from funcshard.estimate import estimate
from funcshard.testing.models import GPT, Block, GPTConfig


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _measured(rank: int) -> dict:
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=3))
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    opt = fs.optim.adamw(1e-3)
    opt_state = opt.init(state)
    g = torch.Generator().manual_seed(rank)
    t = torch.randint(61, (2, 17), generator=g)
    with collectives.record() as log:
        _, grads = fs.value_and_grad(
            lambda s: F.cross_entropy(
                fs.call(model, s, t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()
            )
        )(state)
    sent = collectives.bytes_sent(log)
    return {
        "persistent": _bytes(state.shards)
        + _bytes(grads.shards)
        + _bytes(opt_state.exp_avg)
        + _bytes(opt_state.exp_avg_sq),
        "gathered": {f.unit: f.padded_numel * f.dtype.itemsize for f in state.layout.flats},
        "sent": sent,
        "planned": estimate(plan, 1, 2),
    }


def test_plan_estimates_equal_a_real_two_rank_step():
    for r in testing.run(_measured, world_size=2):
        planned = r["planned"]
        assert planned.persistent == r["persistent"]
        assert {u.name: u.gathered for u in planned.units} == r["gathered"]
        assert planned.sent_per_step == r["sent"]


def _plan_command(*options: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "funcshard", "plan", "funcshard.testing.models:GPT", *options]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_the_plan_command_prints_per_unit_and_total_bytes():
    out = _plan_command("--world-size", "8", "--mesh", "2x4", "--mp", "bf16")
    assert out.returncode == 0, out.stderr
    assert "mesh 2x4 (replicate x shard), units: Block" in out.stdout
    assert "blocks.0" in out.stdout and "<root>" in out.stdout
    assert "MiB held (params + grads + AdamW state)" in out.stdout


def test_the_plan_command_names_a_bad_mesh():
    out = _plan_command("--world-size", "8", "--mesh", "3x3")
    assert out.returncode != 0 and "--mesh 3x3 has 9 ranks, not 8" in out.stderr
