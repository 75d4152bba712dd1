"""Random streams per data-parallel rank, derived from one seed as JAX derives keys.

[Note: randomness per rank]
`torch.manual_seed(0)` on every rank gives every rank the same random stream, so dropout
drops the same positions on every rank: the ranks' micro-batches differ, but their masks do
not, which is not what one process training on the global batch would draw. (Parameter
initialization is the opposite case: `fs.shard` draws it so that every world size builds
the same model, and needs no per-rank seed.)

So each rank derives its own seed from the base seed and its data-parallel index, as JAX
code does with `fold_in(key, axis_index)`: `fold_in` mixes integers into a seed with
SplitMix64's finalizer, a bijection on 64 bits, so distinct inputs give unrelated streams.
Deriving the seed from the step as well (`rank_seed(seed, mesh, step)`, re-seeded at the top
of every step) makes the stream a function of (seed, rank, step) alone: a run resumed from
a checkpoint at step N draws exactly what the uninterrupted run drew at step N, with no
generator state to save. Every rank of an FSDP, HSDP or DDP mesh has its own micro-batch,
so every rank has its own index.
"""

from __future__ import annotations

import torch

from funcshard.comm._mesh import Mesh

_MASK = (1 << 64) - 1


def fold_in(seed: int, *data: int) -> int:
    """A new seed that mixes each of `data` into `seed` (a non-negative int below 2**63,
    which torch.manual_seed takes): the same inputs give the same seed, and changing any
    input gives an unrelated one."""
    state = _mix(seed & _MASK)
    for value in data:
        state = _mix((state + 0x9E3779B97F4A7C15 * (1 + (value & _MASK))) & _MASK)
    return state >> 1


def _mix(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit ints that spreads every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def data_parallel_index(mesh: Mesh) -> int:
    """This rank's index among the mesh's data-parallel ranks (each gets its own
    micro-batch): replicate index times shard size plus shard index."""
    return mesh.replicate_rank * mesh.shard_size + mesh.shard_rank


def rank_seed(seed: int, mesh: Mesh, step: int | None = None) -> int:
    """This rank's seed: `seed` folded with its data-parallel index (and `step`, if given)."""
    index = data_parallel_index(mesh)
    return fold_in(seed, index) if step is None else fold_in(seed, index, step)


def manual_seed(seed: int, mesh: Mesh, step: int | None = None) -> int:
    """Seed torch's global generators (CPU and every GPU: what nn.Dropout draws from) with
    this rank's `rank_seed`; call it at the top of each step with `step` so a resumed run
    draws what the uninterrupted one did. Returns the seed used."""
    derived = rank_seed(seed, mesh, step)
    torch.manual_seed(derived)
    return derived


def rank_generator(
    seed: int, mesh: Mesh, step: int | None = None, device: torch.device | str = "cpu"
) -> torch.Generator:
    """A generator of its own for this rank (for `torch.rand(..., generator=g)`), seeded
    with `rank_seed(seed, mesh, step)`."""
    return torch.Generator(device=device).manual_seed(rank_seed(seed, mesh, step))
