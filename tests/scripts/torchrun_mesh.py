"""Launched by tests/comm/test_mesh.py under torchrun: Mesh.from_env() and one all-reduce."""

import torch
import torch.distributed as dist

import funcshard as fs

mesh = fs.Mesh.from_env()
total = torch.tensor([mesh.shard_rank + 1.0])
dist.all_reduce(total, group=mesh.shard_group)
print(
    f"rank {dist.get_rank()}: shard {mesh.shard_rank}/{mesh.shard_size} {mesh.device} "
    f"sum {total.item():g}",
    flush=True,
)
fs.shutdown()
