"""The leaves of an optimizer state, each under the key a checkpoint stores it by.

[Note: optimizer leaves in checkpoints]
An optimizer state is any pytree: funcshard's records, dicts, tuples, NamedTuples,
dataclasses registered with `torch.utils._pytree`, and (for what torch sees as a leaf) types
registered with optree. Each leaf gets a key that names its pytree path, `optim/<path>`:
- a 1-D tensor at an int index whose numel is that flat buffer's `shard_numel` lines up with
  the flat (Adam's moments, SGD's momentum): it is saved per parameter like the parameters,
  `optim/<path>/<fqn>`, so it loads at any world size;
- a tensor at the index of a replicated parameter (after the flats, as `ShardedState.leaves()`
  orders them) is keyed by that parameter's FQN;
- an `Owned` node (see [Note: owned state] in funcshard/optim/_owned.py) is keyed by FQN, not by
  position: each leaf of a parameter's state is `optim/<path to the node>/<fqn>/<subpath>`,
  whichever rank holds it, and the alignment rule above never applies inside it (a
  parameter's whole-tensor state can have any numel);
- a 1-D tensor at an int index whose numel is that flat's whole `padded_numel` while the
  mesh shards it (a reduce's carry kept in the optimizer state: full size on every rank) is
  a `Full` leaf: saved per parameter too, each parameter's whole values as a plain tensor,
  `optim/<path>/<fqn>`. On a mesh of shard size 1 the two sizes are one, the leaf lines up
  as above, and the keys are the same, so such a leaf moves between any meshes and plans.
  Being per rank, it is mostly stored per rank and follows [Note: per-rank leaves];
- a None leaf holds nothing: it is neither stored nor looked for, and a load keeps like's.
  Keyed by position it would name a flat buffer's index (SGD's momentum without momentum
  is one None per flat), and another mesh or plan has other flats;
- everything else (step counts, Python numbers, strings) is kept under its path as it is.
A leaf neither pytree library can open, other than a tensor, a number, a string or None,
is refused naming its path, so nothing is silently left out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch.utils._pytree as torch_pytree
from torch import Tensor

from funcshard.core._layout import Layout, shard_pieces
from funcshard.optim._owned import Owned
from funcshard.optim._partition import PartitionState


@dataclass(frozen=True)
class _OwnedPart:
    """How to rebuild one Owned node: its FQNs in order and each state's flattening."""

    fqns: tuple[str, ...]
    specs: tuple[Any, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True)
class _GroupsPart:
    """How to rebuild a PartitionState of sharded params: each group's state's flattening
    and leaf count, and the groups' parts (kept from the state flattened)."""

    names: tuple[str, ...]
    specs: tuple[Any, ...]
    counts: tuple[int, ...]
    groups: tuple[Any, ...]


@dataclass(frozen=True)
class Packed:
    """What a leaf of a partition group's packed view lines up with: this rank's pieces of
    `fqns` (in buffer order) of flat buffer `flat` (see [Note: a parameter group's view])."""

    flat: int
    fqns: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.flat}:{len(self.fqns)}"


@dataclass(frozen=True)
class Full:
    """What a leaf the size of flat buffer `flat`'s whole padded buffer lines up with."""

    flat: int

    def __str__(self) -> str:
        return f"full:{self.flat}"


Align = Callable[[Any, str, Any], tuple[Any, str, Any]]


def optim_leaves(opt_state: Any, layout: Layout) -> tuple[list[tuple[Any, str, Any]], Any]:
    """Each optimizer leaf as (value, key, what it lines up with: a flat's index, a `Packed`
    group leaf, or None), and what `rebuild` needs to put (loaded) leaves back into the
    same structure."""
    return _described(opt_state, "", functools.partial(_aligned, layout=layout), layout)


def _described(tree: Any, base: str, align: Align, layout: Layout) -> tuple[list, Any]:
    pairs, torch_spec = torch_pytree.tree_flatten_with_path(tree, is_leaf=_is_node)
    described: list[tuple[Any, str, Any]] = []
    parts: list[Any] = []
    part: _OwnedPart | _GroupsPart | tuple[Any, int] | None  # what `rebuild` reads
    for path, leaf in pairs:
        prefix = (base + torch_pytree.keystr(path)).lstrip(".")
        if isinstance(leaf, Owned):
            items, part = _owned_items(prefix, leaf)
            described.extend(items)
            parts.append(part)
            continue
        if _is_groups(leaf):
            items, part = _group_items(prefix, leaf, layout)
            described.extend(items)
            parts.append(part)
            continue
        items, part = _leaf_items(prefix, leaf, path[-1] if path else None)
        parts.append(part)
        for key, item, last in items:
            described.append(align(item, key.lstrip("."), _entry(last)))
    return described, (torch_spec, parts)


def _group_items(prefix: str, node: Any, layout: Layout) -> tuple[list, _GroupsPart]:
    """The leaves of a PartitionState of sharded params: each group's state lined up with
    the group's own leaves (packed or whole), so its moments save per parameter too."""
    items, specs, counts = [], [], []
    for name, parts in node.groups:
        align = functools.partial(_group_aligned, layout=layout, parts=parts)
        found, spec = _described(node.states[name], f"{prefix}.states[{name!r}]", align, layout)
        items.extend(found)
        specs.append(spec)
        counts.append(len(found))
    names = tuple(name for name, _ in node.groups)
    return items, _GroupsPart(names, tuple(specs), tuple(counts), node.groups)


def rebuild(spec: Any, leaves: list[Any]) -> Any:
    """The optimizer state `optim_leaves` flattened, from its (loaded) leaves."""
    torch_spec, parts = spec
    outer: list[Any] = []
    at = 0
    for part in parts:
        if isinstance(part, _GroupsPart):
            states = {}
            for name, sub_spec, count in zip(part.names, part.specs, part.counts, strict=True):
                states[name] = rebuild(sub_spec, leaves[at : at + count])
                at += count
            outer.append(PartitionState(states=states, groups=part.groups))
        elif isinstance(part, _OwnedPart):
            states = {}
            for fqn, sub_spec, count in zip(part.fqns, part.specs, part.counts, strict=True):
                states[fqn] = rebuild(sub_spec, leaves[at : at + count])
                at += count
            outer.append(Owned(states=states))
        elif part is None:
            outer.append(leaves[at])
            at += 1
        else:
            sub_spec, count = part
            outer.append(optree.tree_unflatten(sub_spec, leaves[at : at + count]))
            at += count
    return torch_pytree.tree_unflatten(outer, torch_spec)


def _is_node(node: Any) -> bool:
    return isinstance(node, Owned) or _is_groups(node)


def _is_groups(node: Any) -> bool:
    """A partition's state over sharded params (over a dict it has no groups: plain)."""
    return isinstance(node, PartitionState) and bool(node.groups)


def _group_aligned(item: Any, key: str, index: Any, layout: Layout, parts: tuple) -> tuple:
    """(value, key, what it lines up with) of a leaf of a partition group's state: index j
    of a per-leaf sequence is the group's leaf j (see funcshard/core/_groups.py)."""
    if not (isinstance(item, Tensor) and isinstance(index, int) and 0 <= index < len(parts)):
        return item, f"optim/{key}", None
    part, n, base = parts[index], len(layout.flats), key.rsplit("[", 1)[0]
    if part.source >= n:  # a replicated parameter's moment: keyed by its FQN
        return item, f"optim/{base}/{part.fqns[0]}", None
    if item.dim() != 1:
        return item, f"optim/{key}", None
    if not part.packed and item.numel() == layout.flats[part.source].shard_numel:
        return item, f"optim/{base}", part.source
    if part.packed and item.numel() == packed_numel(layout, part):
        return item, f"optim/{base}", Packed(part.source, part.fqns)
    return item, f"optim/{key}", None


def packed_numel(layout: Layout, part: Any) -> int:
    """Elements of this rank's packed leaf of a group's `part`."""
    pieces = shard_pieces(layout.flats[part.source], layout.mesh.shard_rank, part.fqns)
    return sum(p.stop - p.start for p in pieces)


def _aligned(item: Any, key: str, index: Any, layout: Layout) -> tuple[Any, str, Any]:
    """(value, key, flat index, Full or None) of a leaf outside any Owned node."""
    if _full_size(item, index, layout):
        return item, f"optim/{key.rsplit('[', 1)[0]}", Full(index)
    aligned = (
        isinstance(item, Tensor)
        and isinstance(index, int)
        and index < len(layout.flats)
        and item.dim() == 1
        and item.numel() == layout.flats[index].shard_numel
    )
    if aligned:
        return item, f"optim/{key.rsplit('[', 1)[0]}", index
    replicated = _replicated_at(item, index, layout)
    if replicated is not None:  # a replicated parameter's moment: keyed by its FQN
        return item, f"optim/{key.rsplit('[', 1)[0]}/{replicated}", None
    return item, f"optim/{key}", None


def _full_size(item: Any, index: Any, layout: Layout) -> bool:
    """Whether a leaf at `index` of a per-leaf sequence is that flat's whole padded buffer
    on a mesh that shards it (a reduce's carry)."""
    return (
        layout.mesh.shard_size > 1
        and isinstance(item, Tensor)
        and isinstance(index, int)
        and index < len(layout.flats)
        and item.dim() == 1
        and item.numel() == layout.flats[index].padded_numel
    )


def stored(leaf: Any) -> bool:
    """Whether a leaf is stored: None holds nothing (see the Note)."""
    return leaf is not None


def _owned_items(prefix: str, node: Owned) -> tuple[list[tuple[Any, str, Any]], _OwnedPart]:
    """The leaves of an Owned node keyed by FQN and subpath (never aligned with a flat)."""
    if not isinstance(node.states, dict):
        _refuse(prefix + ".states", node.states)
    base = f"optim/{prefix}/" if prefix else "optim/"
    items, specs, counts = [], [], []
    for fqn, sub_state in node.states.items():
        pairs, sub_spec = _flatten(sub_state, f"{prefix}.states[{fqn!r}]")
        for sub, leaf in pairs:
            sub = sub.lstrip(".")
            items.append((leaf, f"{base}{fqn}/{sub}" if sub else f"{base}{fqn}", None))
        specs.append(sub_spec)
        counts.append(len(pairs))
    return items, _OwnedPart(tuple(node.states), tuple(specs), tuple(counts))


def _flatten(tree: Any, where: str) -> tuple[list[tuple[str, Any]], Any]:
    """(subpath, leaf) pairs of one parameter's state, and its flattening."""
    pairs, torch_spec = torch_pytree.tree_flatten_with_path(tree)
    out: list[tuple[str, Any]] = []
    parts = []
    for path, leaf in pairs:
        if isinstance(leaf, Owned):
            raise TypeError(
                f"funcshard.checkpoint: the optimizer state's {where} holds an Owned node "
                f"inside an Owned node, got one at {torch_pytree.keystr(path)}. Keep one "
                f"Owned level per parameter state."
            )
        items, part = _leaf_items(torch_pytree.keystr(path), leaf, None)
        out.extend((key, item) for key, item, _ in items)
        parts.append(part)
    return out, (torch_spec, parts)


def _leaf_items(
    prefix: str, leaf: Any, last: Any
) -> tuple[list[tuple[str, Any, Any]], tuple[Any, int] | None]:
    """A torch-pytree leaf as savable items (key, value, last path entry), opened with optree
    where torch sees a leaf that optree knows; anything else unsavable is refused."""
    if _savable(leaf):
        return [(prefix, leaf, last)], None
    accessors, sub_leaves, sub_spec = optree.tree_flatten_with_accessor(leaf, none_is_leaf=True)
    if len(sub_leaves) == 1 and sub_leaves[0] is leaf:
        _refuse(prefix, leaf)
    items = [
        (prefix + acc.codify(""), sub, acc[-1] if len(acc) else None)
        for acc, sub in zip(accessors, sub_leaves, strict=True)
    ]
    for key, sub, _ in items:
        if not _savable(sub):
            _refuse(key, sub)
    return items, (sub_spec, len(items))


def _replicated_at(item: Any, index: Any, layout: Layout) -> str | None:
    """The replicated parameter an optimizer leaf at `index` of a per-leaf sequence belongs
    to (they follow the flat buffers, as in `ShardedState.leaves()`), or None."""
    if not isinstance(item, Tensor) or not isinstance(index, int):
        return None
    at = index - len(layout.flats)
    return layout.replicated[at] if 0 <= at < len(layout.replicated) else None


def _entry(key: Any) -> Any:
    """The index or key a path step names (torch's SequenceKey/MappingKey, optree's entry)."""
    if key is None:
        return None
    for field in ("idx", "key", "entry"):
        if hasattr(key, field):
            return getattr(key, field)
    return None


def _savable(leaf: Any) -> bool:
    return leaf is None or isinstance(leaf, Tensor | int | float | bool | str)


def _refuse(path: str, leaf: Any) -> None:
    raise TypeError(
        f"funcshard.checkpoint: the optimizer state's {path or 'root'} is a "
        f"{type(leaf).__qualname__}, which is neither a tensor nor a pytree node, so it "
        f"cannot be saved. Register its type as a pytree (a dataclass: "
        f"torch.utils._pytree.register_dataclass; or optree.register_pytree_node), or "
        f"make it a NamedTuple or a dict."
    )
