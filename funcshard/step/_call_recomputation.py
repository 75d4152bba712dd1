"""Putting a finished sharded call's tensors back while backward recomputes one of its
modules (see [Note: recomputation after funcshard.call] in funcshard/core/_recompute.py).
"""

from __future__ import annotations

from torch import Tensor, nn

from funcshard.core._binding import Slot, get_slot, restore_slots, set_slot
from funcshard.step._unit_schedule import Run


class Recomputation:
    """Puts a finished sharded call's tensors back while backward recomputes one of its
    modules (see [Note: recomputation after funcshard.call]): the units owning parameters
    under that module (regathered if they were resharded), the replicated tensors, and
    copies of the buffers the call ended with. Counts what it put in, so nested modules
    and units shared by several recomputed modules come out once, last."""

    def __init__(self, run: Run) -> None:
        self.run = run
        # a recomputed unit may be regathered even if autograd saved none of its tensors
        # (checkpointed regions save through torch's hooks, not the run's)
        self.regather = run.regather
        self.buffers: dict[str, Tensor] = {}  # the call's buffers when it returned
        self.holds: dict[int, int] = {}  # unit -> how many entered modules need it
        self.saved: dict[int, list[tuple[Slot, Tensor]]] = {}  # unit -> what its slots held
        self.depth = 0
        self.saved_others: list[tuple[Slot, Tensor]] = []

    def enter(self, module: nn.Module) -> object:
        binding, run = self.run.binding, self.run
        units = self._units_under(module)
        # everything that can fail (regathering) first, so a failure leaves no slot changed
        fresh = {u: run.recompute_params(u) for u in units if u not in self.holds}
        if self.depth == 0:
            others = [s for s, _ in binding.replicated_slots] + [s for s, _ in binding.buffer_slots]
            self.saved_others = [(slot, get_slot(slot)) for slot in others]
            for slot, fqn in binding.replicated_slots:
                set_slot(slot, run.state.replicated[fqn])
            for slot, fqn in binding.buffer_slots:
                set_slot(slot, self.buffers[fqn].detach().clone())
        self.depth += 1
        for unit in units:
            self.holds[unit] = self.holds.get(unit, 0) + 1
        for unit, params in fresh.items():
            slots = binding.param_slots[unit]
            self.saved[unit] = [(slot, get_slot(slot)) for slot, _, _ in slots]
            for slot, index, _ in slots:
                set_slot(slot, params[index])
        return units

    def exit(self, token: object) -> None:
        for unit in token:  # type: ignore[attr-defined]
            self.holds[unit] -= 1
            if self.holds[unit] == 0:
                del self.holds[unit]
                restore_slots(self.saved.pop(unit))
        self.depth -= 1
        if self.depth == 0:
            restore_slots(self.saved_others)
            self.saved_others = []

    def _units_under(self, module: nn.Module) -> tuple[int, ...]:
        binding = self.run.binding
        units = binding.units_under.get(id(module))
        if units is None:
            ids = {id(m) for m in module.modules()}
            units = binding.units_under[id(module)] = tuple(
                u
                for u, slots in enumerate(binding.param_slots)
                if any(id(slot.module) in ids for slot, _, _ in slots)
            )
        return units
