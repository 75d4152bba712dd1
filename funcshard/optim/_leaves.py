"""The leaves an optimizer sees, and `tree_map` over them.

[Note: the optimizer's leaves]
Optimizers work leaf by leaf on a *trainable view* of their arguments. The view of a
ShardedState is its flat shards followed by its replicated (ignored) parameters in
`layout.replicated` order (`ShardedState.leaves()`; buffers are not trained); of
ShardedGrads, the matching gradients (`ShardedGrads.leaves()`, None where frozen); of a dict,
its values; of a tuple or list (a per-leaf optimizer state such as Adam's moments), its
items. So `tree_map(fn, grads, state.exp_avg, params)` lines up a gradient shard, its moment
and its parameter shard, though the three are different containers, and returns a container
of the first argument's kind. This is the whole contract a custom optimizer needs: see
[Note: optimizers] in funcshard/optim/__init__.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from funcshard.core._groups import GroupView
from funcshard.core._state import ShardedGrads, ShardedState, ensure_live


def leaves(tree: Any) -> list[Any]:
    """The trainable view's leaves of a ShardedState, ShardedGrads, dict, tuple or list."""
    if isinstance(tree, ShardedState | ShardedGrads | GroupView):
        ensure_live(tree, "tree_map")
        return tree.leaves()
    if isinstance(tree, Mapping):
        ensure_live(tree, "tree_map")
        return list(tree.values())
    if isinstance(tree, tuple | list):
        return list(tree)
    raise TypeError(
        f"funcshard.tree_map: expected a ShardedState, ShardedGrads, dict, tuple or list, got "
        f"{type(tree).__name__}. (For any other pytree use optree.tree_map.)"
    )


def with_leaves(tree: Any, new: list[Any]) -> Any:
    """A container of `tree`'s kind holding `new` in the order `leaves(tree)` lists them."""
    if isinstance(tree, ShardedState | ShardedGrads):
        layout = tree.layout
        n = len(layout.flats)
        shards, replicated = tuple(new[:n]), dict(zip(layout.replicated, new[n:], strict=True))
        if isinstance(tree, ShardedState):
            return tree.replace(shards=shards, replicated=replicated)
        # the verdict and the usage stay with gradients transformed leaf by leaf (a clip,
        # an unscale): see [Note: non-finite steps skipped by default] in
        # funcshard/step/_finite.py and [Note: unused parameters] in funcshard/step/_usage.py
        return ShardedGrads(
            shards=shards,
            layout=layout,
            replicated=replicated,
            verdict=tree.verdict,
            usage=tree.usage,
        )
    if isinstance(tree, GroupView):
        view = GroupView(tuple(new), tree.layout, tree.parts)
        view.unused = tree.unused
        return view
    if isinstance(tree, Mapping):
        return dict(zip(tree.keys(), new, strict=True))
    return type(tree)(new)


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """`fn` applied leaf by leaf to `tree` and the lined-up leaves of `rest` (see [Note: the
    optimizer's leaves]); where any of them is None (a frozen parameter's gradient) the
    result is None and `fn` is not called. Returns a container of `tree`'s kind."""
    first = leaves(tree)
    others = [leaves(r) for r in rest]
    for other, r in zip(others, rest, strict=True):
        if len(other) != len(first):
            raise ValueError(
                f"funcshard.tree_map: {type(tree).__name__} has {len(first)} leaves but a "
                f"{type(r).__name__} has {len(other)}; pass containers of the same params "
                f"(a state, its grads, per-leaf optimizer states)."
            )
    out = []
    for i, x in enumerate(first):
        args = (x, *(o[i] for o in others))
        out.append(None if any(a is None for a in args) else fn(*args))
    return with_leaves(tree, out)
