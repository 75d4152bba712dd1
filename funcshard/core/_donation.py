"""Donation: a call that reuses its input's memory for its result leaves the input unusable.

[Note: donation]
A call that donates its input (`Optimizer.step`, `donate=True`) writes its result into the
input's memory, so the input must never be read again: its numbers are now the result's.
JAX deletes donated arrays; here the donated record (or dict) has each of its data fields (or
values) replaced by a `Donated` placeholder, and any use of a placeholder (indexing,
iterating, attributes, arithmetic, a torch function) raises DonatedError naming the call that
took it. funcshard's own entry points (and tree flattening) check first and name the record.

The same writes work inside a step that torch.compile traces: dynamo records attribute and
item stores on its inputs as side effects and replays them after the graph runs, so the
records a compiled step donated are marked when it returns. The placeholders are made in
advance, one per donating call, because a traced step cannot build new objects.

What cannot be guarded: a tensor taken out of a record or dict before it was donated.
"""

from __future__ import annotations

from typing import NoReturn

import torch


class DonatedError(RuntimeError):
    """A state, grads or optimizer record (or a params dict) was used after its memory was
    donated to another call."""


class Donated:
    """The placeholder left where a donated value was: every use raises DonatedError."""

    __slots__ = ("to",)

    def __init__(self, to: str) -> None:
        object.__setattr__(self, "to", to)

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise DonatedError(
            f"funcshard: this value was donated to {self.to}, whose result now lives in its "
            f"memory. Use what that call returned, or call it with donate=False to keep "
            f"this one."
        )

    def __repr__(self) -> str:
        return f"<donated to {self.to}>"

    def __getattr__(self, name: str) -> object:
        self._refuse()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        next(leaf for leaf in leaves if isinstance(leaf, Donated))._refuse()


_CONTAINER_USES = ("getitem", "setitem", "iter", "len", "contains", "bool", "setattr", "call")
_VALUE_USES = ("neg", "lt", "le", "gt", "ge", "float", "int", "array")
_ARITHMETIC = ("add", "sub", "mul", "truediv", "matmul", "pow")
for _use in (*_CONTAINER_USES, *_VALUE_USES, *_ARITHMETIC, *(f"r{op}" for op in _ARITHMETIC)):
    setattr(Donated, f"__{_use}__", Donated._refuse)

DONATING_CALLS = (
    "Optimizer.step",
    "apply_updates(donate=True)",
    "an optimizer update(donate=True)",
)
_PLACEHOLDERS = {to: Donated(to) for to in DONATING_CALLS}


def donate(value: object, to: str) -> None:
    """Mark `value` as given to `to` (one of DONATING_CALLS), which reuses its memory for
    its result: a record's data fields, or a dict's values, become placeholders that raise
    DonatedError on any use (see [Note: donation]). Call it after the last read of `value`."""
    gone = _PLACEHOLDERS[to]
    if isinstance(value, dict):
        for key in value:
            value[key] = gone
        return
    object.__setattr__(value, "_donated_to", to)
    for name in value._donated_fields:  # type: ignore[attr-defined]
        object.__setattr__(value, name, gone)


def donatable(cls: type, data_fields: tuple[str, ...]) -> None:
    """Let `donate` take records of `cls`: their `data_fields` hold the donated memory."""
    if not hasattr(cls, "_donated_to"):
        cls._donated_to = None  # type: ignore[attr-defined]
    cls._donated_fields = data_fields  # type: ignore[attr-defined]


def ensure_live(value: object, where: str) -> None:
    """Raise DonatedError if `value` (a record, or a params dict) was donated."""
    if torch.compiler.is_dynamo_compiling():
        return
    if isinstance(value, dict):
        gone = next((v for v in value.values() if isinstance(v, Donated)), None)
        if gone is not None:
            raise DonatedError(
                f"funcshard.{where}: this params dict was donated to {gone.to}, whose result "
                f"now lives in its memory. Use the dict that call returned, or call it with "
                f"donate=False to keep this one."
            )
        return
    to = getattr(value, "_donated_to", None)
    if to is not None:
        kind = type(value).__name__
        raise DonatedError(
            f"funcshard.{where}: this {kind} was donated to {to}, whose result now lives in "
            f"its memory. Use the {kind} that call returned, or call it with donate=False "
            f"to keep this one."
        )
