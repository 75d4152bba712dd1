"""What checksums cost a checkpoint: save and load with and without them, on 2 gloo ranks.

    python -m benchmarks.checkpoint [--rounds 3] [--quick]

Each rank shards a GPT with AdamW state (the demo's model, and a ~30M-parameter one whose
checkpoint is a few hundred MB), then times, in rotation, `fs.checkpoint.save` with
checksums (the default) and without, and `fs.checkpoint.load` verifying (the default) and
not. Medians over rounds; the ratio is with / without.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import tempfile

import torch
from tabulate import tabulate

import funcshard as fs
from benchmarks.common import interleaved_medians
from funcshard import testing
from funcshard.cli import demo
from funcshard.io import _checkpoint_latest as checkpoint_latest
from funcshard.testing.models import GPT, Block, GPTConfig

MODELS = {
    "demo GPT": demo.model_config(demo.DemoConfig()),
    "GPT d512 x8": GPTConfig(vocab_size=8192, block_size=64, n_layer=8, n_head=8, d_model=512),
}
QUICK = {"tiny GPT": GPTConfig()}


def _rank(cfg: GPTConfig, rounds: int, root: str, rank: int) -> dict:
    with torch.device("meta"):
        model = GPT(cfg)
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=2), seed=0
    )
    opt_state = fs.optim.adamw(1e-3).init(state)
    like = (state, opt_state)
    paths = {"with": os.path.join(root, "with"), "without": os.path.join(root, "without")}

    def save(checksums: bool) -> None:
        path = paths["with" if checksums else "without"]
        fs.checkpoint.save(path, state, opt_state, keep=1, checksums=checksums)

    save(True)
    save(False)  # one of each to load
    times = interleaved_medians(
        {
            "save, checksums": functools.partial(save, True),
            "save, none": functools.partial(save, False),
            "load, verified": lambda: fs.checkpoint.load(paths["with"], like),
            "load, not verified": lambda: fs.checkpoint.load(paths["with"], like, verify=False),
        },
        warmup=1,
        rounds=rounds,
    )
    latest = checkpoint_latest.latest(paths["with"])
    size = sum(os.path.getsize(os.path.join(latest, f)) for f in os.listdir(latest))
    return {"times": times, "mib": size / 2**20}


def measure(models: dict[str, GPTConfig], rounds: int) -> list[list]:
    rows = []
    for name, cfg in models.items():
        root = tempfile.mkdtemp(prefix="funcshard-ckpt-bench-")
        try:
            result = testing.run(functools.partial(_rank, cfg, rounds, root), timeout=900)[0]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        t = result["times"]
        rows.append(
            [
                name,
                f"{result['mib']:.1f}",
                f"{t['save, none']:.3f}",
                f"{t['save, checksums']:.3f}",
                f"{t['save, checksums'] / t['save, none']:.2f}x",
                f"{t['load, not verified']:.3f}",
                f"{t['load, verified']:.3f}",
                f"{t['load, verified'] / t['load, not verified']:.2f}x",
            ]
        )
    return rows


HEADERS = [
    "model",
    "MiB on disk",
    "save s",
    "save s, checksums",
    "ratio",
    "load s",
    "load s, verified",
    "ratio",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round: a check")
    args = parser.parse_args()
    models, rounds = (QUICK, 1) if args.quick else (MODELS, args.rounds)
    print(f"fs.checkpoint on 2 gloo ranks, medians of {rounds} rounds (seconds):")
    print(tabulate(measure(models, rounds), headers=HEADERS))


if __name__ == "__main__":
    main()
