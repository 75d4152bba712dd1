"""In-place writes to gathered parameters inside a sharded call: refused by name.

[Note: in-place writes to gathered parameters]
Inside `funcshard.call` on a state, a module's parameter is a view of a buffer gathered for
that call (funcshard/step/_gather.py), an output of the differentiable gather. A forward that
writes it in place (`self.weight.add_(1)`, a weight clamp) changes the weight for good in
a plain module, but here it would change a copy dropped after the unit (or, on a replicated
state, whose "gathered" buffer is the shard itself, the immutable state), and its gradient
would not flow through the write. Under grad mode torch refuses the write before it
happens: "Output k of _Gather is a view and is being modified inplace. This view is the
output of a function that returns multiple views ...", naming neither module nor
parameter (a write under `no_grad` passes, and the same words come when the view is next
read with grad). `refusal` turns that error, caught where the call runs the model (the
happy path pays nothing), into one that names the module whose forward was running (the
innermost traceback frame whose `self` is one of the model's modules) and the parameter
under it that is output k of a gather (the k-th parameter of its flat buffer).
Not covered, since autograd does not see them and finding them would cost every call a
check: writes under `no_grad` never read with grad afterwards (an evaluation call) and
writes through `.data`. They change the gathered copy (lost after the call) or, on a
replicated state, the state's shards.
"""

from __future__ import annotations

import re
from types import TracebackType

from torch import nn

from funcshard.core._binding import Binding

_MARK = re.compile(  # torch's words for a write now, and for one found when the view is read
    r"Output (\d+) of _Gather(?:Backward)? is a view and "
    r"(is being|its base or another view of its base has been) modified inplace"
)


def refusal(error: RuntimeError, model: nn.Module, binding: Binding) -> ValueError | None:
    """For torch's refusal of an in-place write to a gathered parameter (`error`, raised by
    the model's forward inside a sharded call), the error to raise instead, naming the
    module and parameter (see [Note: in-place writes to gathered parameters]); for any other
    error, None."""
    match = _MARK.search(str(error))
    if match is None:
        return None
    writes = _writes(binding, output=int(match[1]))  # (module, fqn): every parameter it may be
    module = _running_module(error.__traceback__, binding.module_ids)
    under = {id(m) for m in module.modules()} if module is not None else set()
    mine = list(dict.fromkeys(fqn for m, fqn in writes if id(m) in under))  # tied: once
    if mine:
        names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        where = f"module {names.get(id(module), '?')!r} ({type(module).__name__})"
    else:
        where = f"the forward of {type(model).__name__}"
        mine = list(dict.fromkeys(fqn for _, fqn in writes))
    what = repr(mine[0]) if len(mine) == 1 else "one of " + ", ".join(map(repr, mine[:8]))
    if match[2] == "is being":
        got = f"{where} wrote {what} in place"
    else:  # written under no_grad (which autograd lets pass), found when read with grad
        got = f"{what} written in place under no_grad before {where} read it"
    return ValueError(
        f"funcshard.call: parameters unchanged inside a sharded call, got {got}. Each "
        f"parameter is a view of a buffer gathered for this call only, so the write would be "
        f"lost (or, on a replicated state, change the state) and its gradient would be wrong. "
        f"Compute a new tensor instead (`w = self.weight * 2`), or keep what forward updates "
        f"in a buffer (`register_buffer`) and get it back with "
        f"`funcshard.call(..., mutable=True)`."
    )


def _writes(binding: Binding, output: int) -> list[tuple[nn.Module, str]]:
    """(module, FQN) of every slot holding a parameter that is output `output` of its flat
    buffer's gather."""
    flats = binding.layout.flats
    found = []
    for unit, slots in enumerate(binding.param_slots):
        fqns = [fqn for i in binding.unit_flats[unit] for fqn in flats[i].fqns]
        outputs = [k for i in binding.unit_flats[unit] for k in range(len(flats[i].fqns))]
        for slot, index, _ in slots:
            if outputs[index] == output:
                found.append((slot.module, fqns[index]))
    return found


def _running_module(tb: TracebackType | None, modules: frozenset[int]) -> nn.Module | None:
    """The module of the model whose forward made the write: the innermost traceback frame
    whose `self` is one of `modules` (by id)."""
    running = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, nn.Module) and id(candidate) in modules:
            running = candidate
        tb = tb.tb_next
    return running
