"""What the gather of one flat buffer needs (`GatherSpec`: where, in what dtypes, which reduce
transposes it), made once per layout, and the state `value_and_grad` differentiates
(`Differentiated`), whose fields choose the specs of its calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.comm._comm import Comm, MeshAxis
from funcshard.comm._mesh import Mesh
from funcshard.core._layout import FlatLayout, Layout
from funcshard.core._precision import MixedPrecision, gather_dtype, reduce_dtype
from funcshard.core._state import ShardedState
from funcshard.core._tree import register_record


@dataclass(frozen=True)
class GatherSpec:
    """What the gather of one flat buffer needs: where, in what dtypes, and which reduce
    transposes it. `gather_dtype`, `reduce_dtype` and `device` are derived once."""

    flat: FlatLayout
    mesh: Mesh
    mp: MixedPrecision | None
    reduction: str = "mean"  # "mean" | "shard" | "none"
    comm: Comm | None = None  # the user's gather and reduce, if any

    if TYPE_CHECKING:  # set by __post_init__; declared for type checkers only, not fields
        gather_dtype: torch.dtype = field(init=False)
        reduce_dtype: torch.dtype = field(init=False)
        device: torch.device = field(init=False)
        axis: MeshAxis = field(init=False)

    @property
    def user_gather(self) -> bool:
        return self.comm is not None and self.comm.gather is not None and self.mesh.shard > 1

    @property
    def user_reduce(self) -> bool:
        """Whether the user's reduce replaces funcshard's: over the shard axis, or on a DDP
        mesh (a one-rank shard axis) over the replicate axis, in place of the all-reduce
        (reduction "mean" only: without the all-reduce there is nothing to replace)."""
        if self.comm is None or self.comm.reduce is None:
            return False
        return self.mesh.shard > 1 or (self.replicated and self.reduction == "mean")

    @property
    def replicated(self) -> bool:
        """Whether this is a DDP buffer: whole on every rank of a replicate axis."""
        return self.mesh.shard == 1 and self.mesh.replicate > 1

    @property
    def across_replicas(self) -> bool:
        if self.replicated and self.user_reduce:  # the user's reduce is the all-reduce
            return False
        return self.reduction == "mean" and not collectives.alone(self.mesh.replicate_group)

    def __post_init__(self) -> None:
        # computed once per spec (specs are made once per layout: `_specs`), not per step
        object.__setattr__(self, "gather_dtype", gather_dtype(self.mp, self.flat))
        object.__setattr__(self, "reduce_dtype", reduce_dtype(self.mp, self.flat))
        object.__setattr__(self, "device", self.mesh.device)  # the mesh's device then
        # what a user's gather and reduce receive: see [Note: what a Comm is told about its
        # buffer]; over the replicate axis on a DDP mesh, whose shard axis has one rank
        axis = "replicate" if self.replicated else "shard"
        object.__setattr__(self, "axis", _axis_of_buffer(self.mesh, axis, self.flat))


def _axis_of_buffer(mesh: Mesh, name: str, flat: FlatLayout) -> MeshAxis:
    """The axis `name` of `mesh` as a Comm sees it, describing the flat buffer `flat`."""
    return MeshAxis(mesh, name, flat.name, flat.fqns, flat.shapes, flat.numels, flat.offsets)


@dataclass(frozen=True, eq=False)
class Differentiated(ShardedState):
    """The state `funcshard.value_and_grad` hands the function it differentiates: the state
    itself, plus how its gathers are transposed (`reduction`: "mean", "shard" or "none"),
    the full-size gradient targets of the buffers not reduced (`sinks`, None for a frozen
    buffer and one that reduces: a buffer with a sink takes reduction "none", see [Note:
    units kept local] in funcshard/step/_keep_local.py),
    the prefetch orders of its calls, the buffers a GatheredState keeps gathered
    (`gathered`, empty otherwise: see [Note: keeping units gathered]), and the user
    communication its calls default to (`comm`, a `funcshard.Comm` of value_and_grad's
    arguments: the caller's state never holds it)."""

    reduction: str = "mean"
    sinks: tuple[Tensor | None, ...] | None = None
    prefetch: Any = True
    gathered: tuple[Tensor, ...] = ()
    comm: Comm | None = None


register_record(
    Differentiated,
    data_fields=("shards", "replicated", "buffers", "sinks", "gathered"),
    meta_fields=(
        "layout",
        "mp",
        "reshard_after_forward",
        "offload",
        "reduction",
        "prefetch",
        "comm",
    ),
)


def specs_and_sinks(
    state: ShardedState, comm: Comm | None = None
) -> tuple[tuple[GatherSpec, ...], tuple[Tensor | None, ...]]:
    """How each flat buffer of `state` is gathered, and its gradient sink (None but under
    `value_and_grad(reduce=False)`): what the eager and the traced call both need. `comm`
    is the call's own; without it, value_and_grad's (if any)."""
    differentiated = state if isinstance(state, Differentiated) else None
    reduction = differentiated.reduction if differentiated is not None else "mean"
    if comm is None and differentiated is not None:
        comm = differentiated.comm
    if comm is not None and not isinstance(comm, Comm):
        raise TypeError(f"funcshard.call: comm must be a funcshard.Comm, got {comm!r}.")
    layout = state.layout
    mesh = layout.mesh
    if comm is not None and comm.gather is not None and mesh.shard == 1 and mesh.replicate > 1:
        raise ValueError(
            f"funcshard.Comm: this state is replicated (DDP: its shard axis has one rank), so "
            f"it gathers nothing and the Comm's gather would never run, got "
            f"gather={comm.gather!r}. Pass funcshard.Comm(reduce=...) alone (on a DDP state "
            f"it replaces the all-reduce across replicas), or shard the state (fs.shard, or "
            f"an HSDP mesh) to use a gather."
        )
    specs = _specs(layout, state.mp, reduction, comm)
    sinks = differentiated.sinks if differentiated is not None else None
    if sinks is None:
        return specs, (None,) * len(specs)
    if reduction != "none":  # some buffers kept local: see [Note: units kept local]
        kept = _specs(layout, state.mp, "none", comm)
        specs = tuple(k if s is not None else p for p, k, s in zip(specs, kept, sinks, strict=True))
    return specs, sinks


def _specs(
    layout: Layout, mp: MixedPrecision | None, reduction: str, comm: Comm | None
) -> tuple[GatherSpec, ...]:
    """The gather specs of a layout's buffers, made once per (layout, mp, reduction, comm)
    object and reused by every later call with the same ones: their cached dtypes and
    device are then computed once, not per step."""
    if torch.compiler.is_dynamo_compiling():
        return tuple(GatherSpec(flat, layout.mesh, mp, reduction, comm) for flat in layout.flats)
    key = (id(layout), id(mp), reduction, id(comm))
    hit = _SPECS.get(key)
    if hit is not None and hit[0] is layout and hit[1] is mp and hit[2] is comm:
        return hit[3]
    specs = tuple(GatherSpec(flat, layout.mesh, mp, reduction, comm) for flat in layout.flats)
    if len(_SPECS) >= _SPECS_KEPT:
        _SPECS.pop(next(iter(_SPECS)))  # the oldest: states of finished runs
    _SPECS[key] = (layout, mp, comm, specs)  # holding them keeps the ids from being reused
    return specs


_SPECS: dict[tuple, tuple[Layout, MixedPrecision | None, Comm | None, tuple]] = {}
_SPECS_KEPT = 64
