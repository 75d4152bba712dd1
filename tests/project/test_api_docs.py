"""The API reference (docs/api/*.md) documents every public name: each name in the `__all__`
of funcshard, funcshard.optim, funcshard.checkpoint and funcshard.testing is the object of
some `::: identifier` line of those pages, and every such identifier imports. (That the
pages render, their cross-references resolve and the nav lists them is `mkdocs build
--strict`'s part, run by scripts/test.sh.)"""

import importlib
import re
import types
from pathlib import Path

import funcshard

ROOT = Path(__file__).parents[2]
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.MULTILINE)
PUBLIC = ("funcshard", "funcshard.optim", "funcshard.checkpoint", "funcshard.testing")


def _resolve(identifier: str) -> object:
    """The object `identifier` names, as Python's attribute access finds it (so
    `funcshard.estimate` is the function, not the old module path of the same name), or
    else through its defining module (`funcshard.testing.check.check`: the function `check`
    of the module that `funcshard.testing.check`, the function, hides)."""
    parts = identifier.split(".")
    try:
        obj = importlib.import_module(parts[0])
        for i, name in enumerate(parts[1:], start=2):
            if not hasattr(obj, name):
                importlib.import_module(".".join(parts[:i]))
            obj = getattr(obj, name)
        return obj
    except (ImportError, AttributeError):
        module = importlib.import_module(".".join(parts[:-1]))
        return getattr(module, parts[-1])


def _documented() -> dict[str, object]:
    found = {}
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        for identifier in DIRECTIVE.findall(page.read_text()):
            found[f"{page.name}: {identifier}"] = _resolve(identifier)
    return found


def test_every_public_name_is_in_the_api_reference():
    documented = {id(obj) for obj in _documented().values()}
    missing = []
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if id(obj) in documented:
                continue
            if isinstance(obj, types.ModuleType) and obj.__name__ in map(_module_name, PUBLIC):
                continue  # a public module whose own __all__ is checked here too
            missing.append(f"{module_name}.{name}")
    assert not missing, f"not in docs/api/*.md: {missing}"


def _module_name(public: str) -> str:
    return importlib.import_module(public).__name__


def test_the_public_modules_have_an_all():
    assert funcshard.checkpoint.__all__
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        assert all(hasattr(module, name) for name in module.__all__), module_name
