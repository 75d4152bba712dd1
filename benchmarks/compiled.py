"""The traced, split and compiled gradient steps against the eager one, on 2 gloo ranks.

    python -m benchmarks.compiled [--backend aot_eager|inductor] [--rounds 10] [--layers 3]

Each rank builds the same GPT, shards it (FSDP, blocks as units) and times, in rotation,
`fs.value_and_grad` run eagerly, the same step traced (`fs.trace`) and split into buckets
(`fs.split`, not compiled), the split step with each piece compiled by `--backend`, and the
whole step under `torch.compile(backend=...)` (one graph; see funcshard/compiled.py).
Before timing, each variant's loss and grads are checked against eager (1e-5).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from tabulate import tabulate

import funcshard as fs
from benchmarks.common import interleaved_medians, lm_loss
from funcshard import testing
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens


def _close(a: object, b: object) -> bool:
    left, right = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(left, right, strict=True))


def _rank(layers: int, backend: str, rounds: int, rank: int) -> dict:
    cfg = GPTConfig(vocab_size=8192, block_size=64, n_layer=layers, n_head=6, d_model=384)
    torch.manual_seed(0)
    model = GPT(cfg)
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=2)
    )
    x, y = random_tokens(cfg, 2, seed=rank)
    step = fs.value_and_grad(lambda s, x, y: lm_loss(fs.call(model, s, x), y))
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
    torch._dynamo.config.trace_autograd_ops = True  # as fs.compile sets (the whole step, one graph)
    whole = torch.compile(step, backend=backend, fullgraph=True)
    started = time.perf_counter()
    checks["torch.compile"] = _close(whole(state, x, y), eager)
    whole_compile_s = time.perf_counter() - started
    times = interleaved_medians(
        {
            "eager": lambda: step(state, x, y),
            "traced and split": lambda: pieces(state, x, y),
            f"split, compiled ({backend})": lambda: compiled(state, x, y),
            f"torch.compile(step) ({backend})": lambda: whole(state, x, y),
        },
        warmup=2,
        rounds=rounds,
    )
    return {
        "times": times,
        "checks": checks,
        "buckets": len(pieces.buckets),
        "trace_s": traced_s,
        "compile_s": compile_s,
        "whole_compile_s": whole_compile_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--layers", type=int, default=3)
    args = parser.parse_args()
    results = testing.run(
        functools.partial(_rank, args.layers, args.backend, args.rounds), timeout=3600
    )
    names = list(results[0]["times"])
    time_of = {n: statistics.mean(r["times"][n] for r in results) for n in names}
    eager = time_of["eager"]
    rows = [[n, f"{time_of[n] * 1e3:.1f}", f"{time_of[n] / eager:.2f}x"] for n in names]
    r0 = results[0]
    print(
        f"GPT {args.layers} blocks (d 384, vocab 8192), 2 gloo ranks, batch 2x64 per rank, "
        f"gradient step only, median of {args.rounds} interleaved rounds; {r0['buckets']} "
        f"buckets; trace {r0['trace_s']:.1f} s, compile {r0['compile_s']:.1f} s (pieces), "
        f"{r0['whole_compile_s']:.1f} s (torch.compile)"
    )
    print(tabulate(rows, headers=["step", "ms", "vs eager"]))
    passed = all(all(r["checks"].values()) for r in results)
    print(f"loss and grads equal eager's (1e-5) on every rank: {'yes' if passed else 'NO'}")


if __name__ == "__main__":
    main()
