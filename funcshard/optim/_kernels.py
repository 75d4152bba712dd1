"""SGD, Adam and AdamW computed with torch's own math: torch.optim's single-tensor kernels op
for op, or torch's fused Adam(W) kernel, so their steps match torch.optim's on the same
tensors (see [Note: optimizers] in funcshard/optim/__init__.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.utils._pytree as torch_pytree
from torch import Tensor

from funcshard.core._state import ShardedState
from funcshard.core._state import donate as donate_record
from funcshard.optim import _unused as unused
from funcshard.optim._base import Optimizer, _state_record
from funcshard.optim._leaves import with_leaves
from funcshard.optim._params import _like, _live, _param_leaves, _zeros_like
from funcshard.optim._rates import LearningRate, _check_betas, _check_rates, _lr_at
from funcshard.optim._segments import Where, segments

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
Decay = bool | tuple[slice, ...]  # a leaf's weight decay: all, none, or these slices of it


@dataclass(frozen=True, eq=False)
class SgdState:
    """Step count and one momentum buffer per parameter leaf (None without momentum)."""

    step: Tensor
    momentum: tuple[Tensor | None, ...]


@dataclass(frozen=True, eq=False)
class AdamState:
    """Step count, the first and second moments per parameter leaf, and per parameter FQN
    the steps it sat out unused (its own count is `step - skipped_steps[fqn]`: see [Note:
    optimizers skip unused parameters] in funcshard/optim/_unused.py)."""

    step: Tensor
    exp_avg: tuple[Tensor | None, ...]
    exp_avg_sq: tuple[Tensor | None, ...]
    skipped_steps: Mapping[str, Tensor] = field(default_factory=dict)


_state_record(SgdState, ("step", "momentum"))
_state_record(AdamState, ("step", "exp_avg", "exp_avg_sq", "skipped_steps"))


def _steps_in_place(params: Any, leaves: list[Tensor]) -> bool:
    """Whether a fused step may write these parameter leaves directly: fused dtypes, and no
    frozen members inside a trainable unit (they must not move)."""
    if isinstance(params, ShardedState) and any(f.frozen_fqns for f in params.layout.flats):
        return False
    return all(p.dtype in _FUSED_DTYPES for p in leaves)


def _donated_params(params: Any, grads: Any, to: str) -> Any:
    """The params after an in-place step: a new record (or dict) over the same (written)
    tensors; the old one and the grads are marked donated."""
    new = with_leaves(params, _param_leaves(params))
    donate_record(grads, to)
    donate_record(params, to)
    return new


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    dampening: float = 0.0,
) -> Optimizer:
    """Stochastic gradient descent with optional momentum, as `torch.optim.SGD`.

    `lr`: a number, or a schedule `lr(step) -> float` called once per update with the number
    of updates done before it (0, 1, 2, ...), so `lr=lambda step: base * factor(step)` equals
    `torch.optim.lr_scheduler.LambdaLR(opt, factor)` stepped after each `opt.step()`, and an
    optax schedule. The count is `opt_state.step`, which a checkpoint saves: a resumed run
    continues the schedule where it stopped.
    """
    _check_rates("sgd", lr, momentum=momentum, weight_decay=weight_decay, dampening=dampening)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"funcshard.optim.sgd: nesterov=True needs momentum > 0 and dampening 0, got "
            f"momentum={momentum!r}, dampening={dampening!r}. Pass a momentum (e.g. 0.9) "
            f"without dampening, or nesterov=False."
        )

    def init(params: Any) -> SgdState:
        # zeros, so a checkpoint of a later state loads into a fresh one: without dampening
        # 0 * momentum + grad is the grad exactly, torch's first step; with dampening a buffer
        # must start as a copy of the first gradient it sees, so it starts as None
        started = momentum and not dampening
        buffers = _zeros_like(params) if started else tuple(None for _ in _param_leaves(params))
        return SgdState(step=torch.zeros(()), momentum=buffers)

    def update(
        grads: Any, state: SgdState, params: Any, donate: bool = False
    ) -> tuple[Any, SgdState]:
        rate, step = _lr_at(lr, state.step), state.step + 1
        updates: list[Tensor | None] = [None] * len(state.momentum)
        momenta = list(state.momentum)
        # parameters no rank used move not at all (see [Note: optimizers skip unused parameters])
        idle = unused.idle(grads, params)
        if idle is not None:
            donate = False  # the old momenta stay where a mask holds
        for i, p, g in _live(grads, params):
            if idle is not None and idle[i] is True:
                continue
            # torch.optim.sgd's single-tensor kernel, writing the update instead of the param
            if weight_decay:
                g = g.add_(p, alpha=weight_decay) if donate else g.add(p, alpha=weight_decay)
            if momentum:
                buf = momenta[i]
                if buf is None:
                    buf = g.clone()
                elif donate:
                    buf.mul_(momentum).add_(g, alpha=1 - dampening)
                else:
                    buf = buf.mul(momentum).add_(g, alpha=1 - dampening)
                momenta[i] = buf
                g = g.add(buf, alpha=momentum) if nesterov else buf
            updates[i] = g.mul_(-rate) if donate and g is not momenta[i] else g.mul(-rate)
            hold = None if idle is None else idle[i]
            if isinstance(hold, Tensor):
                updates[i] = _kept(hold, None, cast(Tensor, updates[i]))
                old, new = state.momentum[i], momenta[i]
                if old is not None and new is not None:
                    momenta[i] = _kept(hold, old, new)
        return _like(grads, updates, donate), SgdState(step=step, momentum=tuple(momenta))

    return Optimizer(init, update)


def adam(
    lr: LearningRate,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Where | None = None,
) -> Optimizer:
    """Adam with L2 weight decay added to the gradient, as `torch.optim.Adam`.

    `lr`: a number or a schedule called once per update with the 0-based count of updates
    done, as in `sgd`. `weight_decay_mask`: see `adamw`."""
    return _adam_family("adam", lr, betas, eps, weight_decay, False, weight_decay_mask)


def adamw(
    lr: LearningRate,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    weight_decay_mask: Where | None = None,
) -> Optimizer:
    """Adam with decoupled weight decay, as `torch.optim.AdamW`.

    `lr`: a number, or a schedule `lr(step) -> float` called once per update with the number
    of updates done before it (0, 1, 2, ...), as `torch.optim.lr_scheduler.LambdaLR` and
    optax schedules count: `adamw(lambda step: 3e-4 * factor(step))` equals
    `AdamW(params, lr=3e-4)` with `LambdaLR(opt, factor)` stepped after each step. The count
    is `opt_state.step`, which a checkpoint saves, so a resumed run continues the schedule.

    `weight_decay_mask` decays only the parameters it holds for: a predicate `(fqn, param)
    -> bool` (`param` a meta tensor of the full shape) or a dict FQN -> bool, e.g.
    `lambda fqn, p: p.ndim >= 2` for no decay on biases and norm weights, which equals
    torch.optim.AdamW with two param groups. On flat shards it is a per-parameter choice
    applied to this rank's slices of the chosen parameters (`segments(...).runs`, see [Note:
    per-parameter views of a shard]): no per-element mask is made or kept.
    """
    return _adam_family("adamw", lr, betas, eps, weight_decay, True, weight_decay_mask)


def _adam_family(
    name: str,
    lr: LearningRate,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    weight_decay_mask: Where | None = None,
) -> Optimizer:
    beta1, beta2 = _check_betas(name, betas)
    _check_rates(name, lr, eps=eps, weight_decay=weight_decay)
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_

    def init(params: Any) -> AdamState:
        return AdamState(
            step=torch.zeros(()),
            exp_avg=_zeros_like(params),
            exp_avg_sq=_zeros_like(params),
            skipped_steps=unused.zero_counts(params),
        )

    def decays(params: Any) -> list[Decay]:
        """Per leaf: decay it all (True), none of it (False), or on these slices of it."""
        if weight_decay_mask is None or not weight_decay:
            return [True] * len(_param_leaves(params))
        return segments(params).runs(weight_decay_mask)

    def masked_decay(
        target: Tensor, g: Tensor, where: tuple[slice, ...], rate: float, donate: bool
    ):
        """Apply a partial decay by hand, slice by slice (the kernel then runs with none):
        decoupled, scale the parameter first, as torch.optim.AdamW does; else add it to the
        gradient, as torch.optim.Adam does."""
        if decoupled:
            for run in where:
                target[run].mul_(1 - rate * weight_decay)
            return g
        g = g if donate else g.clone()
        for run in where:
            g[run].add_(target[run], alpha=weight_decay)
        return g

    def fused_step_of(
        target: Tensor,
        g: Tensor,
        m: Tensor,
        v: Tensor,
        step: Tensor,
        rate: float,
        decay: Decay = True,
        donate: bool = False,
    ) -> None:
        """torch's fused Adam(W) kernel on one tensor, its decay whole, none, or on some
        slices: writes `target`, `m` and `v` in place."""
        if isinstance(decay, tuple):
            g = masked_decay(target, g, decay, rate, donate)
        fused_many([target], [g], [m], [v], step, rate, weight_decay if decay is True else 0.0)

    def fused_many(
        targets: list[Tensor],
        gs: list[Tensor],
        ms: list[Tensor],
        vs: list[Tensor],
        step: Tensor,
        rate: float,
        decay: float = weight_decay,
    ) -> None:
        """torch's fused Adam(W) kernel over many tensors decayed alike: one call per (device,
        dtypes) group rather than one per tensor, whose Python and dispatch cost is paid per
        flat buffer, i.e. per unit. Writes `targets`, `ms` and `vs` in place."""
        count = step.to(torch.float32)
        groups: dict[tuple, list[tuple[Tensor, ...]]] = {}
        for row in zip(targets, gs, ms, vs, strict=True):
            groups.setdefault((row[0].device, row[0].dtype, row[1].dtype), []).append(row)
        for (device, *_), members in groups.items():
            t, g, m, v = (list(column) for column in zip(*members, strict=True))
            fused(
                t,
                g,
                m,
                v,
                [],
                [count.to(device, non_blocking=True)] * len(t),  # read, not written; a GPU's
                # kernel takes it on its own device
                lr=rate,
                beta1=beta1,
                beta2=beta2,
                weight_decay=decay,
                eps=eps,
                amsgrad=False,
                maximize=False,
            )

    def update(
        grads: Any, state: AdamState, params: Any, donate: bool = False
    ) -> tuple[Any, AdamState]:
        idle = unused.idle(grads, params)
        if idle is not None or unused.any_lag(state.skipped_steps):
            return masked_update(grads, state, params, idle)
        rate, step = _lr_at(lr, state.step), state.step + 1
        # a traced step keeps the count a tensor (int() would break the graph); torch's
        # fused kernel has no functional form to trace, so tracing takes the unfused math
        tracing = torch.compiler.is_dynamo_compiling()
        n = step.double() if tracing else int(step)
        step_size = rate / (1 - beta1**n)
        bias_correction2_sqrt = (1 - beta2**n) ** 0.5
        updates: list[Tensor | None] = [None] * len(state.exp_avg)
        # read at live leaves only, whose moments are tensors (None: a frozen unit's leaf)
        m_all = cast(list[Tensor], list(state.exp_avg))
        v_all = cast(list[Tensor], list(state.exp_avg_sq))
        decay_of = decays(params)
        live = _live(grads, params)
        batched = [
            (i, p, g)
            for i, p, g in live
            if p.dtype in _FUSED_DTYPES and not tracing and decay_of[i] is True
        ]
        if batched:  # the fused kernel on copies of the params, all in one call
            for i, _, _ in batched:
                if not donate:
                    m_all[i], v_all[i] = m_all[i].clone(), v_all[i].clone()
            news = [p.detach().clone() for _, p, _ in batched]
            ms, vs = [m_all[i] for i, _, _ in batched], [v_all[i] for i, _, _ in batched]
            fused_many(news, [g for _, _, g in batched], ms, vs, step, rate)
            torch._foreach_sub_(news, [p.detach() for _, p, _ in batched])
            for (i, _, _), new in zip(batched, news, strict=True):
                updates[i] = new
        done = {i for i, _, _ in batched}
        for i, p, g in live:
            if i in done:
                continue
            m = m_all[i] if donate else m_all[i].clone()
            v = v_all[i] if donate else v_all[i].clone()
            decay = decay_of[i]
            if p.dtype in _FUSED_DTYPES and not tracing:  # fused kernel, on a copy of the param
                new = p.detach().clone()
                fused_step_of(new, g, m, v, step, rate, decay, donate)
                updates[i], m_all[i], v_all[i] = new.sub_(p), m, v
                continue
            decayed = _decayed_part(p, decay)
            # otherwise torch.optim.adam's single-tensor kernel, writing the update instead;
            # like it, complex tensors are treated as pairs of reals
            if p.is_complex():
                p, g = torch.view_as_real(p), torch.view_as_real(g)
                m_real, v_real = torch.view_as_real(m), torch.view_as_real(v)
                decayed = torch.view_as_real(decayed)
            else:
                m_real, v_real = m, v
            if weight_decay and not decoupled:
                g = (
                    g.add_(decayed, alpha=weight_decay)
                    if donate
                    else g.add(decayed, alpha=weight_decay)
                )
            m_real.lerp_(g, 1 - beta1)
            v_real.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = v_real.sqrt().div_(bias_correction2_sqrt).add_(eps)
            update = torch.div(m_real, denom, out=g if donate else denom).mul_(-step_size)
            if weight_decay and decoupled:
                update.add_(decayed, alpha=-rate * weight_decay)
            if m.is_complex():
                update = torch.view_as_complex(update)
            updates[i], m_all[i], v_all[i] = update, m, v
        new_state = AdamState(
            step=step,
            exp_avg=tuple(m_all),
            exp_avg_sq=tuple(v_all),
            skipped_steps=state.skipped_steps,
        )
        return _like(grads, updates, donate), new_state

    def masked_update(
        grads: Any, state: AdamState, params: Any, idle: list[bool | Tensor] | None
    ) -> tuple[Any, AdamState]:
        """The update when some parameter sat this step or an earlier one out (see [Note:
        optimizers skip unused parameters]): torch.optim.adam's single-tensor math with each
        parameter's own step count, an unused parameter's moments kept and its update zero."""
        rate, step = _lr_at(lr, state.step), state.step + 1
        skipped = unused.skipped_after(state.skipped_steps, grads)
        counts = unused.counts(int(step), unused.lags(skipped) or {}, params)  # (never traced)
        updates: list[Tensor | None] = [None] * len(state.exp_avg)
        m_all, v_all = list(state.exp_avg), list(state.exp_avg_sq)
        decay_of = decays(params)
        for i, p, g in _live(grads, params):
            hold = False if idle is None else idle[i]
            if hold is True:
                continue
            # torch's bias corrections in double, then (per element) in the param's dtype
            n, real = counts[i], p.real.dtype if p.is_complex() else p.dtype
            step_size: float | Tensor = rate / (1 - beta1**n)
            bias_correction2_sqrt: float | Tensor = (1 - beta2**n) ** 0.5
            if isinstance(step_size, Tensor) and isinstance(bias_correction2_sqrt, Tensor):
                step_size, bias_correction2_sqrt = (
                    step_size.to(real),
                    bias_correction2_sqrt.to(real),
                )
                if p.is_complex():  # (per element of the pairs below)
                    step_size = step_size.unsqueeze(-1)
                    bias_correction2_sqrt = bias_correction2_sqrt.unsqueeze(-1)
            m_old, v_old = cast(Tensor, m_all[i]), cast(Tensor, v_all[i])
            m, v = m_old.clone(), v_old.clone()
            decay = decay_of[i]
            decayed = _decayed_part(p, decay)
            if p.is_complex():  # as pairs of reals, as torch.optim does
                g_r, decayed = torch.view_as_real(g), torch.view_as_real(decayed)
                m_r, v_r = torch.view_as_real(m), torch.view_as_real(v)
            else:
                g_r, m_r, v_r = g, m, v
            if weight_decay and not decoupled:
                g_r = g_r.add(decayed, alpha=weight_decay)
            m_r.lerp_(g_r, 1 - beta1)
            v_r.mul_(beta2).addcmul_(g_r, g_r, value=1 - beta2)
            denom = v_r.sqrt().div_(bias_correction2_sqrt).add_(eps)
            update = torch.div(m_r, denom).mul_(-step_size)
            if weight_decay and decoupled:
                update.add_(decayed, alpha=-rate * weight_decay)
            if m.is_complex():
                update = torch.view_as_complex(update)
            if isinstance(hold, Tensor):
                update = _kept(hold, None, update)
                m, v = _kept(hold, m_old, m), _kept(hold, v_old, v)
            updates[i], m_all[i], v_all[i] = update, m, v
        new_state = AdamState(
            step=step, exp_avg=tuple(m_all), exp_avg_sq=tuple(v_all), skipped_steps=skipped
        )
        return _like(grads, updates), new_state

    def fused_step(grads: Any, state: AdamState, params: Any) -> tuple[Any, AdamState] | None:
        live = _live(grads, params)
        if torch.compiler.is_dynamo_compiling():
            return None  # see update(): tracing takes the unfused math
        if unused.unused_of(grads) or unused.any_lag(state.skipped_steps):
            return None  # see masked_update
        if not _steps_in_place(params, [p for _, p, _ in live]):
            return None
        rate, step = _lr_at(lr, state.step), state.step + 1
        decay_of = decays(params)
        whole = [(i, p, g) for i, p, g in live if decay_of[i] is True]
        # read at live leaves only, whose moments are tensors (None: a frozen unit's leaf)
        m_all = cast(tuple[Tensor, ...], state.exp_avg)
        v_all = cast(tuple[Tensor, ...], state.exp_avg_sq)
        with torch.no_grad():  # parameters that require grad are written in place too
            if whole:
                fused_many(
                    [p for _, p, _ in whole],
                    [g for _, _, g in whole],
                    [m_all[i] for i, _, _ in whole],
                    [v_all[i] for i, _, _ in whole],
                    step,
                    rate,
                )
            for i, p, g in live:
                if decay_of[i] is not True:
                    m, v = m_all[i], v_all[i]
                    fused_step_of(p, g, m, v, step, rate, decay_of[i], True)
        new_state = AdamState(
            step=step,
            exp_avg=state.exp_avg,
            exp_avg_sq=state.exp_avg_sq,
            skipped_steps=state.skipped_steps,
        )
        return _donated_params(params, grads, "Optimizer.step"), new_state

    return Optimizer(init, update, fused_step)


def _kept(where: Tensor, old: Tensor | None, new: Tensor) -> Tensor:
    """`new` with `old` (zero when None) where the idle mask `where` holds; a complex
    tensor's mask covers both parts."""
    if old is None:
        return new.masked_fill(where, 0)
    return torch.where(where, old, new)


def restart_counts(opt_state: Any, fqns: frozenset[str]) -> Any:
    """`opt_state` with every AdamState in it counting the steps of `fqns` from zero, as
    torch.optim does for a parameter whose state it makes when it first steps: each of them
    has sat out every step so far (see [Note: optimizers skip unused parameters])."""

    def restarted(node: Any) -> Any:
        if not isinstance(node, AdamState) or not fqns & set(node.skipped_steps):
            return node
        done = int(node.step)
        counts = {
            f: torch.tensor(done, dtype=torch.int64) if f in fqns else n
            for f, n in node.skipped_steps.items()
        }
        return dataclasses.replace(node, skipped_steps=counts)

    return torch_pytree.tree_map(restarted, opt_state, is_leaf=lambda n: isinstance(n, AdamState))


def _decayed_part(p: Tensor, decay: Decay) -> Tensor:
    """What weight decay applies to: `p` where it decays, zero elsewhere."""
    if decay is True:
        return p
    part = torch.zeros_like(p)
    for run in decay if isinstance(decay, tuple) else ():
        part[run] = p[run]
    return part
