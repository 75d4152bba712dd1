"""examples/train_gpt.py under a real torchrun, as a user would launch it; the examples that
start their own ranks (`fs.testing.run`) through their `main()` in the test's process."""

import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "examples" / "train_gpt.py"


@pytest.mark.parametrize(
    ("mode", "optimizer"), [("fsdp", "muon"), ("replicate", "adamw")]
)
def test_train_gpt_runs_under_torchrun(mode, optimizer, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--steps",
        "6",
        "--batch",
        "2",
        "--mode",
        mode,
        "--optimizer",
        optimizer,
        "--checkpoint-dir",
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 0 loss" in out.stdout and "final loss" in out.stdout


EXAMPLES = Path(__file__).parents[2] / "examples"


def _run_example(name: str, *args: str) -> str:
    """What `python examples/NAME --quick ARGS` prints, run in this process: the example is
    imported (examples/ on sys.path, as a script's folder heads it) and its `main()` called
    with that command line, so its `fs.testing.run` calls go to the test's rank pool (the
    pool pickles `train` by module name, and its ranks get this sys.path). No interpreter or
    pool is started for it; what the example computes and prints is the same."""
    argv, path = sys.argv, sys.path[:]
    sys.argv, sys.path[:0] = [str(EXAMPLES / name), "--quick", *args], [str(EXAMPLES)]
    try:
        module = importlib.import_module(name.removesuffix(".py"))
        with contextlib.redirect_stdout(io.StringIO()) as out:
            module.main()
    finally:
        sys.argv, sys.path[:] = argv, path
    return out.getvalue()


def _ratio(line_start: str, text: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(line_start))
    return float(re.search(r"\(([\d.]+)x\)", line).group(1))


def test_quantized_gather_example_halves_the_gathered_bytes_and_trains_alike():
    out = _run_example("quantized_gather.py")
    assert _ratio("bytes all-gathered", out) <= 0.55, out
    gap = float(re.search(r"largest relative loss gap: ([\d.]+)%", out).group(1))
    assert gap < 2.0, out  # 20 steps: the int8 copy trains as the bf16 one (measured ~0.2%)


def test_compressed_reduce_example_sends_a_quarter_and_trains_alike():
    out = _run_example("compressed_reduce.py")
    assert _ratio("bytes reduced", out) <= 0.5, out
    final = float(re.search(r"4-bit\+EF [\d.]+ \(([-+\d.]+)%\)", out).group(1))
    assert abs(final) < 2.0, out


def test_powersgd_example_sends_low_rank_factors_and_trains_alike():
    out = _run_example("powersgd.py", "--steps", "6")
    assert _ratio("bytes reduced", out) <= 0.1, out  # measured 0.057x
    final = float(re.search(r"PowerSGD [\d.]+ \(([-+\d.]+)%\)", out).group(1))
    assert abs(final) < 5.0, out  # 6 steps (measured +1.9%)
    rows = re.findall(r"^\s*\d+\s+([\d.]+)\s+([\d.]+)$", out, flags=re.M)
    assert float(rows[-1][1]) < 0.8 * float(rows[0][1]), out  # PowerSGD's loss goes down


def test_diloco_example_talks_across_replicas_only_every_h_steps():
    out = _run_example("diloco.py", "--inner-steps", "8")
    assert "DiLoCo steps that talked across replicas: [8, 16, 24]" in out, out
    assert _ratio("total across replicas", out) < 0.2, out


GUIDE = Path(__file__).parents[2] / "docs" / "guides" / "communication.md"


def test_communication_guide_snippets_are_the_examples_code():
    """The communication guide's excerpts (```py blocks; its ```python blocks run as they
    are, in tests/project/test_readme.py) are lines of the example files these tests run,
    so they cannot drift from tested code."""
    snippets = re.findall(r"^```py\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)
    names = ["quantized_gather.py", "compressed_reduce.py", "powersgd.py", "diloco.py"]
    sources = {name: (EXAMPLES / name).read_text() for name in names}
    assert snippets
    for snippet in snippets:
        code = [line.strip() for line in snippet.splitlines() if line.strip()]
        assert len(code) < 25, snippet
        found = [n for n, source in sources.items() if all(line in source for line in code)]
        assert found, ("an excerpt that is in no example", snippet)
