"""Launched by tests/comm/test_reliability.py under torchrun: a forced hang inside sharded work.
Both ranks gather unit 'blocks.0'; rank 0 then gathers 'blocks.1', which rank 1 skips, and
rank 1 enters an all-reduce on another group that rank 0 never joins. Each rank's collective
times out and its CollectiveError (printed by the traceback) names the last funcshard
collective that rank issued, so the two ranks' reports show where their sequences parted."""

from datetime import timedelta

import torch

import funcshard as fs
from funcshard.comm import _collectives as collectives
from funcshard.testing.models import GPT, Block, GPTConfig

mesh = fs.Mesh.from_env(timeout=timedelta(seconds=3))
other = fs.Mesh(shard=2, timeout=timedelta(seconds=4))  # a group of its own (other settings)
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2))
state = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), mesh)
try:
    fs.unshard(state, units=["blocks.0"])
    if mesh.shard_rank == 0:
        fs.unshard(state, units=["blocks.1"])
    else:
        collectives.all_reduce(torch.ones(5), other.shard_group, op="sum").wait()
finally:
    fs.shutdown(timedelta(seconds=5))
