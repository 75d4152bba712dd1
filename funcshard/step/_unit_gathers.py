"""The gathers of one sharded call: which units are gathered and in flight, how a unit's
all-gathers are issued, and the orders units are gathered in (`Prefetch`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.comm._comm import Comm
from funcshard.core._binding import Binding
from funcshard.core._state import ShardedState
from funcshard.step import _gather as gather
from funcshard.step._gather_spec import Differentiated, specs_and_sinks


@dataclass(frozen=True)
class Prefetch:
    """Explicit prefetch orders, by unit name ("" is the root).

    When a unit starts in forward, the unit after it in `forward` has its all-gather issued;
    when a unit is regathered in backward, the unit after it in `backward` is. `None` keeps
    the default for that direction: plan order in forward, reverse run order in backward.
    """

    forward: tuple[str, ...] | None = None
    backward: tuple[str, ...] | None = None


class UnitGathers:
    """What one sharded call has gathered and has in flight, unit by unit, and the orders
    it gathers units in: what its per-unit schedule (`funcshard.step._unit_schedule.Run`) and its
    regathers in backward (`funcshard.step._regather.Regather`) share."""

    def __init__(self, binding: Binding, state: ShardedState, comm: Comm | None = None):
        self.binding = binding
        self.state = state
        self.layout = state.layout
        self.specs, self.sinks = specs_and_sinks(state, comm)
        if getattr(state, "sinks", None) is not None and any(  # (no per-buffer loop else)
            spec.reduction == "none" and s.grad_fn is not None
            for spec, s in zip(self.specs, state.shards, strict=True)
        ):
            raise ValueError(
                "funcshard.value_and_grad(reduce=False, or keep_local=...): the function "
                "calls the model on shards it computed (state.replace(shards=...)); local "
                "gradients are taken with respect to the gathered parameters, so the shards' "
                "own transformation would be lost. Use reduce=True (without keep_local), "
                "which differentiates through it."
            )
        # torch.func's transforms refuse saved-tensor hooks and wrap the shards they see
        self.functorch = any(_is_functorch(s) for s in state.shards)
        n_units = len(binding.unit_names)
        self.full: list[tuple[Tensor | None, ...] | None] = [None] * n_units
        kept = getattr(state, "gathered", ())  # a GatheredState's: see [Note: keeping units
        if kept:  # gathered]; its gathers take these as their finished all-gathers
            self.full = [tuple(kept[i] for i in flats) for flats in binding.unit_flats]
        self.pending: dict[int, tuple[collectives.Pending, ...]] = {}
        self.order: list[int] = []
        prefetch = state.prefetch if isinstance(state, Differentiated) else True
        self.prefetch = prefetch is not False and not self.functorch
        explicit = prefetch if isinstance(prefetch, Prefetch) else Prefetch()
        forward = self._units_named(explicit.forward) if explicit.forward is not None else None
        forward = forward or self._sharded_units()
        self.forward_next = _successors(forward)
        self.first_forward = forward[0] if forward else None
        self.backward_next = (
            _successors(self._units_named(explicit.backward))
            if explicit.backward is not None
            else None
        )

    def _units_named(self, names: tuple[str, ...]) -> list[int]:
        unknown = [n for n in names if n not in self.binding.unit_names]
        if unknown:
            raise ValueError(
                f"funcshard.value_and_grad: prefetch names {unknown}, which are not units of "
                f"this state; its units are {list(self.binding.unit_names)} ('' is the root)."
            )
        return [self.binding.unit_names.index(n) for n in names]

    def _sharded_units(self) -> list[int]:
        return [u for u in range(len(self.binding.unit_names)) if u not in self.binding.whole_call]

    def issue(self, unit: int) -> None:
        """Start the all-gathers of a unit's flat buffers, unless already gathered or started
        (under torch.func each is gathered inside its op instead: no prefetch)."""
        if self.full[unit] is not None or unit in self.pending or self.functorch:
            return
        shards, specs = self.state.shards, self.specs
        self.pending[unit] = tuple(
            [gather.issue_gather(shards[i], specs[i]) for i in self.binding.unit_flats[unit]]
        )

    def start(self) -> None:
        """Issue the all-gathers a call begins with: the whole-call units', then (as a
        prefetch) the first unit's in forward order, so that it overlaps the wait for the
        whole-call units and the compute before the first unit."""
        for unit in range(len(self.binding.unit_names)):
            if unit in self.binding.whole_call:
                self.issue(unit)
        if self.prefetch and self.first_forward is not None:
            self.issue(self.first_forward)

    def drain(self) -> None:
        """Wait for gathers nobody used (a prefetch past the last unit): every rank issued them."""
        for pending in self.pending.values():
            for p in pending:
                p.wait()
        self.pending.clear()


def _is_functorch(tensor: Tensor) -> bool:
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def _successors(order: list[int]) -> dict[int, int]:
    return dict(itertools.pairwise(order))
