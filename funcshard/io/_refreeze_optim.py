"""An optimizer state moved onto a refrozen layout, leaf by leaf, by the keys a checkpoint
gives its leaves (see [Note: refreezing a live state] in funcshard/io/_refreeze.py).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import torch.utils._pytree as torch_pytree
from torch import Tensor

from funcshard.core._layout import FlatLayout, Layout
from funcshard.core._refrozen import frozen_of, same_buffer
from funcshard.core._state import ShardedState
from funcshard.io._optim_leaves import Full, Packed, optim_leaves, rebuild
from funcshard.io._repack import Gathered, repacked
from funcshard.optim._base import Optimizer
from funcshard.optim._owned import Owned

_AT = re.compile(r"^(.*)\[(\d+)\]$")  # a key that ends at a sequence's index


def check(opt_state: Any, layout: Layout) -> None:
    """Refuse, naming it, what `moved` cannot move (before any collective): whole-parameter
    state, and per-leaf entries that are neither None nor lined up with their buffer."""
    pairs, _ = torch_pytree.tree_flatten_with_path(
        opt_state, is_leaf=lambda node: isinstance(node, Owned)
    )
    for path, node in pairs:
        if isinstance(node, Owned):
            raise TypeError(
                f"funcshard.refreeze: the optimizer state's {torch_pytree.keystr(path) or 'root'} "
                f"holds whole-parameter state (fs.optim.whole_params, fs.optim.muon), whose "
                f"owner ranks are balanced over the trained parameters and move when they "
                f"change; refreezing it is not supported. Refreeze without it and start that "
                f"optimizer afresh: opt.init(new_state)."
            )
    count = len(layout.flats) + len(layout.replicated)  # a state's leaves
    _refuse_stray_entries(optim_leaves(opt_state, layout)[0], count)


def _refuse_stray_entries(described: list, count: int) -> None:
    """Refuse an entry of a per-leaf sequence (one entry per state leaf, or a sequence
    whose other entries line up with buffers) that is neither None nor lined up."""
    bases = {key for _, key, align in described if align is not None}
    sizes = Counter(m.group(1) for _, key, _ in described if (m := _AT.match(key)))
    for value, key, align in described:
        m = _AT.match(key)
        per_leaf = m is not None and (m.group(1) in bases or sizes[m.group(1)] == count)
        if per_leaf and (align is None or isinstance(align, Full)) and value is not None:
            raise TypeError(
                f"funcshard.refreeze: the optimizer state's {key.removeprefix('optim/')} is "
                f"a per-leaf entry that is neither None nor a (shard_numel,) tensor lined up "
                f"with its flat buffer ({type(value).__name__}), so which parameters it "
                f"belongs to is unknown; refreezing it is not supported. Keep per-parameter "
                f"values in flat leaves, or in a dict keyed by FQN."
            )


def moved(opt_state: Any, opt: Optimizer, old: ShardedState, new: ShardedState) -> Any:
    """`opt_state` (of `old`) as a state of `new`: see [Note: refreezing a live state].

    Communicates: one all-gather per old leaf lined up with a changed unit's buffer."""
    template = opt.init(new)
    fresh, spec = optim_leaves(template, new.layout)
    _refuse_stray_entries(fresh, len(new.leaves()))
    before, _ = optim_leaves(opt_state, old.layout)
    trained = {f for flat in old.layout.flats for f in flat.fqns} - frozen_of(old.layout)
    plain = {key: value for value, key, align in before if align is None}
    lined: dict[tuple[str, str], tuple[Tensor, int, tuple[str, ...] | None]] = {}
    whole: dict[tuple[str, int, tuple[str, ...] | None], Tensor] = {}
    for value, key, align in before:
        if align is None:
            continue
        i, packed = _where(align)
        whole[key, i, packed] = value
        for fqn in packed if packed is not None else old.layout.flats[i].fqns:
            if fqn in trained:
                lined[key, fqn] = (value, i, packed)
    gathered, at, leaves = Gathered(old.layout.mesh), None, []
    for value, key, align in fresh:
        if align is None:
            leaves.append(None if value is None else plain.get(key, value))
            continue
        j, packed = _where(align)
        flat = new.layout.flats[j]
        if (key, flat.unit) != at:
            gathered.release()
            at = (key, flat.unit)
        kept = _unchanged(old.layout.flats, flat, whole, key, packed)
        if kept is None:
            kept = _rebuilt(value, key, flat, packed, lined, old, gathered)
        leaves.append(kept)
    gathered.release()
    return rebuild(spec, leaves)


def _where(align: int | Packed) -> tuple[int, tuple[str, ...] | None]:
    """(flat index, the packed leaf's FQNs or None) of what a leaf lines up with."""
    return (align.flat, align.fqns) if isinstance(align, Packed) else (align, None)


def _unchanged(
    flats: tuple[FlatLayout, ...], flat: FlatLayout, whole: dict, key: str, packed: Any
) -> Tensor | None:
    """The old leaf of an unchanged buffer that trained before and trains now, or None."""
    for i, old in enumerate(flats):
        if same_buffer(old, flat) and not old.frozen and old.frozen_fqns == flat.frozen_fqns:
            return whole.get((key, i, packed))
    return None


def _rebuilt(
    value: Tensor,
    key: str,
    flat: FlatLayout,
    packed: tuple[str, ...] | None,
    lined: dict,
    old: ShardedState,
    gathered: Gathered,
) -> Tensor:
    """Init's leaf `value` of a changed buffer, with the old values of the parameters that
    trained before (gathered from their old leaves) where they sit in it."""
    members = [f for f in (packed if packed is not None else flat.fqns) if (key, f) in lined]
    if not members:
        return value  # all fresh: init's own leaf

    def source(fqn: str) -> tuple[Tensor, int] | None:
        if (key, fqn) not in lined:
            return None
        leaf, i, old_packed = lined[key, fqn]
        source_flat = old.layout.flats[i]
        full = gathered.full((key, i, old_packed), leaf, source_flat, old_packed)
        return full, source_flat.offsets[source_flat.fqns.index(fqn)]

    for fqn in members:  # every rank gathers alike, whichever pieces it holds
        source(fqn)
    return repacked(value, flat, old.layout.mesh.shard_rank, packed, source)
