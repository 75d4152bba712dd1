"""Launched by tests/comm/test_one_rank_only.py under torchrun: rank 0 makes a call alone
(the test module's `on_rank_0_only`, CASE: forward, save or state_dict) while rank 1 goes on
training; each rank prints the error it raised and when:
`python -m torch.distributed.run --standalone --nproc-per-node 2 THIS CASE`."""

import sys
import tempfile
from pathlib import Path

import funcshard as fs

sys.path.insert(0, str(Path(__file__).parents[1] / "comm"))
from test_one_rank_only import on_rank_0_only

mesh = fs.Mesh.from_env()
message, seconds = on_rank_0_only(sys.argv[1], tempfile.mkdtemp(), mesh.shard_rank)
one_line = message.replace("\n", " | ")
print(f"RANK {mesh.shard_rank} AFTER {seconds:.1f} s: {one_line}", flush=True)
