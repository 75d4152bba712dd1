"""Modules as pytrees: `extract` a module's tensors into dicts, `call` it on dicts of tensors.

[Note: modules as pytrees]
A module's parameters and buffers become two flat dicts keyed by FQN, which optree, torch.func
and torch.compile all see as pytrees. A tensor reachable under several names (tied weights)
appears once, under its first FQN in registration order, as `named_parameters()` gives it;
`torch.func.functional_call(..., tie_weights=True)` then feeds every name that shares it.

`call` is pure: buffers are cloned before the module runs, because modules such as BatchNorm
update running statistics in place, and the caller's tensors must stay bitwise unchanged. The
clones are what `mutable=True` returns as the new buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn
from torch.func import functional_call

from funcshard.tree import format_names

Params = dict[str, Tensor]


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
    _check_keys(model, params, "parameters")
    if buffers is None:
        buffers = dict(model.named_buffers())
    else:
        _check_keys(model, buffers, "buffers")
    new_buffers = {name: b.clone() for name, b in buffers.items()}
    out = _functional_call(model, dict(params), new_buffers, method, args, kwargs)
    return (out, new_buffers) if mutable else out


def _functional_call(
    model: nn.Module,
    params: Params,
    buffers: Params,
    method: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    if method == "forward":
        return functional_call(model, (params, buffers), args, kwargs, strict=False)
    if not callable(getattr(model, method, None)):
        raise ValueError(
            f"funcshard.call: {type(model).__name__} has no method {method!r}. "
            f"Pass the name of a method of the model, e.g. method='forward'."
        )
    # functional_call only calls forward; a one-child wrapper forwards to the method instead.
    wrapper = _MethodCall(model, method)
    prefixed = {f"inner.{k}": v for tensors in (params, buffers) for k, v in tensors.items()}
    return functional_call(wrapper, prefixed, args, kwargs, strict=False)


class _MethodCall(nn.Module):
    """Make `inner.<method>` the forward of a module, so functional_call can run it."""

    def __init__(self, inner: nn.Module, method: str) -> None:
        super().__init__()
        self.inner = inner
        self.method = method

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, self.method)(*args, **kwargs)


def _check_keys(model: nn.Module, given: Mapping[str, Tensor], kind: str) -> None:
    """Raise naming the FQNs that `given` misses or adds against the model's own."""
    named = model.named_parameters if kind == "parameters" else model.named_buffers
    expected = [name for name, _ in named()]
    if len(given) == len(expected) and all(name in given for name in expected):
        return
    missing = [name for name in expected if name not in given]
    unexpected = [name for name in given if name not in set(expected)]
    aliases = _aliases(named(remove_duplicate=False))
    hints = [
        f"{alias!r} is tied to {aliases[alias]!r}; pass it once, as {aliases[alias]!r}"
        for alias in unexpected
        if alias in aliases
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


def _aliases(named: Any) -> dict[str, str]:
    """Map each secondary FQN of a shared tensor to its first FQN."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in named:
        owner = first.setdefault(id(tensor), name)
        if owner != name:
            aliases[name] = owner
    return aliases
