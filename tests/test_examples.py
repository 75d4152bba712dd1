"""examples/train_gpt.py under a real torchrun, as a user would launch it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "examples" / "train_gpt.py"


@pytest.mark.parametrize("mode", ["fsdp", "replicate"])
def test_train_gpt_runs_under_torchrun(mode, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--steps",
        "20",
        "--mode",
        mode,
        "--checkpoint-dir",
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 0 loss" in out.stdout and "final loss" in out.stdout
