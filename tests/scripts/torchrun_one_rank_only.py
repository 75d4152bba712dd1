"""Launched under torchrun by tests/comm/test_one_rank_only.py's `two_ranks_under_torchrun`,
for two tests: each rank prints its `Mesh.from_env()` and the sum of an all-reduce of rank + 1
(`test_from_env_under_torchrun_shards_over_all_ranks`); then rank 0 makes each call alone in turn
(test_one_rank_only.py's `every_case`: a forward, a save, a state dict) while rank 1 goes on
training; each rank writes, per case, the error it raised and when, to OUT/rank<r>.json (a
file per rank: two processes' prints can interleave within a line):
`python -m torch.distributed.run --standalone --nproc-per-node 2 THIS OUT`."""

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import funcshard as fs

sys.path.insert(0, str(Path(__file__).parents[1] / "comm"))
from test_one_rank_only import every_case

mesh = fs.Mesh.from_env()
total = torch.tensor([mesh.shard_rank + 1.0])
dist.all_reduce(total, group=mesh.shard_group)
print(
    f"rank {dist.get_rank()}: shard {mesh.shard_rank}/{mesh.shard_size} {mesh.device} "
    f"sum {total.item():g}",
    flush=True,
)
cases = every_case(tempfile.mkdtemp(), mesh.shard_rank)
(Path(sys.argv[1]) / f"rank{mesh.shard_rank}.json").write_text(json.dumps(cases))
# stay until the other rank has reported too: it reads this rank's progress record
store = dist.distributed_c10d._get_default_store()
store.set(f"reported/{mesh.shard_rank}", "1")
store.wait([f"reported/{1 - mesh.shard_rank}"])
