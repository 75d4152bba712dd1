"""Which modules and parameters a plan leaves out of every unit (`fs.plan(..., ignored=...)`):
objects or FQNs resolved to ids, anything that is not the model's refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def resolve_ignored(
    model: nn.Module, ignored: Iterable[nn.Module | nn.Parameter | str]
) -> tuple[set[int], set[int]]:
    """Ids of the ignored modules and of every parameter they (or the list itself) name."""
    modules: set[int] = set()
    params: set[int] = set()
    all_params = {id(p) for p in model.parameters()}
    all_modules = {id(m) for m in model.modules()}
    unknown = []
    for item in ignored:
        if isinstance(item, str):
            found = _lookup(model, item)
            if found is None:
                unknown.append(repr(item))
                continue
            item = found
        if isinstance(item, nn.Module) and id(item) in all_modules:
            if item is model:
                raise ValueError(
                    "funcshard.plan: the root module cannot be ignored; pass its children instead."
                )
            modules.add(id(item))
            params.update(id(p) for p in item.parameters())
        elif isinstance(item, torch.Tensor) and id(item) in all_params:
            params.add(id(item))
        else:
            unknown.append(_describe(item))
    if unknown:
        raise ValueError(
            f"funcshard.plan: ignored names {', '.join(unknown)}, which are not modules or "
            f"parameters of this {type(model).__name__}. Pass submodules, parameters, or their "
            f"FQNs from model.named_modules()/named_parameters()."
        )
    return modules, params


def _lookup(model: nn.Module, fqn: str) -> nn.Module | nn.Parameter | None:
    for getter in (model.get_submodule, model.get_parameter):
        try:
            return getter(fqn)
        except AttributeError:
            continue
    return None


def _describe(item: object) -> str:
    if isinstance(item, torch.Tensor):
        return f"a tensor of shape {tuple(item.shape)}"
    return type(item).__name__
