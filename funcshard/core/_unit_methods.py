"""A unit's methods besides `forward`: which ones gather it, as the plan declares them.

[Note: units called through other methods]
funcshard gathers a unit from its module's forward hooks, so a parent that calls
`self.vit.forward_features(x)` instead of `self.vit(x)` runs the unit's code on the meta
placeholders in its slots. FSDP2 lets a user name such methods (`register_fsdp_forward_
method`); here the plan records them per unit (`plan(..., forward_methods=...)`, in the
unit's options: see [Note: per-unit options] in funcshard/core/_unit_options.py), checked
against the model when the plan is made (the module must be a unit's, the method must
exist), and each sharded call wraps those methods of the unit's module for its duration so
that calling one gathers the unit first and releases it after, as the forward hooks do
(funcshard/step/_unit_schedule.py). A method that calls forward, or forward that calls it,
gathers once: the hooks and the wrappers count how deep a unit is entered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

Methods = dict[str, tuple[str, ...]]  # unit's module FQN -> its methods


def resolved(
    model: nn.Module, forward_methods: Mapping[str | nn.Module, str | Iterable[str]] | None
) -> Methods:
    """`forward_methods` keyed by module FQN, each method checked to exist on its module
    (ValueError naming the module and the method otherwise)."""
    if not forward_methods:
        return {}
    if not isinstance(forward_methods, Mapping):
        raise TypeError(
            f"funcshard.plan: forward_methods maps modules (or their FQNs) to method names, "
            f"e.g. {{'vit': 'forward_features'}}; got {type(forward_methods).__name__}."
        )
    fqns = {id(m): fqn for fqn, m in model.named_modules()}  # (each module once: its first)
    out: Methods = {}
    for key, given in forward_methods.items():
        fqn = fqns.get(id(key)) if isinstance(key, nn.Module) else key
        module = _module(model, fqn)
        if module is None:
            raise ValueError(
                f"funcshard.plan: forward_methods names {_described(key)}, which is not a "
                f"module of this {type(model).__name__}."
            )
        names = (given,) if isinstance(given, str) else tuple(given)
        for name in names:
            if name == "forward" or not isinstance(name, str):
                raise ValueError(
                    f"funcshard.plan: forward_methods[{fqn!r}] lists {name!r}; name methods "
                    f"other than forward (forward gathers the unit already)."
                )
            if not callable(getattr(module, name, None)):
                raise ValueError(
                    f"funcshard.plan: forward_methods[{fqn!r}] names {name!r}, which "
                    f"{type(module).__name__} at {fqn!r} does not have as a method."
                )
        out[str(fqn)] = names
    return out


def _module(model: nn.Module, fqn: object) -> nn.Module | None:
    if not isinstance(fqn, str):
        return None
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        return None


def _described(key: object) -> str:
    return repr(key) if isinstance(key, str) else f"a {type(key).__name__} module"
