"""Communication as user functions: the gather and the reduce of the differentiable gather.

[Note: communication as user functions]
A research idea in data parallelism is mostly a different collective: a quantized weight
all-gather (ZeRO++'s int8 blockwise weights with their scales), a compressed gradient
reduce with error feedback (1-bit Adam, PowerSGD), or communicating less often (local SGD).
FSDP2 takes the first two as custom all-gather classes and tensor-subclass hooks, DDP the
second as a comm hook with a mutable state object. Here they are two plain functions in a
frozen record, `Comm(gather=..., reduce=...)`, passed as an argument to what runs the
differentiable gather (`fs.call`, `fs.value_and_grad`, `fs.reduce`), never stored in a
state:

- `gather(shard, axis) -> full`: this rank's 1-D shard in the state's own dtype (the fp32
  master, not the mixed-precision copy, so a quantizer sees full precision) to the whole
  flat buffer, `axis.size * shard.numel()` elements, in rank order. It replaces the
  all-gather over the shard axis in forward and the regather in backward (the same
  function of the same shard, so both see the same values); funcshard casts the result to
  the gather dtype. Its derivative is not asked for: the op's backward is the reduce, as if
  the gather were exact, which for a quantizer is the straight-through estimator.
- `reduce(full, axis) -> shard`: the full flat gradient (in the reduce dtype, frozen
  members zeroed, padding zero) to this rank's chunk of its mean over the shard axis,
  replacing the reduce-scatter in the op's backward (HSDP's mean across replicas follows,
  as by default).

`axis` is a `MeshAxis`, the shard axis of the state's mesh, whose collectives (`all_gather`,
`all_to_all`, `reduce_scatter`, `all_reduce`) run eagerly, under torch.compile and under
make_fx, and are counted by `collectives.record()` like funcshard's own. So the user
functions run inside the one op (see [Note: one differentiable gather]) and compose with
what the op supports: mixed precision, HSDP, reshard k (the 1/k slices kept after forward
are of the user-gathered buffer, regathered exactly with a plain all-gather), accumulation
(`reduce=False` then `fs.reduce(..., comm=...)`), `torch.autograd.grad`, `torch.func` and
torch.compile. A size-1 shard axis communicates nothing and calls neither function, but on
a DDP mesh (`fs.replicate`: one-rank shard axis, several replicas) the reduce takes the
place of each bucket's all-reduce: it gets the replicate axis and returns the whole mean
(the one rank's "chunk" of a one-rank shard axis is the whole buffer). A DDP state gathers
nothing, so a `Comm` with a gather is refused there. Under `all_reduce=False` nothing is
reduced across replicas and a DDP buffer's reduce does not run.

State: a reduce with error feedback keeps a residual (what compression dropped, sent with
the next step's gradient). It is explicit state the caller threads, as optimizer state:
`carry=` in, the new carry out (`fs.value_and_grad(f, comm=c, carry=r)` returns
`(value, grads, r)`, `fs.reduce(state, g, comm=c, carry=r)` returns `(grads, r)`), and the
function is `reduce(full, axis, carry) -> (shard, carry)`. A stateful reduce is not linear,
so it must see a buffer's whole gradient once per step, while autograd may split that
gradient over several gather nodes (a tied weight, a module run twice, two calls in one
loss): with a carry, the op's backward leaves each buffer's full gradient in its sink (as
`reduce=False` does, autograd summing the pieces) and the reduce runs once per buffer after
backward. That costs what `reduce=False` costs: every full-size gradient held until backward
ends. `carry_zeros(state)` is the usual start: one full-size zero buffer per trainable flat
buffer, in the reduce dtype, so the residual of an fp32 reduce costs 4 bytes per parameter
of the whole model on every rank (DDP's gradient buffer, N times a shard's fp32 copy).

[Note: what a Comm is told about its buffer]
A flat buffer concatenates several parameters (see [Note: flat buffers] in core/_layout.py), and a
compression that works per parameter (PowerSGD's low-rank factors of each weight matrix, a
per-tensor scale) needs to know where each one lies. The `MeshAxis` a gather or a reduce
receives says it, as static attributes derived from the layout: `buffer` (the buffer's name,
`unit[dtype]`; on a DDP mesh the units are the gradient buckets), and per parameter in
buffer order `fqns`, `shapes`, `numels` and `offsets`, each offset an index into the full
(padded) buffer: the gather's result and the reduce's input. Parameter i is
`full[offsets[i]:offsets[i] + numels[i]].view(shapes[i])`; the elements past the last one
are padding (zero in a gradient). Rank r's shard is `full[r * n:(r + 1) * n]` with
`n = full.numel() // axis.size` on the shard axis, where a parameter may straddle shards;
that is why the description is of the full buffer. The frozen members of a trainable buffer
(`plan(frozen="warn")`) are listed with zero gradients. Being plain tuples and strings on a
frozen record, the attributes cost nothing per step (eagerly the axis is made once per
layout, with the buffer's gather spec) and are constants to torch.compile (no guard, no
recompilation). Parameters outside the flat buffers (a plan's `ignored`) are not shown to
a `Comm`; their gradients are all-reduced as ever.

Costs of the defaults: none. Without a `Comm` every path is the one it was (the gathers are
prefetched, the reduce-scatters issued asynchronously and overlapped with backward). A user
gather or reduce runs synchronously where the op needs it: gathers are not prefetched, and
reduces do not overlap backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.comm._mesh import Mesh


@dataclass(frozen=True)
class Comm:
    """The gather and the reduce of the differentiable gather, as user functions (see
    [Note: communication as user functions]); None keeps funcshard's collective.

    `gather(shard, axis) -> full`; `reduce(full, axis) -> shard`, or with a carry
    `reduce(full, axis, carry) -> (shard, carry)`. `axis` is the shard axis (`MeshAxis`;
    on a DDP mesh the reduce's is the replicate axis and its shard the whole mean), and says
    what the buffer holds (see [Note: what a Comm is told about its buffer]).
    """

    gather: Callable[..., Tensor] | None = None
    reduce: Callable[..., object] | None = None

    def __post_init__(self) -> None:
        for name in ("gather", "reduce"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise TypeError(
                    f"funcshard.Comm: {name} must be a function or None, got {type(fn).__name__}."
                )


@dataclass(frozen=True)
class MeshAxis:
    """One axis of a mesh ("shard" or "replicate") as user communication sees it: its size,
    this rank's index on it, and collectives over it that return finished tensors (eagerly
    issued and waited, counted by `collectives.record()`; graph nodes when traced).

    The axis a `Comm`'s gather and reduce receive also says what the flat buffer holds, so a
    compression can work per parameter (see [Note: what a Comm is told about its buffer]):
    `buffer` its name (`unit[dtype]`), and per parameter in buffer order `fqns`, `shapes`,
    `numels` and `offsets` (where each starts in the full, padded buffer). All static: the
    same on every rank and every step. An axis made by hand describes no buffer (all empty).
    """

    mesh: Mesh
    name: str = "shard"
    buffer: str = ""
    fqns: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    numels: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.name not in ("shard", "replicate"):
            raise ValueError(
                f"funcshard.MeshAxis: name must be 'shard' or 'replicate', got {self.name!r}."
            )

    @property
    def size(self) -> int:
        return self.mesh.shard_size if self.name == "shard" else self.mesh.replicate_size

    @property
    def rank(self) -> int:
        return self.mesh.shard_rank if self.name == "shard" else self.mesh.replicate_rank

    @property
    def _group(self):  # a ProcessGroup (only the comm wing names the type)
        return self.mesh.shard_group if self.name == "shard" else self.mesh.replicate_group

    def all_gather(self, x: Tensor) -> Tensor:
        """Every rank's `x` concatenated along dim 0, in rank order."""
        flat = x.reshape(-1)
        if _compiling():
            out = collectives.gathered(flat, self._group)
        else:
            out = collectives.all_gather(flat, self._group, what="<user gather>").wait()
        return out.view(self.size * x.shape[0], *x.shape[1:]) if x.dim() else out

    def all_to_all(self, x: Tensor) -> Tensor:
        """Rank r's chunk j of `x` (split along dim 0 into `size` equal chunks) lands as
        chunk r on rank j: what a reduce-scatter sends, without reducing."""
        if x.shape[0] % self.size:
            raise ValueError(
                f"funcshard.MeshAxis.all_to_all: dim 0 ({x.shape[0]}) must divide into "
                f"{self.size} equal chunks, one per rank of the {self.name} axis."
            )
        if _compiling():
            return collectives.all_to_alled(x.contiguous(), self._group)
        return collectives.all_to_all(x.contiguous(), self._group, what="<user reduce>").wait()

    def reduce_scatter(self, x: Tensor, op: str = "avg") -> Tensor:
        """Chunk `rank` of `x` (1-D) reduced over the axis by `op` ("avg" or "sum")."""
        if _compiling():
            return collectives.reduced_scattered(x, self._group, op)
        return collectives.reduce_scatter(x, self._group, op, what="<user reduce>").wait()

    def all_reduce(self, x: Tensor, op: str = "avg") -> Tensor:
        """`x` reduced over the axis by `op` ("avg" or "sum"), on every rank."""
        if _compiling():
            return collectives.all_reduced(x, self._group, op)
        return collectives.all_reduce(x, self._group, op, what="<user all-reduce>").wait()


def _compiling() -> bool:
    return torch.compiler.is_dynamo_compiling()
