"""Page faults of reallocating a 64 MiB tensor before and after a funcshard step on the CPU,
in a process of its own (whether freed memory is kept is a setting of the whole process).
Prints one JSON line; tests/step/test_host_memory.py runs it."""

import json
import os
import resource
import tempfile

import torch
import torch.distributed as dist

import funcshard as fs
from funcshard.step import _host_memory as host_memory

NUMEL = 16 << 20  # 64 MiB of float32: 16,384 pages of 4 KiB


def faults_per_reallocation(times: int = 3) -> int:
    """The fewest page faults one allocation, fill and free of NUMEL floats took."""
    counts = []
    for _ in range(times):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(NUMEL).fill_(1.0)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(counts)


def main(store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    before = faults_per_reallocation()
    kept_before = host_memory.kept()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    state = fs.shard(model, fs.plan(model), fs.Mesh(shard=1))
    x = torch.randn(4, 8)
    fs.value_and_grad(lambda s: fs.call(model, s, x).square().mean())(state)
    result = {
        "before": before,
        "after": faults_per_reallocation(),
        "kept_before": kept_before,
        "kept": host_memory.kept(),
        "released": host_memory.release(),
    }
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        main(os.path.join(directory, "store"))
