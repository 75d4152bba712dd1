"""Hyperparameters: a learning rate is a number or a schedule of the update count, and
torch.optim's checks of rates and betas, with messages that name them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import Tensor

LearningRate = float | Callable[[int], float]
"""A learning rate: a number, or a schedule `lr(step) -> float` called once per update with
the number of updates done before it (0, 1, 2, ...)."""


def _lr_at(lr: LearningRate, done: Tensor) -> float:
    """The learning rate of the update that follows `done` updates: a schedule is called
    once, with `done` (0 for the first update), as `torch.optim.lr_scheduler.LambdaLR` and
    optax schedules count. `done` is read as an int only for a schedule: a traced step with
    a schedule breaks its graph there. Call it once per update and pass the rate on: a
    schedule may count its calls."""
    return float(lr(int(done))) if callable(lr) else float(lr)


def _check_rates(where: str, lr: LearningRate, **rates: float) -> None:
    """torch.optim's checks of its hyperparameters, with messages that name them; on every
    rank when the optimizer is made, before any collective."""
    where = f"funcshard.optim.{where}"
    if not callable(lr) and not (_is_number(lr) and lr >= 0):
        raise ValueError(f"{where}: lr must be >= 0 or a callable, got {lr!r}.")
    for name, value in rates.items():
        if not (_is_number(value) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{where}: {name} must be >= 0, got {value!r}.")


def _check_betas(where: str, betas: Any) -> tuple[float, float]:
    """Adam's `betas`: two numbers, each in [0, 1), as torch.optim.Adam requires (a beta of 1
    or more makes the moment an ever-growing sum, not an average)."""
    where = f"funcshard.optim.{where}"
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise TypeError(
            f"{where}: betas must be a pair (beta1, beta2), got {betas!r}. Pass e.g. "
            f"betas=(0.9, 0.999)."
        )
    for i, beta in enumerate(betas):
        if not (_is_number(beta) and 0 <= beta < 1):
            raise ValueError(
                f"{where}: betas[{i}] must be in [0, 1), got {beta!r}. The defaults are "
                f"betas=(0.9, 0.999)."
            )
    return float(betas[0]), float(betas[1])


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
