"""Loading what the `funcshard` commands name on their command line: `MODULE:FACTORY`
imported as `python -m` imports it, the `--loss MODULE:FN` both `check` and `plan` take, and
the module classes that make units."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

from torch import nn


def load(factory: str, command: str) -> Any:
    """The function `MODULE:FACTORY` names, imported as `python -m` would: from the current
    directory first (a console script's sys.path starts at its own folder instead)."""
    module_name, _, attr = factory.partition(":")
    if not module_name or not attr:
        raise SystemExit(
            f"funcshard {command}: expected MODULE:FACTORY, e.g. pkg.models:gpt, got {factory!r}"
        )
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise SystemExit(
                f"funcshard {command}: importing {module_name!r} failed: {e}. Install what it "
                f"imports in this environment ({sys.executable})."
            ) from e
        raise SystemExit(
            f"funcshard {command}: no module named {e.name!r} (for {factory!r}): looked in the "
            f"current directory {cwd} and on sys.path ({sys.executable}). Run funcshard "
            f"from the directory that holds {module_name.split('.')[0]}/ or "
            f"{module_name.split('.')[0]}.py, add that directory to PYTHONPATH, or install "
            f"the package (pip install -e .)."
        ) from e
    function = getattr(module, attr, None)
    if function is None or not callable(function):
        found = "is not callable" if function is not None else "has no such name"
        raise SystemExit(
            f"funcshard {command}: {module_name} ({getattr(module, '__file__', '?')}) {found}: "
            f"{attr!r}. Name a function or class that returns the model."
        )
    return function


def add_loss_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """The `--loss MODULE:FN` option, `FN(outputs, targets) -> mean loss` (the convention of
    `fs.testing.check`'s `loss_fn`); `default` says what runs without it."""
    parser.add_argument(
        "--loss", help=f"module:function, (outputs, targets) -> mean loss (default: {default})"
    )


def loss_function(args: argparse.Namespace, command: str) -> Any:
    """The function `--loss` names, or None when it is not given."""
    return load(args.loss, command) if args.loss else None


def unit_classes(model: nn.Module, names: str | None, command: str) -> set[type[nn.Module]]:
    """The module classes named in `names` (comma-separated), or by default the classes in
    the model's first non-empty ModuleList (transformer blocks, typically)."""
    if names:
        wanted = set(names.split(","))
        found = {type(m) for m in model.modules() if type(m).__name__ in wanted}
        if len(found) != len(wanted):
            missing = wanted - {c.__name__ for c in found}
            raise SystemExit(
                f"funcshard {command}: no modules of class {sorted(missing)} in the model"
            )
        return found
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module):
            return {type(child) for child in module}
    raise SystemExit(f"funcshard {command}: the model has no ModuleList; pass --units ClassName")
