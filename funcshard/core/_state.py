"""ShardedState and ShardedGrads: the immutable records the transforms pass around.

Both are frozen dataclasses registered as pytrees (see `funcshard.core._tree.register_record`): the
tensors are children, the layout and settings are static aux data, so a tree map over a state
maps over its local shards (and its replicated parameters and buffers), and torch.func and
torch.compile see every tensor as an input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tabulate import tabulate
from torch import Tensor

from funcshard.core._donation import DonatedError as DonatedError
from funcshard.core._donation import donatable, ensure_live
from funcshard.core._donation import donate as donate
from funcshard.core._layout import Layout
from funcshard.core._precision import MixedPrecision
from funcshard.core._tree import register_record


@dataclass(frozen=True, eq=False)
class ShardedState:
    """A model's parameters sharded over a mesh, plus its replicated tensors.

    `shards[i]` is this rank's slice of `layout.flats[i]`, 1-D with `shard_numel` elements.
    `replicated` holds the plan's ignored parameters whole, and `buffers` the module's buffers
    (broadcast from the mesh's first rank). Build one with `funcshard.shard`.
    """

    shards: tuple[Tensor, ...]
    replicated: dict[str, Tensor]
    buffers: dict[str, Tensor]
    layout: Layout
    mp: MixedPrecision | None = None
    reshard_after_forward: bool | int = True
    offload: bool = False
    _donated_to: ClassVar[str | None] = None  # set on a donated record (see `donate`)

    def leaves(self) -> list[Tensor]:
        """The trainable view's leaves: the shards, then the replicated parameters in
        `layout.replicated` order (what optimizers update; buffers are not among them)."""
        return [*self.shards, *(self.replicated[f] for f in self.layout.replicated)]

    def replace(self, **changes: Any) -> ShardedState:
        """A copy with some fields changed (the record itself never changes)."""
        ensure_live(self, "ShardedState.replace")
        return dataclasses.replace(self, **changes)

    def buckets_table(self) -> str:
        """One row per flat buffer (a DDP bucket, for `replicate`): index, bytes, params."""
        rows = [
            [
                i,
                flat.name,
                f"{flat.numel * flat.dtype.itemsize:,}",
                len(flat.fqns),
                ", ".join(flat.fqns[:3]) + (" ..." if len(flat.fqns) > 3 else ""),
            ]
            for i, flat in enumerate(self.layout.flats)
        ]
        return tabulate(rows, headers=["index", "unit", "bytes", "params", "first params"])

    def __repr__(self) -> str:
        if self._donated_to is not None:
            return f"ShardedState(donated to {self._donated_to})"
        mesh = self.layout.mesh
        lines = [
            f"  {flat.name}: {len(flat.fqns)} params, {flat.numel:,} numel, "
            f"shard ({flat.shard_numel:,},){' frozen' if flat.frozen else ''}"
            for flat in self.layout.flats
        ]
        if self.replicated:
            lines.append(f"  replicated: {len(self.replicated)} params")
        if self.buffers:
            lines.append(f"  buffers: {len(self.buffers)}")
        header = (
            f"ShardedState(mesh replicate={mesh.replicate} x shard={mesh.shard}, "
            f"shard rank {mesh.shard_rank}, {len(self.layout.units)} units"
        )
        return header + "\n" + "\n".join(lines) + "\n)"


@dataclass(frozen=True, eq=False)
class ShardedGrads:
    """Gradients shaped like a state's parameters: `shards[i]` matches `layout.flats[i]`,
    `replicated[fqn]` the state's replicated (ignored) parameter `fqn`, whole.

    Frozen units and frozen replicated parameters have `None`; padding is always zero.
    A ShardedGrads built without `replicated` has None for every replicated parameter.
    """

    shards: tuple[Tensor | None, ...]
    layout: Layout
    replicated: dict[str, Tensor | None] = field(default_factory=dict)
    # whether every rank's loss and gradients were finite (funcshard/step/_finite.py): not
    # a pytree field, so a tree map's result carries none
    verdict: Any = field(default=None, repr=False)
    # which parameters no rank used (funcshard/step/_usage.py): not a pytree field either
    usage: Any = field(default=None, repr=False)
    _donated_to: ClassVar[str | None] = None

    @property
    def unused(self) -> frozenset[str]:
        """The parameters no rank's loss reached this step (torch.optim's `.grad is None`):
        their gradients are zeros, and funcshard's optimizers leave them and their state
        alone (see [Note: unused parameters] in funcshard/step/_usage.py). Empty when not
        tracked (a traced step, `unused="zeros"`)."""
        return frozenset() if self.usage is None else self.usage.unused()

    def leaves(self) -> list[Tensor | None]:
        """The shards, then the replicated gradients in `layout.replicated` order: in step
        with `ShardedState.leaves()`."""
        return [*self.shards, *(self.replicated.get(f) for f in self.layout.replicated)]

    def __repr__(self) -> str:
        if self._donated_to is not None:
            return f"ShardedGrads(donated to {self._donated_to})"
        kept = sum(s is not None for s in self.shards)
        replicated = sum(g is not None for g in self.replicated.values())
        more = f", {replicated} replicated" if self.layout.replicated else ""
        return f"ShardedGrads({kept} of {len(self.shards)} flat buffers{more})"


@dataclass(frozen=True, eq=False)
class LocalGrads:
    """Gradients of one rank not all reduced yet: hand them to `funcshard.reduce`, which
    reduces what is still local (optimizers refuse them, naming the local units).

    `value_and_grad(..., reduce=False)` gives every unit's unreduced full-size gradients,
    by FQN in `grads` (None for frozen parameters; the replicated parameters' too), for
    accumulating over micro-batches before one reduce. `value_and_grad(...,
    keep_local=units)` gives those units' in `grads` and the other buffers reduced:
    `shards[i]` is this rank's reduced shard of `layout.flats[i]` (None for a buffer still
    local, or frozen), `replicated` the replicated parameters' reduced gradients, and
    `across_replicas` whether the shards were all-reduced across replicas (see [Note: units
    kept local] in funcshard/step/_keep_local.py). `shards` is empty when no buffer is
    reduced. Local gradients are kept in each parameter's reduce dtype.
    """

    grads: dict[str, Tensor | None]
    layout: Layout
    shards: tuple[Tensor | None, ...] = ()
    replicated: dict[str, Tensor | None] = field(default_factory=dict)
    across_replicas: bool = True
    # the parameters this rank's loss did not reach (see [Note: unused parameters] in
    # funcshard/step/_usage.py), agreed over the ranks by `funcshard.reduce`; None: untracked
    unused: frozenset[str] | None = field(default=None, repr=False)

    @property
    def local_flats(self) -> tuple[int, ...]:
        """Indices of the trainable flat buffers whose gradients are still local."""
        return tuple(
            i
            for i, flat in enumerate(self.layout.flats)
            if not flat.frozen and (not self.shards or self.shards[i] is None)
        )

    @property
    def local_units(self) -> tuple[str, ...]:
        """The units whose gradients are still local, in plan order ("" is the root)."""
        return tuple(dict.fromkeys(self.layout.flats[i].unit for i in self.local_flats))


register_record(
    ShardedState,
    data_fields=("shards", "replicated", "buffers"),
    meta_fields=("layout", "mp", "reshard_after_forward", "offload"),
)
register_record(ShardedGrads, data_fields=("shards", "replicated"), meta_fields=("layout",))
donatable(ShardedState, ("shards", "replicated", "buffers"))
donatable(ShardedGrads, ("shards", "replicated"))
register_record(
    LocalGrads,
    data_fields=("grads", "shards", "replicated"),
    meta_fields=("layout", "across_replicas"),
)
