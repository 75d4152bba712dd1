"""A torchrun launch shared by tests/comm's modules."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "torchrun_one_rank_only.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


@pytest.fixture(scope="session")
def two_ranks_under_torchrun(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One `torchrun --standalone --nproc-per-node=2` launch of
    tests/scripts/torchrun_one_rank_only.py, and the folder it wrote: each rank prints its
    `Mesh.from_env()` and an all-reduce's sum (test_mesh.py's check), then makes
    test_one_rank_only.py's calls on rank 0 only, writing rank<r>.json. One launch, not one
    per test: torchrun's start and its ranks' imports are most of either test's time."""
    out_dir = tmp_path_factory.mktemp("torchrun_two_ranks")
    done = subprocess.run(
        [*TORCHRUN, str(SCRIPT), str(out_dir)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return done, out_dir
