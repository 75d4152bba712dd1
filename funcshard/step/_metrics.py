"""Reductions across the data-parallel ranks, for metrics and logging: JAX's psum and pmean
over a mesh's ranks, and the global gradient norm.

A rank's loss is the loss of its own batch; what a log should show is the mean over every
data-parallel rank. `pmean(tree, mesh)` is that, for every tensor of a pytree. A small tree
(at most `_INLINE` elements, a dict of metrics) is packed into one float64 buffer and
reduced in one collective; a larger one in one buffer per floating dtype, reduced in that
dtype, and one float64 buffer for numbers and integer tensors. Results keep their leaves'
floating dtypes (numbers and integers come back as float64). `axis=` reduces over one mesh
axis only: `pmean(delta, mesh, axis="replicate")` averages what the replicas of each shard
hold (a parameter delta in local SGD / DiLoCo, see examples/diloco.py), and works on
ShardedState and ShardedGrads as on any pytree of tensors.

[Note: checking a reduced tree across ranks]
Leaves are reduced in order (optree's: dict keys sorted), each with the same one of every
rank, so every rank must pass the same leaves (pytree paths, shapes, dtypes). Ranks whose
metric dicts have different keys used to issue collectives of other sizes (or other counts):
gloo then waits until its timeout or aborts the process. So each rank also sends a 64-bit
digest of its leaves (their paths, shapes and dtypes, hashed once per tree shape) and every
rank raises the same error when they differ.

The digest travels in the reduction itself, not in a collective of its own: the first
collective is a float64 buffer of fixed length, `[digest | inline payload]`, the same on
every rank whatever its tree. An all-reduce can only sum, so the digest goes as 4 pieces p
of 16 bits, each beside its square: after the sum, a piece is equal on all n ranks exactly
when n * sum(p^2) == sum(p)^2 (Cauchy-Schwarz: equality only for equal terms), a verdict
read from the reduced buffer alone, hence the same on every rank. The sums are integers
below 2^53 (n * 2^32, for up to 2^21 ranks), exact in float64. A small tree's values fill
the rest of that buffer, so a metrics dict costs one collective, as before; a larger tree's
buffers follow only once the digests agreed. One collective cannot do more in general: a
collective's size must be the same on every rank before it is issued, and the size of a
tree is what is in question; hence the fixed buffer first, and the payload in it when it
fits. When the digests differ every rank gathers every rank's leaves (the error path only)
and raises naming each path that is missing somewhere or differs in shape or dtype, and on
which ranks.

While a step is traced (torch.compile, make_fx) nothing is checked: the program is fixed,
and reading the digest back would be a graph break; the tree is reduced as it would be
after an agreeing check, so a compiled step compiles once and computes what eager does.
Eagerly on CUDA, reading the verdict waits for the all-reduce, as a `.item()` of the
result would.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.comm import _process_groups as process_groups
from funcshard.comm._mesh import Mesh
from funcshard.core._groups import GroupView
from funcshard.core._state import ShardedGrads, ensure_live

_PIECES = 4  # the digest's 16-bit pieces: 64 bits
_HEADER = 2 * _PIECES  # each piece and its square
_INLINE = 24  # elements a tree may have to travel in the checked collective itself: a gloo
# all-reduce of 32 float64 costs what one of 4 float32 does, one of 128 about 8 us more
_DIGESTS: dict[Any, Tensor] = {}  # (treespec, shapes and dtypes) -> `_header`'s buffer
_DIGESTS_KEPT = 64


def psum(tree: Any, mesh: Mesh, axis: str | None = None) -> Any:
    """Each tensor (or number) of `tree` summed over every rank of `mesh` (or of one mesh
    `axis`, "shard" or "replicate"), the same result on each of those ranks, as tensors.
    Every rank must pass the same leaves (paths, shapes, dtypes); a difference raises on
    every rank, naming it (see [Note: checking a reduced tree across ranks]).
    Communicates: one all-reduce over the mesh (or axis) for a tree of at most 24
    elements; a larger one adds one all-reduce per floating dtype, and one for numbers and
    integers."""
    return _reduced(tree, mesh, mean=False, axis=axis)


def pmean(tree: Any, mesh: Mesh, axis: str | None = None) -> Any:
    """Each tensor (or number) of `tree` averaged over every rank of `mesh` (or of one mesh
    `axis`, "shard" or "replicate"), the same result on each of those ranks, as tensors.
    Every rank must pass the same leaves (paths, shapes, dtypes); a difference raises on
    every rank, naming it (see [Note: checking a reduced tree across ranks]).
    Communicates: one all-reduce over the mesh (or axis) for a tree of at most 24
    elements; a larger one adds one all-reduce per floating dtype, and one for numbers and
    integers."""
    return _reduced(tree, mesh, mean=True, axis=axis)


NORM_TYPES = (1.0, 2.0, float("inf"))  # those of clip_grad_norm_ that reduce exactly


def global_norm(
    grads: ShardedGrads | GroupView | Mapping[str, Tensor | None], norm_type: float = 2.0
) -> Tensor:
    """The norm of the whole gradient, a 0-d float32 tensor: `clip_grad_norm_`'s total norm
    for `norm_type` 1, 2 (the default) or inf. Of ShardedGrads: every parameter of every
    rank's shard counted once, the same on every rank (one all-reduce of one number over
    the shard axis, a max for inf; replicas hold the same shards). Of a dict of gradients:
    this process's, no communication."""
    norm_type = checked_norm_type(norm_type, "global_norm")
    if isinstance(grads, GroupView):  # a group of `partition`: its sharded leaves, its whole
        n = len(grads.layout.flats)
        pairs = list(zip(grads.parts, grads.values, strict=True))
        sharded = [g for p, g in pairs if p.source < n]
        whole = [g for p, g in pairs if p.source >= n]
    elif isinstance(grads, ShardedGrads):
        sharded, whole = list(grads.shards), list(grads.replicated.values())
    else:
        return _finished(_partial_norm(grads.values(), None, norm_type), norm_type)
    ensure_live(grads, "global_norm")
    device = grads.layout.mesh.device
    shards = collectives.all_reduce(
        _partial_norm(sharded, device, norm_type),
        grads.layout.mesh.shard_group,
        "max" if norm_type == float("inf") else "sum",
        what="<global grad norm>",
    ).wait()
    # replicated (ignored) parameters' gradients are whole on every rank: counted once
    mine = _partial_norm(whole, device, norm_type)
    both = torch.maximum(shards, mine) if norm_type == float("inf") else shards + mine
    return _finished(both, norm_type)


def checked_norm_type(norm_type: float, where: str) -> float:
    """`norm_type` as a float, if it is one of NORM_TYPES (else ValueError naming it)."""
    try:
        value = None if isinstance(norm_type, bool) else float(norm_type)
    except (TypeError, ValueError):
        value = None
    if value not in NORM_TYPES:
        raise ValueError(
            f"funcshard.{where}: norm_type must be 1, 2 or inf (float('inf')), as "
            f"torch.nn.utils.clip_grad_norm_ takes them, got {norm_type!r}."
        )
    return float(value)


def _partial_norm(
    grads: Iterable[Tensor | None], device: torch.device | None, norm_type: float
) -> Tensor:
    """What the ranks reduce: the sum of |g| (norm 1), of g squared (norm 2), or the max of
    |g| (inf) over `grads`, in float32."""
    present = [g for g in grads if g is not None and g.numel()]
    if not present:
        return torch.zeros((), device=device)
    if norm_type == 2.0:
        return torch.stack([g.float().square().sum() for g in present]).sum()
    if norm_type == 1.0:
        return torch.stack([g.float().abs().sum() for g in present]).sum()
    return torch.stack([g.float().abs().amax() for g in present]).amax()


def _finished(partial: Tensor, norm_type: float) -> Tensor:
    return partial.sqrt() if norm_type == 2.0 else partial


def _reduced(tree: Any, mesh: Mesh, mean: bool, axis: str | None) -> Any:
    where = f"funcshard.{'pmean' if mean else 'psum'}"
    if axis not in (None, "shard", "replicate"):
        raise ValueError(f"{where}: axis must be None, 'shard' or 'replicate', got {axis!r}.")
    leaves, spec = optree.tree_flatten(tree)
    if not all(isinstance(x, Tensor | int | float | bool) for x in leaves):
        bad = next(type(x).__name__ for x in leaves if not isinstance(x, Tensor | int | float))
        raise TypeError(
            f"{where}: leaves must be tensors or numbers, got a {bad}. Pass the metrics as "
            f"tensors (e.g. loss.detach())."
        )
    tensors = [torch.as_tensor(x, device=mesh.device) for x in leaves]
    group, size = {
        None: (mesh.group, mesh.size),
        "shard": (mesh.shard_group, mesh.shard_size),
        "replicate": (mesh.replicate_group, mesh.replicate_size),
    }[axis]
    # see [Note: checking a reduced tree across ranks]
    checked = not collectives.alone(group) and not collectives.tracing(tensors)
    if not tensors and not checked:
        return tree
    divisor = size if mean else 1
    small = _numel(tensors) <= _INLINE
    if checked:
        buffer = _header(spec, tensors).to(mesh.device, copy=True)  # (_HEADER + _INLINE,)
        if small:
            _pack(tensors, buffer[_HEADER:])
        what = "<metrics>"
        total = collectives.all_reduce(buffer, group, "sum", inplace=True, what=what).wait()
        if not _agree(total[:_HEADER].tolist(), size):
            _refuse(where, _leaves(spec, tensors), group)
        if small:
            return optree.tree_unflatten(spec, _unpacked(tensors, total[_HEADER:], divisor))
    elif small:
        packed = _pack(tensors, tensors[0].new_empty(_numel(tensors), dtype=torch.float64))
        total = collectives.all_reduce(packed, group, "sum", what="<metrics>").wait()
        return optree.tree_unflatten(spec, _unpacked(tensors, total, divisor))
    return optree.tree_unflatten(spec, _reduced_by_dtype(tensors, group, divisor))


def _numel(tensors: list[Tensor]) -> int:
    return sum([t.numel() for t in tensors])


def _pack(tensors: list[Tensor], out: Tensor) -> Tensor:
    """Write every tensor's values at the start of the float64 buffer `out`; return it.
    Tensors of one dtype are joined in it and cast once (a dict of 0-d metrics: one stack);
    mixed ones cast one by one (an int64 joined with float32 would be rounded to float32)."""
    if len({t.dtype for t in tensors}) == 1:
        scalars = all([t.dim() == 0 for t in tensors])
        values = torch.stack(tensors) if scalars else torch.cat([t.reshape(-1) for t in tensors])
    else:
        values = torch.cat([t.to(torch.float64).reshape(-1) for t in tensors])
    out[: values.numel()] = values.detach()
    return out


def _unpacked(tensors: list[Tensor], flat: Tensor, divisor: int) -> list[Tensor]:
    """A reduced float64 buffer, divided by `divisor`, cut into the tensors' shapes,
    floating ones in their dtypes (numbers and integers stay float64)."""
    flat = flat[: _numel(tensors)]
    if divisor != 1:
        flat = flat / divisor
    dtypes = {t.dtype if t.is_floating_point() else torch.float64 for t in tensors}
    one = dtypes.pop() if len(dtypes) == 1 else None
    if one is not None:
        flat = flat.to(one)  # cast once
    if all([t.dim() == 0 for t in tensors]):
        pieces = flat.unbind()
    else:
        sizes = [t.numel() for t in tensors]
        pieces = tuple(p.view(t.shape) for p, t in zip(flat.split(sizes), tensors, strict=True))
    if one is not None:
        return list(pieces)
    return [
        p.to(t.dtype) if t.is_floating_point() else p for p, t in zip(pieces, tensors, strict=True)
    ]


def _reduced_by_dtype(tensors: list[Tensor], group: Any, divisor: int) -> list[Tensor]:
    """A large tree reduced in one buffer per floating dtype (in that dtype) and one float64
    buffer for numbers and integers."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype if t.is_floating_point() else torch.float64, []).append(i)
    out: list[Tensor] = [tensors[0]] * len(tensors)
    for dtype, indices in by_dtype.items():
        packed = torch.cat([tensors[i].detach().to(dtype).reshape(-1) for i in indices])
        total = collectives.all_reduce(packed, group, "sum", what="<metrics>").wait()
        if divisor != 1:
            total = total / divisor
        at = 0
        for i in indices:
            t = tensors[i]
            out[i] = total[at : at + t.numel()].reshape(t.shape)
            at += t.numel()
    return out


def _header(spec: optree.PyTreeSpec, tensors: list[Tensor]) -> Tensor:
    """The checked collective's buffer before the payload: the digest of the leaves' paths,
    shapes and dtypes as float64 (piece, piece^2, ...), then `_INLINE` zeros; made once per
    tree shape (on the CPU: copy it before writing)."""
    key: tuple[object, ...] | None = (spec, tuple((t.shape, t.dtype) for t in tensors))
    try:
        header = _DIGESTS.get(key)
    except TypeError:  # a pytree node whose static data does not hash
        key, header = None, None
    if header is None:
        text = repr(_leaves(spec, tensors)).encode()
        value = int.from_bytes(hashlib.blake2b(text, digest_size=2 * _PIECES).digest(), "little")
        pieces = [(value >> (16 * i)) & 0xFFFF for i in range(_PIECES)]
        digest = [x for p in pieces for x in (p, p * p)]
        header = torch.tensor(digest + [0] * _INLINE, dtype=torch.float64)
        if key is not None:
            if len(_DIGESTS) >= _DIGESTS_KEPT:
                _DIGESTS.pop(next(iter(_DIGESTS)))
            _DIGESTS[key] = header
    return header


def _agree(header: list[float], size: int) -> bool:
    """Whether every rank sent the same digest, from the summed header alone."""
    sums, squares = header[0::2], header[1::2]
    return all(size * int(q) == int(s) ** 2 for s, q in zip(sums, squares, strict=True))


def _leaves(spec: optree.PyTreeSpec, tensors: list[Tensor]) -> list[tuple[str, str, str]]:
    """Each leaf's pytree path (as `['loss']`), shape and dtype, in words."""
    return [
        (accessor.codify(""), str(tuple(t.shape)), str(t.dtype).removeprefix("torch."))
        for accessor, t in zip(spec.accessors(), tensors, strict=True)
    ]


def _refuse(where: str, mine: list[tuple[str, str, str]], group: Any) -> None:
    """Raise, on every rank alike, naming how the ranks' leaves differ (the ranks' digests
    differed, so every rank is here)."""
    ranks = process_groups.group_ranks(group)
    theirs = collectives.all_gather_object(mine, group)
    found = _differences(ranks, theirs)
    shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
    error = ValueError(
        f"{where}: the same leaves (pytree paths, shapes and dtypes) on every rank of ranks "
        f"{ranks}, got {shown}. Leaves are reduced in order, one with the same one of every "
        f"rank: pass every rank the same metrics (a rank without a value can send 0 and a "
        f"count of 0, and the mean be taken as psum(values) / psum(counts))."
    )
    error.on_every_rank = True  # type: ignore[attr-defined]  # the ranks stay in step
    raise error


def _differences(ranks: list[int], leaves: list[list[tuple[str, str, str]]]) -> list[str]:
    """How the ranks' leaves differ, one phrase per path."""
    found, paths = [], list(dict.fromkeys(path for mine in leaves for path, _, _ in mine))
    by_rank = [{path: (shape, dtype) for path, shape, dtype in mine} for mine in leaves]
    for path in paths:
        has = [r for r, mine in zip(ranks, by_rank, strict=True) if path in mine]
        if len(has) < len(ranks):
            lacks = [r for r in ranks if r not in has]
            found.append(f"{path} on {_ranks(has)} but not on {_ranks(lacks)}")
            continue
        for what, k in (("shape", 0), ("dtype", 1)):
            values = [mine[path][k] for mine in by_rank]
            if len(set(values)) > 1:
                groups: dict[str, list[int]] = {}
                for r, v in zip(ranks, values, strict=True):
                    groups.setdefault(v, []).append(r)
                words = ", ".join(f"{v} on {_ranks(rs)}" for v, rs in groups.items())
                found.append(f"{path} of {what} {words}")
    if not found:  # the same leaves in another order (dict keys that do not sort)
        orders = ", ".join(
            f"[{', '.join(p for p, _, _ in mine)}] on rank {r}"
            for r, mine in zip(ranks, leaves, strict=True)
        )
        found.append(f"the same leaves in different orders: {orders}")
    return found


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
