"""Launched by tests/test_progress.py under torchrun: after a step together, rank 1 stays in
its own code (a slow data loader, say) while rank 0 logs a metric with fs.pmean. Rank 0's
collective times out and its CollectiveError names rank 1, its last collective and that it
is in no funcshard collective (see [Note: naming the rank that is behind])."""

import time
from datetime import timedelta

import torch

import funcshard as fs

mesh = fs.Mesh.from_env(timeout=timedelta(seconds=3))
fs.pmean(torch.ones(1), mesh)
if mesh.shard_rank == 1:
    time.sleep(8)
else:
    fs.pmean(torch.ones(1), mesh)
