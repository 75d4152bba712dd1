"""Launched by tests/comm/test_progress.py under torchrun with 3 ranks: after a step together,
rank 1 stays in its own code (a slow data loader, say) and rank 2 runs out of data and shuts
down, while rank 0 logs a metric with fs.pmean. Rank 0's collective times out and its
CollectiveError names rank 1 (behind, in user code) and rank 2 (left), each with where it is
(see [Note: naming the rank that is behind]). One launch for what were two (a 2-rank launch
per way of being behind)."""

import time
from datetime import timedelta

import torch

import funcshard as fs

# the launch's groups wait as long as torchrun's default: three ranks on a loaded machine can
# start seconds apart; the mesh the test times out on gets groups of its own with 3 s
fs.Mesh.from_env()
mesh = fs.Mesh(shard=3, timeout=timedelta(seconds=3))
fs.pmean(torch.ones(1), mesh)
if mesh.shard_rank == 0:
    fs.pmean(torch.ones(1), mesh)
elif mesh.shard_rank == 1:
    time.sleep(8)
else:
    fs.shutdown(timedelta(seconds=6))  # raises: rank 0 never gets there
