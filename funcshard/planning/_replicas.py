"""What `funcshard.estimate(..., replicate=True)` plans: the state `funcshard.replicate` makes.

[Note: estimating a replicate state]
`funcshard.replicate(model, Mesh(replicate=N))` is `shard` on a mesh whose shard axis has
size 1, with the plan's units made by `policy.buckets` (DDP's gradient buckets, 25 MiB
after a first of 1 MiB) and no resharding after forward (see [Note: DDP is a mesh
shape] in funcshard/step/_replicate.py). So the estimate needs no other mechanism, only
those three choices: `replicate=True` makes them. `estimate(None, 2, replicate=True,
model=model)` plans `model` as `replicate` does; a plan given instead (other bucket sizes,
`fs.plan(model, policy=fs.policy.buckets(...))`) is taken as it is. An int mesh counts
replicas; a Mesh or (replicate, shard) must have shard 1, which `replicate` requires.
"""

from __future__ import annotations

from torch import nn

from funcshard.comm._mesh import Mesh
from funcshard.core._plan import Plan, plan
from funcshard.core._policy import buckets


def replicated(
    given: Plan | None, mesh: Mesh | int | tuple[int, int], model: nn.Module | None
) -> tuple[Plan, Mesh | tuple[int, int]]:
    """The plan and mesh sizes of `funcshard.replicate(model, mesh)`'s state."""
    where = "funcshard.estimate(replicate=True)"
    if given is None:
        if model is None:
            raise ValueError(
                f"{where}: give the model (model=...), whose buckets funcshard.replicate "
                f"would make, or a plan of buckets (fs.plan(model, policy="
                f"fs.policy.buckets(...)))."
            )
        given = plan(model, policy=buckets())
    if not isinstance(mesh, Mesh | tuple):
        return given, (mesh, 1)  # the number of replicas (checked as any mesh size)
    shard = mesh.shard_size if isinstance(mesh, Mesh) else mesh[1] if len(mesh) == 2 else 1
    if shard != 1:
        raise ValueError(
            f"{where}: funcshard.replicate holds every parameter on every rank, so the mesh's "
            f"shard axis must be 1, got {mesh!r}. Pass the number of replicas (an int), "
            f"Mesh(replicate=N), or estimate a sharded state without replicate=True."
        )
    return given, mesh
