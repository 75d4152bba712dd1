"""Muon: momentum, then each 2-D matrix's update orthogonalized by Newton-Schulz iterations.

The arithmetic and defaults are torch.optim.Muon's (torch >= 2.9): the momentum buffer is
lerped toward the gradient, Nesterov's look-ahead lerps the gradient toward the buffer, the
orthogonalization runs in bfloat16 on the wide orientation of the matrix after scaling it
to unit Frobenius norm, weight decay is decoupled, and the step is scaled by the matrix's
shape (`adjust_lr_fn`). It needs each matrix whole, so `muon` is `whole_params` over a
one-process transform: each matrix is orthogonalized once in the mesh, on its owner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from funcshard.optim._base import Optimizer, _state_record
from funcshard.optim._rates import LearningRate, _check_rates, _lr_at
from funcshard.optim._whole_params import whole_params

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


@dataclass(frozen=True, eq=False)
class MuonState:
    """Step count and one momentum buffer per matrix (the transform's dict order)."""

    step: Tensor
    momentum_buffer: tuple[Tensor, ...]


_state_record(MuonState, ("step", "momentum_buffer"))


def muon(
    lr: LearningRate = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    adjust_lr_fn: str | None = None,
) -> Optimizer:
    """Muon on 2-D parameters, as `torch.optim.Muon`, right on any mesh (see the module).

    Give every other parameter (biases, norms, embeddings if you prefer) to another
    optimizer with `partition`: `partition({"muon": muon(0.02), "adamw": adamw(3e-4)},
    lambda fqn, p: "muon" if p.ndim == 2 else "adamw")`. `lr` may be a schedule, as in
    `adamw`. `adjust_lr_fn`: None or "original" scales the step by sqrt(max(1, rows/cols)),
    "match_rms_adamw" by 0.2 * sqrt(max(rows, cols)).
    """
    return whole_params(
        muon_transform(
            lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn
        )
    )


def muon_transform(
    lr: LearningRate = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    adjust_lr_fn: str | None = None,
) -> Optimizer:
    """Muon for one process's `{fqn: whole matrix}` dicts (what `muon` wraps)."""
    _check_rates("muon", lr, weight_decay=weight_decay, momentum=momentum, eps=eps)
    _check_muon_options(ns_coefficients, ns_steps, adjust_lr_fn)

    def init(params: dict[str, Tensor]) -> MuonState:
        for fqn, p in params.items():
            if p.ndim != 2:
                raise ValueError(
                    f"funcshard.optim.muon: parameter {fqn} has shape {tuple(p.shape)}; Muon "
                    f"updates 2-D matrices only. Give the others to another optimizer: "
                    f"funcshard.optim.partition({{'muon': muon(...), 'adamw': adamw(...)}}, "
                    f"lambda fqn, p: 'muon' if p.ndim == 2 else 'adamw')."
                )
        buffers = tuple(torch.zeros_like(p) for p in params.values())
        return MuonState(step=torch.zeros(()), momentum_buffer=buffers)

    def update(
        grads: dict, state: MuonState, params: dict, donate: bool = False
    ) -> tuple[dict, MuonState]:
        rate = _lr_at(lr, state.step)
        updates, buffers = {}, []
        for (fqn, g), buf, p in zip(
            grads.items(), state.momentum_buffer, params.values(), strict=True
        ):
            # donated: the momentum and the gradient are ours to overwrite (see [Note: donation])
            buf = buf.lerp_(g, 1 - momentum) if donate else buf.lerp(g, 1 - momentum)
            if nesterov:
                direction = g.lerp_(buf, momentum) if donate else g.lerp(buf, momentum)
            else:
                direction = buf
            ortho = orthogonalized(direction, ns_coefficients, ns_steps, eps)
            scale = _adjusted(rate, adjust_lr_fn, p.shape)
            updates[fqn] = _move(p, ortho, rate * weight_decay, scale)
            buffers.append(buf)
        return updates, MuonState(step=state.step + 1, momentum_buffer=tuple(buffers))

    return Optimizer(init, update)


def orthogonalized(
    matrix: Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """`matrix` pushed toward the nearest semi-orthogonal matrix by `steps` quintic
    Newton-Schulz iterations in `dtype` (torch.optim.Muon's: bfloat16), computed on the
    orientation with fewer rows, so the Gram matrix is the small one.

    Each iteration is `x <- a x + (b G + c G^2) x` with `G = x x^T`, two fused addmm's
    after the Gram product. The last one of a tall matrix is written transposed, `x^T <-
    a x^T + x^T P^T`: the same products, stored in the matrix's orientation and
    contiguous, so the caller's elementwise step reads it in order instead of through a
    transposed view (a strided pass as costly as a matmul of this size on a CPU)."""
    a, b, c = coefficients
    tall = matrix.shape[0] > matrix.shape[1]
    x = matrix.to(dtype, copy=True)  # ours to scale in place
    x = x.T if tall else x
    x.div_(x.norm().clamp(min=eps))
    for i in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        if tall and i == steps - 1:
            return torch.addmm(x.T, x.T, poly.T, beta=a)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def _move(param: Tensor, ortho: Tensor, decay: float, scale: float) -> Tensor:
    """torch.optim.Muon's move of `param` as an update: decoupled weight decay
    (`-decay * param`) plus the orthogonalized step (`-scale * ortho`, upcast as torch's
    in-place add upcasts it). One pass each, into one new tensor, with no intermediate
    `param * (1 - decay)` to subtract `param` from again."""
    if decay == 0:
        return ortho.to(param.dtype).mul_(-scale)
    return torch.mul(param, -decay).add_(ortho, alpha=-scale)


def _adjusted(rate: float, adjust_lr_fn: str | None, shape: Any) -> float:
    """The step size for a matrix of `shape` (see `muon`)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn in (None, "original"):
        return rate * math.sqrt(max(1.0, rows / cols))
    return rate * 0.2 * math.sqrt(max(rows, cols))


def _check_muon_options(coefficients: Any, steps: Any, adjust_lr_fn: Any) -> None:
    if not (isinstance(coefficients, tuple | list) and len(coefficients) == 3):
        raise ValueError(
            f"funcshard.optim.muon: ns_coefficients must be three numbers (a, b, c), got "
            f"{coefficients!r}; the default is {NS_COEFFICIENTS}."
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
        raise ValueError(
            f"funcshard.optim.muon: ns_steps must be an int in [0, 100), got {steps!r}."
        )
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(
            f"funcshard.optim.muon: adjust_lr_fn must be None, 'original' or "
            f"'match_rms_adamw', got {adjust_lr_fn!r}."
        )
