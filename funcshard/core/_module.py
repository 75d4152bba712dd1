"""Modules as pytrees: `extract` a module's tensors into dicts, `call` it on dicts of tensors.

[Note: modules as pytrees]
A module's parameters and buffers become two flat dicts keyed by FQN, which optree, torch.func
and torch.compile all see as pytrees. A tensor reachable under several names (tied weights)
appears once, under its first FQN in registration order, as `named_parameters()` gives it;
`call` feeds it to every name that shares it (see [Note: tied tensors]).

`call` is pure: buffers are cloned before the module runs, because modules such as BatchNorm
update running statistics in place, and the caller's tensors must stay bitwise unchanged. The
clones are what `mutable=True` returns as the new buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module

from funcshard.core import _recompute as recompute
from funcshard.core._donation import ensure_live
from funcshard.core._tree import format_names, join_fqn

Params = dict[str, Tensor]


def check_module(value: object, where: str, argument: str = "model") -> None:
    """Raise TypeError, naming `argument` and what it takes, unless `value` is a module
    instance (checked on every rank before any collective)."""
    if isinstance(value, nn.Module):
        return
    if isinstance(value, type) and issubclass(value, nn.Module):
        got = f"the class {value.__name__} itself"
        fix = f"Build the model first, e.g. {value.__name__}(config), and pass the instance."
    elif isinstance(value, Mapping):
        keys = format_names([str(k) for k in value])
        got = f"a {type(value).__name__} (keys {keys})"
        fix = (
            "Pass the module whose parameters these are; to build a state from a state dict, "
            "shard a model built on the meta device and load it with "
            "funcshard.checkpoint.load or load_hf."
        )
    else:
        got = f"{type(value).__name__} {value!r:.60}"
        fix = "Pass the model as an nn.Module."
    raise TypeError(f"{where}: {argument} must be a torch.nn.Module instance, got {got}. {fix}")


def extract(model: nn.Module) -> tuple[Params, Params]:
    """Return `(params, buffers)`: dicts FQN -> tensor, detached from the module.

    Each parameter keeps its `requires_grad` (frozen ones stay frozen) and shares storage with
    the module; tied tensors appear once, under their first FQN. A meta-device model gives
    meta tensors.
    """
    params = {
        name: p.detach().requires_grad_(p.requires_grad) for name, p in model.named_parameters()
    }
    buffers = {name: b.detach() for name, b in model.named_buffers()}
    return params, buffers


def call(
    model: nn.Module,
    params: Mapping[str, Tensor],
    *args: Any,
    buffers: Mapping[str, Tensor] | None = None,
    mutable: bool = False,
    method: str = "forward",
    **kwargs: Any,
) -> Any:
    """Run `model.<method>(*args, **kwargs)` with the given params and buffers.

    `buffers=None` uses the module's own. The inputs are never written: with `mutable=True`
    the result is `(out, new_buffers)`, where new_buffers holds the buffers after the call.
    """
    if not isinstance(params, Mapping):
        raise TypeError(
            f"funcshard.call: params must be a dict FQN -> Tensor (from funcshard.extract), "
            f"got {type(params).__name__}."
        )
    ensure_live(params, "call")
    param_slots, buffer_slots = _slots(model)
    _check_keys(model, params, param_slots, "parameters")
    if buffers is None:
        buffers = {name: model.get_buffer(name) for name in buffer_slots.firsts}
    else:
        _check_keys(model, buffers, buffer_slots, "buffers")
    new_buffers = {name: b.clone() for name, b in buffers.items()}
    tensors = {**param_slots.feed(params), **buffer_slots.feed(new_buffers)}
    reentry = _Reparametrization(model, tensors, frozenset(buffer_slots.firsts + buffer_slots.fed))
    with recompute.calling(frozenset(id(m) for m in model.modules()), reentry):
        out, new_buffers = _functional_call(
            model, tensors, buffer_slots.firsts, method, args, kwargs
        )
    return (out, new_buffers) if mutable else out


@dataclass(frozen=True)
class _Slots:
    """Where a module's tensors of one kind (parameters or buffers) live.

    See [Note: tied tensors] for why aliases are fed by hand.
    """

    firsts: tuple[str, ...]  # the first FQN of each distinct tensor, in registration order
    aliases: dict[str, str]  # every other FQN of a shared tensor -> its first FQN
    fed: tuple[str, ...]  # the aliases that are separate attributes, fed with their first's value

    def feed(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The given tensors plus, for each separately stored alias, its first FQN's tensor."""
        return {**tensors, **{alias: tensors[self.aliases[alias]] for alias in self.fed}}


# [Note: tied tensors]
# torch.func.functional_call(tie_weights=True) corrupts a module registered under two names
# (the same nn.Linear twice in a Sequential): its restore step leaves the caller's tensor in
# place of the module's Parameter (torch 2.13). So funcshard ties by hand, through the
# reparametrization functional_call itself uses, with tie_weights=False: a shared tensor is fed
# once per distinct (module, attribute) slot that holds it, and a slot reached again through a
# second path to the same module is not fed twice.
def _slots(model: nn.Module) -> tuple[_Slots, _Slots]:
    """Find the first FQN and every alias of each parameter and buffer of the model."""
    kinds: dict[str, tuple[list[str], dict[str, str], list[str]]] = {
        "parameters": ([], {}, []),
        "buffers": ([], {}, []),
    }
    first: dict[int, str] = {}
    seen: set[tuple[int, str]] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        local = [("parameters", n, t) for n, t in module.named_parameters(recurse=False)]
        local += [("buffers", n, t) for n, t in module.named_buffers(recurse=False)]
        for kind, attr, tensor in local:
            if (id(module), attr) in seen:
                continue  # the same module reached through a second path
            seen.add((id(module), attr))
            name = join_fqn(prefix, attr)
            firsts, aliases, fed = kinds[kind]
            owner = first.setdefault(id(tensor), name)
            if owner == name:
                firsts.append(name)
            else:
                aliases[name] = owner
                fed.append(name)
    param_slots, buffer_slots = (_Slots(tuple(f), a, tuple(fed)) for f, a, fed in kinds.values())
    return param_slots, buffer_slots


def feed_tied(model: nn.Module, tensors: Mapping[str, Tensor]) -> Params:
    """`tensors` keyed by first FQNs, plus every separately stored alias fed the same tensor
    (see [Note: tied tensors])."""
    param_slots, buffer_slots = _slots(model)
    params = {k: v for k, v in tensors.items() if k in set(param_slots.firsts)}
    buffers = {k: v for k, v in tensors.items() if k in set(buffer_slots.firsts)}
    return {**param_slots.feed(params), **buffer_slots.feed(buffers)}


@contextlib.contextmanager
def reparametrized(model: nn.Module, tensors: Params) -> Iterator[nn.Module]:
    """Temporarily put `tensors` (from `feed_tied`) in the model's slots; restored after."""
    with _reparametrize_module(model, tensors, tie_weights=False, strict=False):
        yield model


class _Reparametrization:
    """Puts one finished call's tensors back into its model while backward recomputes one
    of its modules (see [Note: recomputation after funcshard.call]); buffers are copies, so
    a recomputation that updates them in place leaves the call's results alone."""

    def __init__(self, model: nn.Module, tensors: Params, buffer_names: frozenset[str]) -> None:
        self.model, self.tensors, self.buffer_names = model, tensors, buffer_names
        self.depth = 0
        self.context: contextlib.ExitStack | None = None

    def enter(self, module: nn.Module) -> object:
        if self.depth == 0:
            tensors = {
                k: v.detach().clone() if k in self.buffer_names else v
                for k, v in self.tensors.items()
            }
            self.context = contextlib.ExitStack()
            self.context.enter_context(reparametrized(self.model, tensors))
        self.depth += 1
        return None

    def exit(self, token: object) -> None:
        self.depth -= 1
        if self.depth == 0 and self.context is not None:
            self.context.close()
            self.context = None


def _functional_call(
    model: nn.Module,
    tensors: Params,
    buffer_names: tuple[str, ...],
    method: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, Params]:
    """Run the method with `tensors` swapped in; return its output and the buffers after it.

    The buffers are read before the swap is undone, so an update by reassignment
    (`self.steps = self.steps + 1`) is kept as well as an in-place one.
    """
    target = model if method == "forward" else getattr(model, method, None)
    if not callable(target):
        raise ValueError(
            f"funcshard.call: {type(model).__name__} has no method {method!r}. "
            f"Pass the name of a method of the model, e.g. method='forward'."
        )
    with reparametrized(model, tensors):
        out = target(*args, **kwargs)
        after = {name: model.get_buffer(name) for name in buffer_names}
    return out, after


def _check_keys(model: nn.Module, given: Mapping[str, Tensor], slots: _Slots, kind: str) -> None:
    """Raise naming the FQNs that `given` misses or adds against the model's own."""
    if len(given) == len(slots.firsts) and all(name in given for name in slots.firsts):
        return
    missing = [name for name in slots.firsts if name not in given]
    unexpected = [name for name in given if name not in set(slots.firsts)]
    hints = [
        f"{alias!r} is tied to {slots.aliases[alias]!r}; pass it once, as {slots.aliases[alias]!r}"
        for alias in unexpected
        if alias in slots.aliases
    ]
    parts = [
        f"missing {format_names(missing)}" if missing else "",
        f"unexpected {format_names(unexpected)}" if unexpected else "",
    ]
    raise ValueError(
        f"funcshard.call: the {kind} of {type(model).__name__} do not match the model: "
        f"{'; '.join(p for p in parts if p)}. "
        + (". ".join(hints) + ". " if hints else "")
        + "Build the dict with funcshard.extract(model) so its keys are the model's FQNs."
    )
