"""Launched by tests/comm/test_failfast.py under torchrun: rank 1 raises inside `fs.fail_fast()`
while rank 0 waits in an all-reduce, both inside the usual `try: ... finally: fs.shutdown()`
(without fail_fast, rank 1 waits in shutdown for rank 0, and rank 0 out its 120 s timeout)."""

import sys
import time
from datetime import timedelta

import torch

import funcshard as fs
from funcshard.comm import _collectives as collectives

mesh = fs.Mesh.from_env(timeout=timedelta(seconds=120))
# one collective together first: rank 1 could otherwise leave while rank 0 was still
# connecting gloo's mesh, which then fails inside init_process_group, not in the all-reduce
collectives.all_reduce(torch.ones(1), mesh.shard_group, op="sum").wait()
start = time.monotonic()
try:
    with fs.fail_fast():
        try:
            if mesh.shard_rank == 1:
                raise IndexError("bad batch on rank 1")
            collectives.all_reduce(torch.ones(1), mesh.shard_group, op="sum").wait()
        except fs.CollectiveError:
            print(f"rank 0 raised after {time.monotonic() - start:.1f} s", file=sys.stderr)
            raise
finally:
    fs.shutdown()
