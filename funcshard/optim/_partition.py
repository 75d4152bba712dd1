"""Parameter groups: each parameter's updates come from the optimizer of its label, as
`optax.multi_transform` and torch.optim's param groups, with each group's state divided over
the shard axis (see [Note: a parameter group's view] in funcshard/core/_groups.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from funcshard.core._groups import Part, group_of, group_parts, scatter
from funcshard.core._state import ShardedState, donatable
from funcshard.core._tree import format_names, register_record
from funcshard.optim._base import Optimizer
from funcshard.optim._params import _grad_leaves, _like
from funcshard.optim._segments import segments

Labels = Callable[[str, Tensor], str] | Mapping[str, str]
"""Each parameter's group for `partition`: a function `(fqn, param) -> label` (`param` a meta
tensor of the full shape) or a dict FQN -> label."""


@dataclass(frozen=True, eq=False)
class PartitionState:
    """The state of each group's optimizer, by label, and (for sharded params) each group's
    parts (see [Note: a parameter group's view]): what a checkpoint needs to split a packed
    moment into per-parameter pieces."""

    states: dict[str, Any]
    groups: tuple[tuple[str, tuple[Part, ...]], ...] = ()


register_record(PartitionState, data_fields=("states",), meta_fields=("groups",))
donatable(PartitionState, ("states",))


def partition(optimizers: Mapping[str, Optimizer], labels: Labels) -> Optimizer:
    """Parameter groups: each parameter's updates come from the optimizer of its label, as
    `optax.multi_transform` (torch.optim's param groups). `labels` is a function
    `(fqn, param) -> label` (`param` a meta tensor of the full shape) or a dict FQN -> label.

    Each optimizer sees its own group's parameters only: on a dict, the sub-dict; on flat
    shards, a `GroupView` whose leaves hold only the group's elements where groups share a
    buffer (see [Note: a parameter group's view]). So a global norm or a trust ratio counts
    its group alone, `whole_params` makes only its group's parameters whole, and the
    optimizer state is what torch.optim keeps for the same param groups, divided over the
    shard axis, not once per group."""
    names = list(optimizers)
    by_layout: dict[Any, dict[str, frozenset[str]]] = {}

    def members(params: Any) -> dict[str, frozenset[str]]:
        layout = getattr(params, "layout", None)
        if layout is not None and layout in by_layout:
            return by_layout[layout]
        seg = segments(params)
        _check_labels(seg, labels, names)
        pairs = [pair for leaf in seg.params for pair in leaf]
        if isinstance(labels, Mapping):
            label_of = {f: labels.get(f) for f, _ in pairs}
        else:
            label_of = {f: labels(f, p) for f, p in pairs}
        found = {name: frozenset(f for f, lab in label_of.items() if lab == name) for name in names}
        if layout is not None:
            by_layout[layout] = found
        return found

    def groups_of(params: Any, found: dict[str, frozenset[str]]) -> tuple:
        if not isinstance(params, ShardedState):
            return ()
        return tuple((name, group_parts(params.layout, found[name])) for name in names)

    def init(params: Any) -> PartitionState:
        found = members(params)
        states = {name: optimizers[name].init(group_of(params, found[name])) for name in names}
        return PartitionState(states=states, groups=groups_of(params, found))

    def update(
        grads: Any, state: PartitionState, params: Any, donate: bool = False
    ) -> tuple[Any, PartitionState]:
        found = members(params)
        keys = list(grads) if isinstance(grads, Mapping) else None
        out: list[Tensor | None] = [None] * len(_grad_leaves(grads))
        new_states = {}
        for name in names:
            mine = group_of(grads, found[name])
            updates, new_states[name] = optimizers[name].update(
                mine, state.states[name], group_of(params, found[name]), donate=donate
            )
            scatter(mine, updates, out, keys)
        new_state = PartitionState(states=new_states, groups=state.groups)
        return _like(grads, out, donate), new_state

    return Optimizer(init, update)


def _check_labels(seg: Any, labels: Labels, names: list[str]) -> None:
    """Every parameter's label names one of the optimizers (else a silent no-update)."""
    params = [pair for leaf in seg.params for pair in leaf]
    if isinstance(labels, Mapping):
        got = {f: labels.get(f) for f, _ in params}
    else:
        got = {f: labels(f, p) for f, p in params}
    stray = [f"{f} -> {label!r}" for f, label in got.items() if label not in names]
    if stray:
        raise ValueError(
            f"funcshard.optim.partition: parameters {format_names(stray)} have labels with "
            f"no optimizer (the optimizers are {names}). Label every parameter with one of "
            f"them; use funcshard.optim.sgd(0.0) for a group that must not move."
        )
