"""Pytree and FQN helpers: the few the package needs, on top of optree's own accessors."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import optree


def join_fqn(prefix: str, name: str) -> str:
    """Join a module prefix and a local name into a fully qualified name ("" is the root)."""
    return f"{prefix}.{name}" if prefix else name


def leaves_with_paths(tree: Any, root: str = "tree") -> list[tuple[str, Any]]:
    """Return `(path, leaf)` pairs, each path written as Python code: `tree['a'][0]`."""
    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree)
    return [(a.codify(root), leaf) for a, leaf in zip(accessors, leaves, strict=True)]


def format_names(names: Iterable[str], limit: int = 8) -> str:
    """Format names for an error message, at most `limit` of them and a count of the rest."""
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"
