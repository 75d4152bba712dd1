"""Rank-2 PowerSGD per weight matrix, as a user reduce with error feedback.

A gradient matrix M (n, m) is sent as two thin factors: P = M Q (n, r) is averaged over the
ranks and orthonormalized, then Q = M^T P (m, r) is averaged, and every rank takes P Q^T as
the mean of M: r (n + m) numbers on the wire instead of n m (Vogels et al., 2019). Q is kept
from the last step (a warm start: one step of power iteration per training step), and what
the low-rank product dropped from this rank's M (M - P P^T M) is added to its next gradient
(error feedback: the residuals' mean is what the mean lost). Vectors (biases, norms) and
matrices too thin to gain are all-reduced exactly.

The reduce sees one flat buffer that concatenates several parameters; the `MeshAxis` it
receives says where each one lies (`axis.fqns`, `axis.shapes`, `axis.offsets`,
`axis.numels`: see [Note: what a Comm is told about its buffer]), so each matrix is cut out
of the buffer and compressed on its own. The carry, threaded by the caller as optimizer
state, holds per buffer the residual (full size) and the matrices' Q factors.

    python examples/powersgd.py [--quick] [--steps 200] [--rank 2] [--mesh ddp|fsdp]

Trains the demo's character-level GPT on 2 local ranks with an exact fp32 reduce and with
rank-2 PowerSGD, prints the bytes reduced per step (counted from the collectives) and the
loss curves. On a DDP mesh (`fs.replicate`) the reduce takes the place of each bucket's
all-reduce; on FSDP it returns this rank's chunk of the same mean.
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import Tensor

import funcshard as fs
from funcshard.cli import demo
from funcshard.comm import bytes_sent, record
from funcshard.testing.models import GPT, Block

RANK = 2  # columns of P and Q


def compressed(buffer: fs.MeshAxis, rank: int) -> tuple[int, ...]:
    """Which parameters of the buffer are compressed: the matrices whose rank-`rank`
    factors, rank * (n + m) numbers, are fewer than the matrix's n * m. `buffer` is what
    describes it: the reduce's axis, or at the start the state's flat layout."""
    return tuple(
        i
        for i, shape in enumerate(buffer.shapes)
        if len(shape) == 2 and rank * (shape[0] + shape[1]) < shape[0] * shape[1]
    )


def matrix(buffer: Tensor, axis: fs.MeshAxis, i: int) -> Tensor:
    """Parameter i of the full flat buffer, as a view of its shape."""
    start = axis.offsets[i]
    return buffer[start : start + axis.numels[i]].view(axis.shapes[i])


def exact_ranges(axis: fs.MeshAxis, which: tuple[int, ...], end: int) -> list[slice]:
    """The stretches of a buffer of `end` elements outside the compressed matrices (the
    other parameters and the padding): what is all-reduced as it is."""
    ranges, start = [], 0
    for i in which:
        if axis.offsets[i] > start:
            ranges.append(slice(start, axis.offsets[i]))
        start = axis.offsets[i] + axis.numels[i]
    return ranges + ([slice(start, end)] if end > start else [])


def mean_of(tensors: list[Tensor], axis: fs.MeshAxis) -> list[Tensor]:
    """Each tensor's mean over the axis, in one all-reduce."""
    if not tensors:
        return []
    flat = axis.all_reduce(torch.cat([t.reshape(-1) for t in tensors]))
    pieces = flat.split([t.numel() for t in tensors])
    return [p.view(t.shape) for p, t in zip(pieces, tensors, strict=True)]


def low_rank_mean(ms: list[Tensor], qs: tuple[Tensor, ...], axis: fs.MeshAxis):
    """One power-iteration step on the mean of each matrix: its rank-r estimate P Q^T (the
    same on every rank), what of this rank's own matrix the estimate's columns hold
    (P P^T M, whose mean over the ranks is the estimate) and the new Q factors."""
    ps = mean_of([m @ q for m, q in zip(ms, qs, strict=True)], axis)  # (n, r): (mean M) Q
    ps = [torch.linalg.qr(p).Q for p in ps]  # an orthonormal basis of its columns
    own = [m.T @ p for m, p in zip(ms, ps, strict=True)]  # (m, r): M^T P, this rank's
    qs = mean_of(own, axis)  # (mean M)^T P
    estimates = [p @ q.T for p, q in zip(ps, qs, strict=True)]
    return estimates, [p @ o.T for p, o in zip(ps, own, strict=True)], tuple(qs)


def powersgd_reduce(full: Tensor, axis: fs.MeshAxis, carry: tuple, rank: int = RANK):
    """PowerSGD of one flat buffer: (this rank's chunk of the mean, (residual, Q factors)).

    `carry` is `(residual, qs)`, one Q per compressed matrix (see `carry_zeros`)."""
    residual, qs = carry
    x = full + residual  # (padded_numel,): this step's gradient and what was dropped before
    which = compressed(axis, rank)
    ms = [matrix(x, axis, i) for i in which]
    estimates, sent, qs = low_rank_mean(ms, qs, axis)
    mean, residual = torch.empty_like(x), torch.zeros_like(x)
    ranges = exact_ranges(axis, which, x.numel())
    for r, piece in zip(ranges, mean_of([x[r] for r in ranges], axis), strict=True):
        mean[r] = piece
    for i, m, estimate, own in zip(which, ms, estimates, sent, strict=True):
        matrix(mean, axis, i).copy_(estimate)
        matrix(residual, axis, i).copy_(m - own)  # what of this rank's M was not sent
    return this_ranks(mean, axis), (residual, qs)


def this_ranks(mean: Tensor, axis: fs.MeshAxis) -> Tensor:
    """What the reduce returns: on the shard axis this rank's chunk of the mean; on a DDP
    mesh's replicate axis the whole of it."""
    return mean.view(axis.size, -1)[axis.rank] if axis.name == "shard" else mean


def powersgd(rank: int = RANK) -> fs.Comm:
    """A Comm whose reduce is rank-`rank` PowerSGD per matrix with error feedback."""
    return fs.Comm(reduce=functools.partial(powersgd_reduce, rank=rank))


def carry_zeros(state: fs.ShardedState, rank: int = RANK) -> tuple:
    """PowerSGD's carry at the start: per trainable buffer a zero residual and random first
    Q factors, the same on every rank (one fixed seed)."""
    g = torch.Generator().manual_seed(0)
    carry = []
    for flat, residual in zip(state.layout.flats, fs.carry_zeros(state), strict=True):
        qs = tuple(
            torch.randn(flat.shapes[i][1], rank, generator=g) for i in compressed(flat, rank)
        )
        carry.append(None if residual is None else (residual, qs))
    return tuple(carry)


def sharded(model: GPT, kind: str) -> fs.ShardedState:
    """The model on 2 ranks: DDP (`fs.replicate`) or FSDP with one unit per block."""
    if kind == "ddp":
        return fs.replicate(model, fs.Mesh(replicate=2))
    return fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=2)
    )


def train(steps: int, quick: bool, kind: str, rank_r: int | None, rank: int) -> dict:
    """The demo model, AdamW; `rank_r=None` reduces exactly (fp32), else PowerSGD."""
    nproc = 2
    cfg = demo.DemoConfig(nproc=nproc, steps=steps, plot=None)
    if quick:
        cfg = demo.DemoConfig(nproc=nproc, steps=steps, d_model=64, n_layer=2, block_size=32)
    data = torch.frombuffer(bytearray(demo.stdlib_text()), dtype=torch.uint8).long()
    with torch.device("meta"):
        model = GPT(demo.model_config(cfg))
    state = sharded(model, kind)
    opt = fs.optim.adamw(cfg.lr, weight_decay=0.01)
    opt_state = opt.init(state)
    loss_fn = functools.partial(demo.lm_loss, model)
    comm = None if rank_r is None else powersgd(rank_r)
    carry = None if comm is None else carry_zeros(state, rank_r)
    losses, reduced = [], []
    for step in range(steps):
        x, y = demo.batches(data, cfg, step, cfg.batch * nproc)
        x, y = x.chunk(nproc)[rank], y.chunk(nproc)[rank]
        with record() as log:
            if comm is None:
                loss, grads = fs.value_and_grad(loss_fn)(state, x, y)
            else:
                grad_fn = fs.value_and_grad(loss_fn, comm=comm, carry=carry)
                loss, grads, carry = grad_fn(state, x, y)  # residuals and Qs threaded
        reduced.append(bytes_sent([r for r in log if r.op != "all_gather"]))
        state, opt_state = opt.step(grads, opt_state, state)
        losses.append(loss)
    return {
        "losses": fs.pmean(torch.stack(losses), state.layout.mesh).tolist(),
        "reduced": reduced[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 20 steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rank", type=int, default=RANK, help="columns of P and Q")
    parser.add_argument("--mesh", choices=["ddp", "fsdp"], default="ddp")
    args = parser.parse_args()
    steps = args.steps or (20 if args.quick else 200)
    run = functools.partial(train, steps, args.quick, args.mesh)
    exact = fs.testing.run(functools.partial(run, None), 2, timeout=3600)[0]
    low = fs.testing.run(functools.partial(run, args.rank), 2, timeout=3600)[0]
    ratio = low["reduced"] / exact["reduced"]
    print(
        f"bytes reduced per step and rank ({args.mesh}): fp32 {exact['reduced']:,}, "
        f"rank-{args.rank} PowerSGD {low['reduced']:,} ({ratio:.3f}x)"
    )
    print(f"step  loss exact  loss PowerSGD-{args.rank}")
    for i in sorted({*range(0, steps, max(1, steps // 10)), steps - 1}):
        print(f"{i:4d}  {exact['losses'][i]:10.4f}  {low['losses'][i]:10.4f}")
    tail = max(1, steps // 10)  # the last tenth of the run, averaged: one step's noise aside
    a, b = (sum(r["losses"][-tail:]) / tail for r in (exact, low))
    print(
        f"final loss (mean of the last {tail} steps): exact {a:.4f}, PowerSGD {b:.4f} "
        f"({(b - a) / a:+.2%})"
    )


if __name__ == "__main__":
    main()
