"""Policies: which modules become units of communication (the auto-wrap policies, as data).

A policy is any callable `(module, fqn, unowned_numel) -> bool` that answers "make this module
a unit?", where `unowned_numel` counts the parameters in the module's subtree that no unit
below it owns yet. The ones here are frozen dataclasses, so they compare, hash and pickle
(a plan drawn in a test can be sent to every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

Policy = Callable[[nn.Module, str, int], bool]


@dataclass(frozen=True)
class ModuleClasses:
    """Make every module of one of these classes a unit."""

    classes: tuple[type[nn.Module], ...]

    def __post_init__(self) -> None:
        bad = [c for c in self.classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(
                f"policy.module_classes: expected nn.Module subclasses, got {bad}. "
                f"Pass classes, e.g. module_classes({{Block}}), not instances."
            )

    def __call__(self, module: nn.Module, fqn: str, unowned_numel: int) -> bool:
        return isinstance(module, self.classes)


@dataclass(frozen=True)
class Size:
    """Make a module a unit once its not-yet-owned parameters reach `min_numel` elements."""

    min_numel: int

    def __post_init__(self) -> None:
        if not isinstance(self.min_numel, int) or self.min_numel < 1:
            raise ValueError(
                f"policy.size: min_numel must be a positive int, got {self.min_numel!r}."
            )

    def __call__(self, module: nn.Module, fqn: str, unowned_numel: int) -> bool:
        return unowned_numel >= self.min_numel


@dataclass(frozen=True)
class AnyOf:
    """Make a module a unit when any of the policies says so."""

    policies: tuple[Policy, ...]

    def __call__(self, module: nn.Module, fqn: str, unowned_numel: int) -> bool:
        return any(p(module, fqn, unowned_numel) for p in self.policies)


@dataclass(frozen=True)
class Buckets:
    """Units of parameters, not modules: DDP's gradient buckets (see `buckets`)."""

    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0

    def __post_init__(self) -> None:
        for name in ("bucket_mb", "first_bucket_mb"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"policy.buckets: {name} must be positive, got {value!r}.")


def buckets(bucket_mb: float = 25.0, first_bucket_mb: float = 1.0) -> Buckets:
    """Trainable parameters packed, in reverse registration order (the order their gradients
    become ready), into buckets of at most `bucket_mb` MiB, the first at most
    `first_bucket_mb`; a parameter larger than its cap gets a bucket of its own."""
    return Buckets(bucket_mb, first_bucket_mb)


def module_classes(classes: Iterable[type[nn.Module]]) -> ModuleClasses:
    """A unit for every module of these classes, e.g. `module_classes({Block})`."""
    ordered = sorted(set(classes), key=lambda c: getattr(c, "__qualname__", repr(c)))
    return ModuleClasses(tuple(ordered))


def size(min_numel: int) -> Size:
    """A unit for every subtree whose not-yet-owned parameters reach `min_numel` elements."""
    return Size(min_numel)


def any_of(*policies: Policy) -> AnyOf:
    """A unit wherever any of `policies` would make one."""
    bad = [p for p in policies if not callable(p)]
    if bad:
        raise TypeError(f"policy.any_of: every policy must be callable, got {bad}.")
    return AnyOf(policies)
