"""How long `funcshard.plan` takes on a 1,000-block GPT (built on the meta device).

python benchmarks/plan_speed.py [--blocks 1000]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from tabulate import tabulate
from torch import nn

import funcshard as fs
from funcshard.testing.models import GPT, Block, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=args.blocks, d_model=64, n_head=2))
    policies = {
        "module_classes({Block})": fs.policy.module_classes({Block}),
        "size(min_numel=40_000)": fs.policy.size(40_000),  # a block is ~50k
        "module_classes({Block}) + keep_fp32 LayerNorm": fs.policy.module_classes({Block}),
    }
    rows = []
    for label, policy in policies.items():
        keep = (nn.LayerNorm,) if "keep_fp32" in label else ()
        times, plan = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = fs.plan(model, policy=policy, keep_fp32=keep)
            times.append(time.perf_counter() - start)
        rows.append(
            [label, len(plan.units), f"{statistics.median(times):.3f}", f"{max(times):.3f}"]
        )
    modules = sum(1 for _ in model.modules())
    params = sum(1 for _ in model.parameters())
    print(f"GPT with {args.blocks} blocks: {modules:,} modules, {params:,} parameters (meta)")
    print(tabulate(rows, headers=["policy", "units", "median s", "max s"]))


if __name__ == "__main__":
    warnings.simplefilter("ignore")  # keep_fp32's override warning is expected here
    main()
