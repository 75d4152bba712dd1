"""The benchmark entry points in --quick mode: they run, and write their tables, ratios and plot."""

import ast
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a folder of the repository, not installed

from benchmarks import compiled, gpu, host_memory, muon, report  # noqa: E402
from benchmarks.sent_bytes import SentBytes  # noqa: E402
from funcshard import testing  # noqa: E402
from funcshard.step import _host_memory  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TARGET_RATIOS = (
    "funcshard overhead vs plain",
    "FSDP2 / funcshard overhead",
    "funcshard step time vs FSDP2",
    "funcshard (FSDP) step time vs DDP",
    "funcshard peak memory vs FSDP2",
    "funcshard replicate step time vs DDP",
)


def _run(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_run_py_as_a_script_writes_the_tables_ratios_and_plot_in_its_section_only(tmp_path):
    """`python benchmarks/run.py --quick` (a script: it makes `benchmarks` importable itself)
    into a RESULTS.md with prose around a stale generated section: the tables, ratios and plot
    are written, and only the section is rewritten. One run for what were two tests (this one
    and `python -m benchmarks --quick`); `-m benchmarks` is the same `main`, checked below."""
    results = tmp_path / "RESULTS.md"
    before = "# Results\n\nHand-written prose.\n\n<!-- generated:start -->\nstale\n"
    after = "<!-- generated:end -->\n\n## Earlier runs\n\nMore prose.\n"
    results.write_text(before + after)
    # the blocks sweep at 2 points (--quick's is 3): each point is a fresh process
    out = _run("benchmarks/run.py", "--quick", "--blocks", "1", "2", "--out", str(tmp_path))
    text = results.read_text()
    assert text.startswith("# Results\n\nHand-written prose.\n\n<!-- generated:start -->\n")
    assert text.endswith(after) and "stale" not in text
    for heading in ("The ratios the targets are about", "(a) Framework overhead"):
        assert f"### {heading}" in text
    for heading in ("(b) Real training", "(c) Scaling"):
        assert f"### {heading}" in text
    for name in TARGET_RATIOS:
        assert re.search(rf"\| {re.escape(name)} .*\| [\d.]+x +\| [≤≥] [\d.]+x", text), name
        assert name in out.stdout
    for name in ("plain (1 process)", "funcshard", "FSDP2"):  # (a): ms and ratio to plain
        assert re.search(rf"\| {re.escape(name)} +\| +[\d.]+ +\| [\d.]+x", text), name
    for name in ("funcshard replicate", "DDP"):  # (b): ms, ratios, peak MiB, ratio
        assert re.search(rf"\| {name} +\| +[\d.]+ +\|( [\d.]+x +\|){{2}} +[\d.]+ +\| [\d.]+x", text)
    assert re.search(r"\| +blocks \|", text) and re.search(r"\| +ranks \|", text)  # (c)
    assert f"torch {torch.__version__}" in text and "cores" in text  # the machine
    assert "- Command: `" in text and "benchmarks/run.py --quick" in text and "- Date: " in text
    assert "](results.png)" in text
    assert (tmp_path / "results.png").read_bytes()[:8] == PNG_SIGNATURE


def test_python_m_benchmarks_is_run_py(monkeypatch):
    """`python -m benchmarks` (the command README and benchmarks/README give) calls run.py's
    main, run here as -m runs it (runpy, as __main__) without a second benchmark run."""
    from benchmarks import run

    calls = []
    monkeypatch.setattr(run, "main", lambda: calls.append("run.main"))
    runpy.run_module("benchmarks", run_name="__main__")
    assert calls == ["run.main"]


def test_gpu_script_on_cpu_runs_the_same_comparison_and_says_it_is_no_gpu_figure(tmp_path, capsys):
    """Its main in the test's process, its rank on the test's pool (as the compiled
    benchmark's test below)."""
    gpu.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    stdout = capsys.readouterr().out
    text = (tmp_path / "RESULTS.md").read_text()
    assert "<!-- gpu:start -->\n## GPU script run on CPU (gloo): a check" in text
    assert "not GPU figures" in text and "<!-- gpu:end -->" in text
    for name in ("funcshard", "FSDP2", "plain (1 process)"):
        # median ms, IQR ms, tokens/s, then the ratio to plain
        row = rf"\| {re.escape(name)} +\| +[\d.]+ +\| +[\d.]+ +\| +[\d,]+ +\| [\d.]+x"
        assert re.search(row, text), name
        assert name in stdout
    assert re.search(r"funcshard step time vs plain [\d.]+x, vs FSDP2 [\d.]+x", text)


def test_gpu_script_without_cuda_exits_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"no CUDA GPU is visible.*--device cpu --out DIR"):
        gpu.main([])


def test_gpu_script_on_cpu_refuses_to_overwrite_the_committed_results(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--device", "cpu"])
    assert "give --out DIR" in capsys.readouterr().err


def test_write_section_replaces_between_markers_or_appends(tmp_path):
    path = tmp_path / "R.md"
    path.write_text("# R\n\nprose\n")
    report.write_section(path, "gpu", "first")
    section = "<!-- gpu:start -->\n{}\n<!-- gpu:end -->\n"
    assert path.read_text() == "# R\n\nprose\n\n" + section.format("first")
    path.write_text(path.read_text() + "\ntail\n")
    report.write_section(path, "gpu", "second\n")
    assert path.read_text() == "# R\n\nprose\n\n" + section.format("second") + "\ntail\n"


def test_write_section_refuses_a_file_with_one_marker(tmp_path):
    path = tmp_path / "R.md"
    path.write_text("<!-- gpu:start -->\nno end\n")
    with pytest.raises(ValueError, match=r"R.md: expected both <!-- gpu:start --> and"):
        report.write_section(path, "gpu", "x")


def test_compiled_benchmark_checks_against_eager_then_times_and_meters_the_steps(capsys):
    """Its main in the test's process, its ranks on the test's pool: a process of its own
    added an interpreter and a pool, not a check of the benchmark."""
    compiled.main(["--layers", "1", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "loss and grads equal eager's (1e-5) on every rank: yes" in out
    for step in ("traced and split", "split, compiled (aot_eager)"):  # timed only
        assert re.search(rf"^{re.escape(step)}\s+[\d.]+\s+[\d.]+x$", out, flags=re.M), out
    metered = ("eager", "eager, units kept", "fs.compile(step) (aot_eager)")
    for step in (*metered, "fs.compile(step), units kept (aot_eager)"):  # timed and metered
        row = rf"^{re.escape(step)}\s+[\d.]+\s+[\d.]+x\s+[\d.]+\s+[\d.]+x$"
        assert re.search(row, out, flags=re.M), out


@pytest.mark.skipif(_host_memory._glibc_function("mallopt") is None, reason="glibc only")
def test_host_memory_benchmark_alternates_processes_and_compares_their_faults(capsys):
    """Its main in the test's process: the measurements are still fresh processes, one per
    setting (the setting is a whole process's), the test's process only orders them."""
    host_memory.main(["--quick", "--pairs", "1", "--rounds", "2"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (glibc's defaults|memory kept) +\|( +\d+ +\|){2}", out, re.M)
    assert [r[0] for r in rows] == ["glibc's defaults", "memory kept"], out
    assert re.search(r"memory kept: funcshard / DDP [\d.]+-[\d.]+, mean [\d.]+", out)


def test_muon_benchmark_times_meters_and_counts_bytes_of_every_contender_and_state():
    spec = muon.MuonSpec(cfg=muon.QUICK_CFG, rounds=1, warmup=0, memory_steps=1)
    result = muon.measure(spec, 2)
    for name in muon.CONTENDERS:
        assert result.step[name] > 0 and result.train[name] >= result.step[name]
    for name in muon.METERED:
        assert result.peaks[name] >= result.mean_peaks[name] > 0
        assert result.sent[name] >= result.mean_sent[name] > 0
    fake = {2: {n: 1e-3 for n in (*muon.CONTENDERS, muon.FLOOR)}}
    text = muon.table([result], fake, "github")
    for name in muon.METERED:
        assert re.search(rf"^\| 2 +\| {re.escape(name)} .*\|( +[\d.]+ +\|){{4}}$", text, re.M)
    assert re.search(r"owned \+ Muon +\|( +[\d.]+ +\|){2} 1.00x", text), text
    assert re.search(rf"{re.escape(muon.FLOOR)} +\| +\| 1.00 +\| 1.00x", text), text
    goals = muon.goals([result], fake)
    assert "bytes sent per step vs even + AdamW" in goals and "mean over ranks" in goals
    assert "its floor (rank 0's Muon math alone)" in goals
    state = muon.state_bytes(muon.QUICK_CFG, 2)
    for name in ("torch.optim, one process / 2", "funcshard muon + adamw", "stand-in"):
        assert name in state


def _sent(rank: int) -> list[int]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = []
    mesh = init_device_mesh("cpu", (2,))
    whole = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    with SentBytes() as sent:
        if rank == 0:
            dist.send(torch.randn(10), 1)
        else:
            dist.recv(torch.empty(10), 0)
    out.append(sent.bytes)
    with SentBytes() as sent:
        dist.all_gather_into_tensor(torch.empty(12), torch.randn(6))
    out.append(sent.bytes)
    with SentBytes() as sent:
        whole.redistribute(mesh, [Replicate()]).to_local()
    out.append(sent.bytes)
    other = distribute_tensor(torch.randn(4, 8), mesh, [Shard(0)])
    with SentBytes() as sent:  # the redistribution DTensor issues inside its own dispatch
        torch.mm(whole, other).to_local()
    out.append(sent.bytes)
    return out


def test_sent_bytes_counts_what_each_rank_hands_the_backend():
    """benchmarks.muon's bytes column: a send its bytes (a receive nothing), a ring
    all-gather (n - 1) inputs, and DTensor's inner collectives counted too."""
    assert testing.run(_sent, world_size=2) == [[40, 24, 64, 64], [0, 24, 64, 64]]


def test_every_benchmark_and_example_with_a_main_runs_it_as_a_script():
    """Most benchmarks and examples are checked through `main(...)` in this process (a launch
    each costs seconds), so their `python -m benchmarks.X` or `python examples/X.py` line is
    checked here instead: each module with a `main` ends by calling it under
    `if __name__ == "__main__":`."""
    missing = []
    for path in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").glob("*.py")]):
        tree = ast.parse(path.read_text())
        if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            continue
        guards = [
            n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)
        ]
        if not any("main(" in ast.unparse(g) for g in guards):
            missing.append(path.name)
    assert not missing, f"no `if __name__ == '__main__': main()` in {missing}"
