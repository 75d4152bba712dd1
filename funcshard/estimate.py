"""Memory and communication of a plan on a mesh, by arithmetic alone (nothing is allocated).

Per unit and rank: parameter shards, gradient shards and AdamW's two moments (all in the
parameter dtype, as `funcshard.optim` keeps them), the full size of the unit while gathered
(in the mixed-precision param dtype), and the bytes the rank sends per training step with
ring collectives: an all-gather or reduce-scatter over S ranks sends (S - 1) shards, an
all-reduce over R replicas sends 2 (R - 1) / R of the shard. Units are resharded after
forward and regathered in backward, except the root, which stays gathered (as `call` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from funcshard.plan import Plan, Unit


@dataclass(frozen=True)
class UnitEstimate:
    """Bytes per rank for one unit."""

    name: str
    params: int
    grads: int
    optimizer: int
    gathered: int
    sent_per_step: int


@dataclass(frozen=True)
class Estimate:
    """Per-unit estimates and the totals a rank needs."""

    units: tuple[UnitEstimate, ...]
    replicate: int
    shard: int

    @property
    def persistent(self) -> int:
        """Parameters, gradients and optimizer state held for the whole step."""
        return sum(u.params + u.grads + u.optimizer for u in self.units)

    @property
    def gathered_peak(self) -> int:
        """The root gathered all step, plus the two largest other units (running + prefetched)."""
        root = sum(u.gathered for u in self.units if u.name == "")
        others = sorted((u.gathered for u in self.units if u.name != ""), reverse=True)
        return root + sum(others[:2])

    @property
    def sent_per_step(self) -> int:
        return sum(u.sent_per_step for u in self.units)


def estimate(
    plan: Plan, replicate: int, shard: int, param_dtype: torch.dtype | None = None
) -> Estimate:
    """Estimate `plan` on a (replicate, shard) mesh, gathering in `param_dtype` if given."""
    return Estimate(
        units=tuple(_unit(u, replicate, shard, param_dtype) for u in plan.units),
        replicate=replicate,
        shard=shard,
    )


def _unit(unit: Unit, replicate: int, shard: int, param_dtype: torch.dtype | None) -> UnitEstimate:
    params = grads = optimizer = gathered = sent = 0
    for dtype in unit.dtypes:
        numel = sum(
            torch.Size(s).numel()
            for s, d in zip(unit.shapes, unit.param_dtypes, strict=True)
            if d == dtype
        )
        shard_numel = -(-numel // shard)
        size = dtype.itemsize
        compute = size if (param_dtype is None or unit.keep_fp32) else param_dtype.itemsize
        params += shard_numel * size
        gathered += shard_numel * shard * compute
        gathers = 1 if unit.name == "" else 2  # the root is not regathered in backward
        sent += gathers * (shard - 1) * shard_numel * compute
        if not unit.frozen:
            grads += shard_numel * size
            optimizer += 2 * shard_numel * size
            sent += (shard - 1) * shard_numel * compute  # reduce-scatter
            sent += 2 * (replicate - 1) * shard_numel * compute // replicate  # all-reduce
    return UnitEstimate(unit.name, params, grads, optimizer, gathered, sent)
