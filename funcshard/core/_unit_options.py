"""Per-unit options: what a plan records about each unit beside its parameters.

[Note: per-unit options]
Some choices belong to one unit, not to the whole state: the methods other than forward
that gather it (`forward_methods`), its mixed-precision policy (`mp`), and, by the same
road, its placement (the issue "Placements per unit"). `fs.plan` takes each as a mapping
keyed by what a user has at hand: a module object, an FQN, a unit's name (a group's or a
bucket's `<...>` name, "" for the root), or, where the option allows, a module class.
`by_unit` resolves every such mapping the same way, once, when the plan is made, and the
plan writes the result into one record per unit, `Unit.options` (a frozen
`UnitOptions`). So every per-unit option has one way in, one set of refusals (a key that
names no unit, a module that is not a unit's, a class no unit is made of: ValueError
naming the key and the units there are), one place in the plan's fingerprint, and one
place the layout copies it from.

Options never choose units; the policy and `groups=` do. (`keep_fp32` is the old
exception: it makes its classes units, and their policy is `MixedPrecision()`, mixed
precision off.) A unit's explicit key wins over a class that matches it; two classes that
match one unit with different values are refused, as is a `keep_fp32` unit given another
policy: nothing is chosen silently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from funcshard.core._precision import MixedPrecision


@dataclass(frozen=True)
class UnitOptions:
    """What one unit does differently from the state's defaults.

    `methods`: its module's methods besides forward that gather it (see [Note: units called
    through other methods]); `mp`: its own mixed-precision policy, in place of the state's
    (`None`: the state's; `MixedPrecision()`: none, as `keep_fp32` gives); `placement`:
    how its parameters lie over the shard axis, "even" or "owned" (see [Note: owned
    placement] in funcshard/core/_placement.py).
    """

    methods: tuple[str, ...] = ()
    mp: MixedPrecision | None = None
    placement: str = "even"


class Unit(Protocol):
    """What resolving keys reads of a plan's unit (funcshard.core._plan.Unit)."""

    @property
    def name(self) -> str: ...

    @property
    def modules(self) -> tuple[str, ...]: ...


def by_unit(
    model: nn.Module,
    units: Sequence[Unit],
    given: Mapping[Any, Any] | None,
    option: str,
    classes: bool = True,
    root: bool = True,
    hint: str = "",
    groups: bool = True,
) -> dict[str, Any]:
    """`given` keyed by unit name: each key a unit's name, a unit's module (object or FQN)
    or, with `classes`, a module class (every unit whose modules are all of it). Refuses,
    naming the key, one that names no unit (or the root, without `root`; or a unit of
    several modules, without `groups`)."""
    if not given:
        return {}
    if not isinstance(given, Mapping):
        raise TypeError(
            f"funcshard.plan: {option} maps units (module, FQN, unit name"
            f"{', class' if classes else ''}) to values; got {type(given).__name__}."
        )
    fqns = {id(m): fqn for fqn, m in model.named_modules()}  # (each module once: its first)
    explicit: dict[str, Any] = {}
    from_class: dict[str, tuple[type, Any]] = {}
    for key, value in given.items():
        if isinstance(key, type):
            if not classes:
                raise TypeError(
                    f"funcshard.plan: {option} takes modules or their FQNs, not classes, "
                    f"got {key.__name__}."
                )
            for name in _units_of_class(model, units, key, option):
                seen = from_class.get(name)
                if seen is not None and seen[1] != value:
                    raise ValueError(
                        f"funcshard.plan: {option} gives unit {name!r} two values, by "
                        f"{seen[0].__name__} and by {key.__name__}. Key that unit by its name."
                    )
                from_class[name] = (key, value)
        else:
            name = _unit_named(model, units, key, fqns, option, root, hint)
            if not groups and name.startswith("<"):
                raise ValueError(
                    f"funcshard.plan: {option} names {name!r}, a unit of several modules or "
                    f"parameters; {option} applies to units of one module only (not built "
                    f"yet for groups)."
                )
            explicit[name] = value
    return {**{name: v for name, (_, v) in from_class.items()}, **explicit}


def check_values(
    option: str, values: Mapping[str, Any], ok: Callable[[Any], bool], want: str
) -> None:
    """TypeError naming the first unit whose value is not `want`."""
    for name, value in values.items():
        if not ok(value):
            raise TypeError(f"funcshard.plan: {option}[{name!r}] must be {want}, got {value!r}.")


def _units_of_class(model: nn.Module, units: Sequence[Unit], cls: type, option: str) -> list[str]:
    names = [
        u.name
        for u in units
        if u.modules and all(isinstance(model.get_submodule(m), cls) for m in u.modules)
    ]
    if not names:
        raise ValueError(
            f"funcshard.plan: {option} names the class {cls.__name__}, but no unit is made of "
            f"such modules. Make them units (the policy, e.g. policy.module_classes, or "
            f"groups=), or key the option by unit name."
        )
    return names


def _unit_named(
    model: nn.Module,
    units: Sequence[Unit],
    key: Any,
    fqns: dict[int, str],
    option: str,
    root: bool,
    hint: str,
) -> str:
    """The unit `key` (a unit name, or a unit's module or its FQN) names."""
    name = fqns.get(id(key)) if isinstance(key, nn.Module) else key
    described = repr(key) if isinstance(key, str) else f"a {type(key).__name__} module"
    shown = [u.name for u in units]
    if not isinstance(name, str):
        raise ValueError(
            f"funcshard.plan: {option} names {described}, which is not a module of this "
            f"{type(model).__name__}."
        )
    member_of = {m: u.name for u in units for m in u.modules if u.name != m}
    if name in member_of:
        raise ValueError(
            f"funcshard.plan: {option} names {name!r}, a member of the unit "
            f"{member_of[name]!r}; key the option by that unit's name (where the option "
            f"applies to units of several modules)."
        )
    if name in {u.name for u in units} and (root or name != ""):
        return name
    if name != "" and _module(model, name) is None and not name.startswith("<"):
        raise ValueError(
            f"funcshard.plan: {option} names {described}, which is not a module of this "
            f"{type(model).__name__} nor a unit's name (the units: {shown})."
        )
    raise ValueError(
        f"funcshard.plan: {option} names {name!r}, which is not a unit's module (the units: "
        f"{shown}); make it a unit with the policy or groups=.{' ' + hint if hint else ''}"
    )


def _module(model: nn.Module, fqn: str) -> nn.Module | None:
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        return None
