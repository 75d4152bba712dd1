"""Pytree and FQN helpers: the few the package needs, on top of optree's own accessors.

The one place that touches torch's private pytree module (`register_record`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import optree
import torch.utils._pytree as torch_pytree

from funcshard.core._donation import ensure_live


def join_fqn(prefix: str, name: str) -> str:
    """Join a module prefix and a local name into a fully qualified name ("" is the root)."""
    return f"{prefix}.{name}" if prefix else name


def format_names(names: Iterable[str], limit: int = 8) -> str:
    """Format names for an error message, at most `limit` of them and a count of the rest."""
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def register_record(cls: type, data_fields: tuple[str, ...], meta_fields: tuple[str, ...]) -> type:
    """Register a frozen dataclass as a pytree whose children are `data_fields`.

    The `meta_fields` travel as static aux data. Registered in torch.utils._pytree (read by
    torch.func and torch.compile) and in optree's global namespace (so a plain
    `optree.tree_leaves(record)` works). optree's "torch" namespace belongs to
    torch.utils._cxx_pytree and is left alone.
    """

    def flatten(record: Any) -> tuple[list[Any], tuple[Any, ...]]:
        if getattr(record, "_donated_to", None) is not None:
            ensure_live(record, "tree")
        return [getattr(record, f) for f in data_fields], tuple(
            getattr(record, f) for f in meta_fields
        )

    def unflatten(children: Iterable[Any], meta: tuple[Any, ...]) -> Any:
        return cls(
            **dict(zip(data_fields, children, strict=True)),
            **dict(zip(meta_fields, meta, strict=True)),
        )

    def flatten_with_keys(record: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        children, meta = flatten(record)
        keys = [torch_pytree.GetAttrKey(f) for f in data_fields]
        return list(zip(keys, children, strict=True)), meta

    torch_pytree.register_pytree_node(
        cls,
        flatten,
        lambda children, meta: unflatten(children, meta),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )
    optree.register_pytree_node(
        cls,
        lambda record: (*flatten(record), data_fields),
        # the metadata is the tuple `flatten` made (optree types it as any hashable)
        lambda meta, children: unflatten(children, cast("tuple[Any, ...]", meta)),
        path_entry_type=optree.GetAttrEntry,
        namespace=getattr(optree.registry, "__GLOBAL_NAMESPACE"),
    )
    return cls
