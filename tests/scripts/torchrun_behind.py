"""Launched by tests/comm/test_progress.py under torchrun: after a step together, rank 1 stays in
its own code (`sleep`: a slow data loader, say) or runs out of data and shuts down
(`leave`), while rank 0 logs a metric with fs.pmean. Rank 0's collective times out and its
CollectiveError names rank 1, its last collective and where it is (see [Note: naming the
rank that is behind])."""

import sys
import time
from datetime import timedelta

import torch

import funcshard as fs

mode = sys.argv[1]
mesh = fs.Mesh.from_env(timeout=timedelta(seconds=3))
fs.pmean(torch.ones(1), mesh)
if mesh.shard_rank == 0:
    fs.pmean(torch.ones(1), mesh)
elif mode == "sleep":
    time.sleep(8)
else:
    fs.shutdown(timedelta(seconds=6))  # raises: rank 0 never gets there
