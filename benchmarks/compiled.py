"""The traced, split and compiled gradient steps against the eager one, on 2 gloo ranks.

    python -m benchmarks.compiled [--backend aot_eager|inductor] [--rounds 10] [--layers 3]

Each rank builds the same GPT, shards it (FSDP, blocks as units) and times, in rotation,
`fs.value_and_grad` run eagerly, the same step traced (`fs.trace`) and split into buckets
(`fs.split`, not compiled), the split step with each piece compiled by `--backend`, and the
whole step under `fs.compile(backend=...)` (one graph, resharded as eagerly: see
funcshard/compiling/_compiled_schedule.py), eager and compiled also with
`reshard_after_forward=False` ("units kept"). Peak live tensor memory is metered for the eager and
the whole-step variants. Before timing, each variant's loss and grads are checked against eager
(1e-5).
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from collections.abc import Callable

import torch
from tabulate import tabulate

import funcshard as fs
from benchmarks.common import interleaved_medians, lm_loss
from funcshard import testing
from funcshard.compiling import reshard_backend
from funcshard.testing.memory import LiveTensors, metering_compiler
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens


def _close(a: object, b: object) -> bool:
    left, right = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(left, right, strict=True))


def _peak_eager(step: Callable, state: fs.ShardedState, x: torch.Tensor, y: torch.Tensor) -> int:
    """Peak live tensor bytes of one eager gradient step."""
    with LiveTensors() as meter:
        step(state, x, y)
    return meter.peak


def _peak_compiled(step: Callable, state: fs.ShardedState, x: torch.Tensor, y: torch.Tensor) -> int:
    """Peak live tensor bytes of the compiled step's graph, metered op by op from inside (a
    dispatch mode around a compiled call makes dynamo skip the frame): aot_eager with
    funcshard's scheduling, so inductor's buffer reuse is not counted."""
    peaks: list[int] = []
    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        torch.compile(step, backend=reshard_backend(metering_compiler(peaks)), fullgraph=True)(
            state, x, y
        )
    torch._dynamo.reset()
    return max(peaks)


def _simple_fsdp(
    model: GPT, backend: str, x: torch.Tensor, y: torch.Tensor
) -> tuple[Callable[[], object], int] | str:
    """torchtitan's SimpleFSDP (`data_parallel(mode="fully_shard")`, every parameter a
    DTensor gathered by a parametrization) under torch.compile: its gradient step and its
    peak, metered inside its forward graph and its backward graph (whose inputs, what
    forward saved, count as live there); or why it cannot run."""
    try:
        from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel
    except ImportError as error:
        return f"torchtitan's SimpleFSDP does not import here: {error}"
    from torch._dynamo.backends.common import aot_autograd
    from torch.distributed.device_mesh import init_device_mesh

    sharded = data_parallel(copy.deepcopy(model), init_device_mesh("cpu", (2,)), "fully_shard")
    peaks: list[int] = []
    compilers = {
        "fw_compiler": metering_compiler(peaks),
        "bw_compiler": metering_compiler(peaks, True),
    }
    meter = aot_autograd(**compilers)
    measured = torch.compile(sharded, backend=meter)
    lm_loss(measured(x), y).backward()
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(sharded), backend=backend)

    def step() -> object:
        loss = lm_loss(compiled(x), y)
        loss.backward()
        return loss

    return step, max(peaks)


def _rank(layers: int, backend: str, rounds: int, rank: int) -> dict:
    cfg = GPTConfig(vocab_size=8192, block_size=64, n_layer=layers, n_head=6, d_model=384)
    torch.manual_seed(0)
    model = GPT(cfg)
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    kept = fs.shard(model, plan, fs.Mesh(shard=2), reshard_after_forward=False)
    x, y = random_tokens(cfg, 2, seed=rank)
    step = fs.value_and_grad(lambda s, x, y: lm_loss(fs.call(model, s, x), y))
    peaks = {
        "eager": _peak_eager(step, state, x, y),
        "eager, units kept": _peak_eager(step, kept, x, y),
        f"fs.compile(step) ({backend})": _peak_compiled(step, state, x, y),
        f"fs.compile(step), units kept ({backend})": _peak_compiled(step, kept, x, y),
    }
    simple = _simple_fsdp(model, backend, x, y)
    if not isinstance(simple, str):
        peaks[f"SimpleFSDP, torch.compile ({backend})"] = simple[1]
    started = time.perf_counter()
    graph = fs.trace(step, state, x, y)
    traced_s = time.perf_counter() - started
    pieces = fs.split(graph, bucket_mb=4, first_bucket_mb=1)
    started = time.perf_counter()
    compiled = pieces.compile(backend=backend)
    eager = step(state, x, y)
    checks = {
        "split": _close(pieces(state, x, y), eager),
        "compiled": _close(compiled(state, x, y), eager),
    }
    compile_s = time.perf_counter() - started
    whole = fs.compile(step, backend=backend, fullgraph=True)  # resharding: compiled_schedule
    whole_kept = fs.compile(step, backend=backend, fullgraph=True)
    started = time.perf_counter()
    checks["fs.compile"] = _close(whole(state, x, y), eager)
    whole_compile_s = time.perf_counter() - started
    checks["fs.compile, units kept"] = _close(whole_kept(kept, x, y), step(kept, x, y))
    simple_step = (
        {} if isinstance(simple, str) else {f"SimpleFSDP, torch.compile ({backend})": simple[0]}
    )
    times = interleaved_medians(
        {
            **simple_step,
            "eager": lambda: step(state, x, y),
            "eager, units kept": lambda: step(kept, x, y),
            "traced and split": lambda: pieces(state, x, y),
            f"split, compiled ({backend})": lambda: compiled(state, x, y),
            f"fs.compile(step) ({backend})": lambda: whole(state, x, y),
            f"fs.compile(step), units kept ({backend})": lambda: whole_kept(kept, x, y),
        },
        warmup=2,
        rounds=rounds,
    )
    return {
        "times": times,
        "peaks": peaks,
        "simple_fsdp": simple if isinstance(simple, str) else None,
        "checks": checks,
        "buckets": len(pieces.buckets),
        "trace_s": traced_s,
        "compile_s": compile_s,
        "whole_compile_s": whole_compile_s,
    }


def main(argv: list[str] | None = None) -> None:
    """The command line (`argv`, sys.argv's unless given: tests call it in their process)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--layers", type=int, default=3)
    args = parser.parse_args(argv)
    results = testing.run(
        functools.partial(_rank, args.layers, args.backend, args.rounds), timeout=3600
    )
    names = list(results[0]["times"])
    time_of = {n: statistics.mean(r["times"][n] for r in results) for n in names}
    eager = time_of["eager"]
    peak_of = {n: max(r["peaks"][n] for r in results) for n in results[0]["peaks"]}
    rows = [
        [
            n,
            f"{time_of[n] * 1e3:.1f}",
            f"{time_of[n] / eager:.2f}x",
            f"{peak_of[n] / 1e6:.1f}" if n in peak_of else "",
            f"{peak_of[n] / peak_of['eager']:.2f}x" if n in peak_of else "",
        ]
        for n in names
    ]
    r0 = results[0]
    print(
        f"GPT {args.layers} blocks (d 384, vocab 8192), 2 gloo ranks, batch 2x64 per rank, "
        f"gradient step only, median of {args.rounds} interleaved rounds; {r0['buckets']} "
        f"buckets; trace {r0['trace_s']:.1f} s, compile {r0['compile_s']:.1f} s (pieces), "
        f"{r0['whole_compile_s']:.1f} s (torch.compile)"
    )
    print(tabulate(rows, headers=["step", "ms", "vs eager", "peak MB", "vs eager"]))
    print(
        "peak MB: live tensors of one gradient step; the compiled steps metered inside their "
        "graph as aot_eager runs it (inductor's buffer reuse is not counted)"
    )
    if r0["simple_fsdp"]:
        print(f"SimpleFSDP not run: {r0['simple_fsdp']}")
    passed = all(all(r["checks"].values()) for r in results)
    print(f"loss and grads equal eager's (1e-5) on every rank: {'yes' if passed else 'NO'}")


if __name__ == "__main__":
    main()
