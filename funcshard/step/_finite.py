"""Non-finite losses and gradients, decided by every rank together.

[Note: one decision for all ranks]
After a reduce-scatter a NaN that one rank's batch produced sits only in the shard of the
rank that owns its position, so ranks looking at their own shards disagree about whether a
step went wrong; a rank that skipped its update while the others applied theirs would leave
the replicas of a parameter different forever. So each rank computes one flag per leaf and
the flags cross the mesh in one collective: every rank then sees the same verdict and acts
alike (raise everywhere, or skip everywhere).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.core._groups import GroupView
from funcshard.core._state import LocalGrads, ShardedGrads


class NonFiniteError(FloatingPointError):
    """A loss or gradient held NaN or inf on some rank; raised on every rank alike."""

    on_every_rank = True  # the ranks stay in step (see [Note: a rank out of step])


def local_flags(tensors: list[Tensor | None]) -> Tensor:
    """One int64 per tensor: 1 where it holds a NaN or inf (None counts as finite)."""
    flags = [
        torch.zeros((), dtype=torch.bool) if t is None else t.isfinite().all().logical_not()
        for t in tensors
    ]
    return torch.stack([f.cpu() for f in flags]).to(torch.int64) if flags else torch.zeros(0)


def any_nonfinite(grads: Any) -> bool:
    """Whether any rank's gradients hold a NaN or inf: the same answer on every rank.

    Communicates: one all-reduce of a single integer over the whole mesh (none for a dict).
    """
    leaves = _leaves(grads)
    bad = local_flags(leaves).sum().reshape(1)
    if isinstance(grads, ShardedGrads | LocalGrads | GroupView):
        mesh = grads.layout.mesh
        bad = collectives.all_reduce(
            bad.to(mesh.device), mesh.group, "sum", what="<non-finite check>"
        ).wait()
    return bool(bad.item() > 0)


def check(loss: Tensor, grads: Any) -> None:
    """Raise NonFiniteError on every rank if any rank's loss or gradients are not finite.

    The message names the ranks whose loss was not finite and, per unit, the ranks whose
    gradient shards were not. Communicates: one all-gather of one flag per buffer.
    """
    flags = local_flags([loss.detach(), *_leaves(grads)])
    if isinstance(grads, ShardedGrads):
        names = [f"unit {f.unit!r}" for f in grads.layout.flats] + [
            repr(f) for f in grads.layout.replicated
        ]
    else:
        names = list(grads.grads if isinstance(grads, LocalGrads) else grads)
    if isinstance(grads, ShardedGrads | LocalGrads):
        mesh = grads.layout.mesh
        # the flags tensor itself is gathered, and read once: under torch.compile that is
        # one collective in the graph and one break, after it (see [Note: bookkeeping
        # outside compiled graphs] in funcshard/comm/_collectives.py)
        every = collectives.all_gather(flags.to(mesh.device), mesh.group, what="<non-finite check>")
        rows = every.wait().view(-1, flags.numel()).tolist()
        ranks = list(mesh.ranks)
    else:
        rows, ranks = [flags.tolist()], [0]
    if not any(any(row) for row in rows):
        return
    problems = []
    bad_loss = [r for r, row in zip(ranks, rows, strict=True) if row[0]]
    if bad_loss:
        problems.append(f"the loss on ranks {bad_loss}")
    for i, name in enumerate(names, start=1):
        holders = [r for r, row in zip(ranks, rows, strict=True) if row[i]]
        if holders:
            problems.append(f"gradients of {name} (on ranks {holders})")
    raise NonFiniteError(
        f"funcshard.value_and_grad(check_finite=True): NaN or inf in {'; '.join(problems)}. "
        f"Every rank raises together. To skip such steps instead, wrap the optimizer in "
        f"funcshard.optim.skip_nonfinite(...); to find the op that made them, run with "
        f"torch.autograd.set_detect_anomaly(True)."
    )


def _leaves(grads: Any) -> list[Tensor | None]:
    if isinstance(grads, ShardedGrads | GroupView):
        return grads.leaves()
    if isinstance(grads, LocalGrads):
        return list(grads.grads.values())
    return list(grads.values())
