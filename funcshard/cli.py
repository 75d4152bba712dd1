"""The `funcshard` command: `funcshard demo` trains a small GPT on local ranks and checks it;
`funcshard plan MODULE:FACTORY --world-size N` plans a model built on the meta device and
prints the memory and traffic each rank needs, without allocating it; `funcshard checkpoint
verify PATH` checks a checkpoint's bytes against its checksums, offline.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch
from tabulate import tabulate
from torch import nn

from funcshard import checkpoint
from funcshard.demo import add_arguments as add_demo_arguments
from funcshard.demo import from_arguments as demo_config
from funcshard.demo import run as run_demo
from funcshard.estimate import estimate
from funcshard.plan import plan
from funcshard.policy import module_classes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    """Entry point of `funcshard` and `python -m funcshard`."""
    parser = argparse.ArgumentParser(prog="funcshard", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    planner = commands.add_parser("plan", help="memory and traffic per rank of a model's plan")
    planner.add_argument("factory", help="module:function returning the model, e.g. pkg.models:gpt")
    planner.add_argument("--world-size", type=int, required=True)
    planner.add_argument("--mesh", help="RxS: replicate x shard (HSDP); default 1xWORLD (FSDP)")
    planner.add_argument("--mp", choices=sorted(DTYPES), help="gather and compute in this dtype")
    planner.add_argument(
        "--units",
        help="comma-separated module class names to make units (default: the "
        "classes inside the model's first ModuleList, e.g. transformer blocks)",
    )
    demo = commands.add_parser("demo", help="train a small GPT on local ranks and check it")
    add_demo_arguments(demo)
    checkpoints = commands.add_parser("checkpoint", help="check a saved checkpoint")
    actions = checkpoints.add_subparsers(dest="action", required=True)
    verifier = actions.add_parser("verify", help="check every byte against its checksums")
    verifier.add_argument("path", help="a checkpoint directory, or the root LATEST is in")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(demo_config(args))
    if args.command == "checkpoint":
        return _verify_command(args.path)
    return _plan_command(args)


def _verify_command(path: str) -> int:
    try:
        report = checkpoint.verify(path)
    except (FileNotFoundError, checkpoint.CheckpointCorrupted) as e:
        print(e, file=sys.stderr)
        return 2
    print(f"{report.directory}:")
    for line in report.lines:
        print(f"  {line}")
    for problem in report.problems:
        print(f"  {problem}")
    if not report.verified:
        print("not verified: saved without checksums")
        return 1
    print("verified: every byte matches" if report.ok else f"{len(report.problems)} problems")
    return 0 if report.ok else 1


def _plan_command(args: argparse.Namespace) -> int:
    replicate, shard = _mesh(args.mesh, args.world_size)
    with torch.device("meta"):
        model = _load(args.factory)()
    classes = _unit_classes(model, args.units)
    result = estimate(
        plan(model, policy=module_classes(classes)), replicate, shard, DTYPES.get(args.mp)
    )
    mib = 2**20
    rows = [
        [
            u.name or "<root>",
            *(
                f"{v / mib:,.1f}"
                for v in (u.params, u.grads, u.optimizer, u.gathered, u.sent_per_step)
            ),
        ]
        for u in result.units
    ]
    print(
        f"{args.factory}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"mesh {replicate}x{shard} (replicate x shard), units: "
        f"{', '.join(c.__name__ for c in classes)}"
    )
    if len(rows) > 12:
        rows = [*rows[:5], ["...", "", "", "", "", ""], *rows[-5:]]
    headers = ["unit", "params", "grads", "AdamW", "gathered", "sent/step"]
    print(tabulate(rows, headers=[h + (" MiB" if i else "") for i, h in enumerate(headers)]))
    print(
        f"per rank: {result.persistent / mib:,.1f} MiB held (params + grads + AdamW state), "
        f"+ {result.gathered_peak / mib:,.1f} MiB gathered at peak (root + two units), "
        f"{result.sent_per_step / mib:,.1f} MiB sent per step; activations not included"
    )
    return 0


def _mesh(text: str | None, world: int) -> tuple[int, int]:
    if text is None:
        return 1, world
    replicate, shard = (int(x) for x in text.lower().split("x"))
    if replicate * shard != world:
        raise SystemExit(
            f"funcshard plan: --mesh {text} has {replicate * shard} ranks, not {world}"
        )
    return replicate, shard


def _load(factory: str):
    module_name, _, attr = factory.partition(":")
    if not attr:
        raise SystemExit(f"funcshard plan: expected MODULE:FACTORY, got {factory!r}")
    return getattr(importlib.import_module(module_name), attr)


def _unit_classes(model: nn.Module, names: str | None) -> set[type[nn.Module]]:
    if names:
        wanted = set(names.split(","))
        found = {type(m) for m in model.modules() if type(m).__name__ in wanted}
        if len(found) != len(wanted):
            missing = wanted - {c.__name__ for c in found}
            raise SystemExit(f"funcshard plan: no modules of class {sorted(missing)} in the model")
        return found
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module):
            return {type(child) for child in module}
    raise SystemExit("funcshard plan: the model has no ModuleList; pass --units ClassName")


if __name__ == "__main__":
    sys.exit(main())
