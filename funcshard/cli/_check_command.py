"""`funcshard check MODULE:FACTORY --batch MODULE:FACTORY`: the sharding laws on your model.

The command form of `fs.testing.check` (docs/guides/checking.md): it imports the factories, checks
the laws over the world sizes asked for on local gloo ranks, prints each configuration as it
finishes and then the report's table, and exits 0 when every law held, 1 when one failed,
2 on bad arguments. `--quick` checks world sizes up to 2, three configurations of two steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from funcshard.cli._loading import add_loss_argument, load, loss_function, unit_classes
from funcshard.core import _policy as policy
from funcshard.testing.check import check
from funcshard.testing.harness import LAWS
from funcshard.testing.report import LawViolation


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `check` command to `funcshard`'s subcommands; return its parser."""
    parser = subparsers.add_parser(
        "check",
        help="check the sharding laws (parity, determinism, checkpoints, ...) on a model",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("factory", help="module:function returning the model, e.g. pkg.models:gpt")
    parser.add_argument(
        "--batch",
        required=True,
        help="module:function, step -> (inputs, targets): the global batch of that step",
    )
    add_loss_argument(parser, "cross entropy for integer targets, else mean squared error")
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated (default 1,2,4)")
    parser.add_argument("--quick", action="store_true", help="world sizes up to 2, 3 configs")
    parser.add_argument(
        "--units",
        help="comma-separated module class names to make units (default: several policies drawn)",
    )
    parser.add_argument("--mp", action="store_true", help="also draw bf16 mixed precision")
    parser.add_argument("--examples", type=int, default=8, help="configurations to draw")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per configuration")
    parser.add_argument(
        "--optimizer",
        default="adamw",
        help="adamw, sgd, or module:function returning your fs.optim.Optimizer (default adamw)",
    )
    parser.add_argument("--laws", help=f"comma-separated, among {', '.join(LAWS)} (default all)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--database", help="a directory for hypothesis to keep failures in")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run `funcshard check` with parsed arguments; the exit code."""
    try:
        options = _options(args)
    except (ValueError, ImportError, AttributeError) as e:
        print(f"funcshard check: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # `load`'s message, which names the fix
        print(e, file=sys.stderr)
        return 2
    print(f"funcshard check {args.factory}: laws {', '.join(options['laws'])}")
    started = time.monotonic()
    try:
        report = check(**options, progress=lambda line: print(f"  {line}", flush=True))
    except LawViolation as e:
        report = e.report
    except (TypeError, ValueError) as e:
        print(f"funcshard check: {e}", file=sys.stderr)
        return 2
    print(report.table())
    print(f"funcshard check took {time.monotonic() - started:.1f} s")
    return 0 if report.ok else 1


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """`check`'s arguments from the command line's."""
    make_model = load(args.factory, "check")
    laws = tuple(args.laws.split(",")) if args.laws else LAWS
    return {
        "make_model": make_model,
        "make_batch": load(args.batch, "check"),
        "loss_fn": loss_function(args, "check"),
        "policy": _policy(make_model, args.units) if args.units else None,
        "world_sizes": tuple(int(w) for w in args.world_sizes.split(",")),
        "steps": args.steps,
        "examples": args.examples,
        "mixed_precision": args.mp,
        "optimizer": load(args.optimizer, "check") if ":" in args.optimizer else args.optimizer,
        "laws": laws,
        "seed": args.seed,
        "database": args.database,
        "quick": args.quick,
        "raise_on_failure": False,
    }


def _policy(make_model: Any, names: str) -> Any:
    """`module_classes` of the model's classes named in `names` (built on the meta device)."""
    with torch.device("meta"):
        model = make_model()
    return policy.module_classes(unit_classes(model, names, "check"))


def main(argv: list[str] | None = None) -> int:
    """`python -m funcshard.check_command ...` (the same as `funcshard check ...`)."""
    parser = argparse.ArgumentParser(prog="funcshard")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
