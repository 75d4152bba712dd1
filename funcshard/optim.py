"""Optimizers as pairs of pure functions, `(init, update)`, computed with torch's own math.

[Note: optimizers]
An optimizer is `Optimizer(init, update)` as in optax: `init(params)` builds its state,
`update(grads, opt_state, params)` returns `(updates, new_opt_state)` and writes nothing, and
`apply_updates(params, updates)` adds the updates. The arithmetic follows torch.optim's
single-tensor kernels op for op (`torch.optim.sgd`), or is torch's fused Adam/AdamW kernel
(`torch._fused_adam_`, `_fused_adamw_`, run on a copy of each parameter: one pass over
memory instead of eight), one leaf at a time, so after N steps the parameters match
`torch.optim.SGD/Adam/AdamW` on the same tensors (to rounding of the final addition) and
temporaries never exceed one flat buffer.

Purity costs memory: new moments are built beside the old ones. `update(..., donate=True)`
gives that memory back, as buffer donation does in JAX: the moments are updated in place and
the updates are written into the gradients' buffers, so the caller must not read the old
opt_state or the grads again. With donation a step needs no more memory than torch.optim's
in-place step.

Params are a ShardedState (its flat shards, then its replicated parameters: see [Note: the
optimizer's leaves]) or a dict of tensors; grads are the matching ShardedGrads or dict.
Frozen buffers (None gradients) get None updates and no state. Padding stays zero: zero
gradients and zero parameters give zero moments and zero updates.

The contract for a user's optimizer is the same pair: `init(params)` returns any pytree
(a dataclass registered with `torch.utils._pytree.register_dataclass`, a NamedTuple, a dict,
a list of moments: checkpoints save it whole), and `update(grads, state, params)` returns
`(updates, new_state)` with `updates` of the grads' kind, written leaf by leaf with
`funcshard.tree_map`. It may take `donate=False` (a promise that it may reuse the memory of
`grads` and `state`); without it, it is wrapped to ignore donation. Per-parameter math on
flat shards (trust ratios, masks) goes through `segments` (see [Note: per-parameter views of
a shard]); `masked` and `partition` are masks and parameter groups as in optax.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from funcshard import finite
from funcshard.groups import GroupView as GroupView
from funcshard.groups import Part, group_of, group_parts, scatter
from funcshard.layout import frozen_ranges
from funcshard.leaves import leaves as leaves
from funcshard.leaves import with_leaves
from funcshard.metrics import global_norm
from funcshard.mixed_reduction import (
    MixedParameterReductionWarning as MixedParameterReductionWarning,
)
from funcshard.mixed_reduction import warning_on_mixed_reductions
from funcshard.owned import Owned as Owned
from funcshard.segments import Piece as Piece
from funcshard.segments import Segments as Segments
from funcshard.segments import Where, segments
from funcshard.state import ShardedGrads, ShardedState, donatable, ensure_live
from funcshard.state import donate as donate_record
from funcshard.tree import format_names, register_record

LearningRate = float | Callable[[int], float]
Labels = Callable[[str, Tensor], str] | Mapping[str, str]
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Optimizer:
    """A gradient transformation: `init(params) -> state`, `update(grads, state, params)`.

    `step(grads, state, params) -> (new_params, new_state)` is update and `apply_updates` in
    one, donating all three inputs: the same numbers, without materializing the updates
    (Adam and AdamW run torch's fused kernel on the parameters themselves, as torch.optim
    does: three fewer passes over memory per step).
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]  # (grads, state, params, donate=False)
    fused_step: Callable[..., tuple[Any, Any] | None] | None = None  # None: not applicable

    def __post_init__(self) -> None:
        update = warning_on_mixed_reductions(_accepting_donate(self.update))
        update = _recording_only_through_grads(_donating_its_state(update))
        object.__setattr__(self, "update", update)

    def step(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        """Update and apply, donating `grads`, `state` and `params` (see the class)."""
        if self.fused_step is not None:
            done = self.fused_step(grads, state, params)
            if done is not None:
                _donate_state(state, done[1], "Optimizer.step")
                return done
        updates, new_state = self.update(grads, state, params, donate=True)
        return apply_updates(params, updates, donate=True), new_state


def _accepting_donate(update: Callable[..., Any]) -> Callable[..., Any]:
    """A user's `update(grads, state, params)` that takes no `donate` as one that does (and
    ignores it: donation only permits reusing memory, it never changes the numbers)."""
    try:
        parameters = inspect.signature(update).parameters
    except (TypeError, ValueError):
        return update
    if "donate" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return update

    def wrapped(grads: Any, state: Any, params: Any, donate: bool = False) -> Any:
        return update(grads, state, params)

    return functools.wraps(update)(wrapped)


def _donating_its_state(update: Callable[..., Any]) -> Callable[..., Any]:
    """`update` that, called with donate=True, marks the state it was given as donated (its
    moments now hold the new state's numbers; see [Note: donation])."""
    if getattr(update, "_donates_its_state", False):
        return update

    def wrapped(grads: Any, state: Any, params: Any, **kwargs: Any) -> Any:
        updates, new_state = update(grads, state, params, **kwargs)
        if kwargs.get("donate"):
            _donate_state(state, new_state, "an optimizer update(donate=True)")
        return updates, new_state

    wrapped = functools.wraps(update)(wrapped)
    wrapped._donates_its_state = True  # type: ignore[attr-defined]
    return wrapped


def _donate_state(old: Any, new: Any, to: str) -> None:
    """Mark an optimizer state record donated, unless the update handed the same record
    back (a stateless transformation) or it is not one of funcshard's records."""
    if new is not old and hasattr(type(old), "_donated_fields"):
        donate_record(old, to)


def _recording_only_through_grads(update: Callable[..., Any]) -> Callable[..., Any]:
    """Run `update` without autograd recording, as torch.optim steps do, unless the grads
    carry history themselves (`create_graph`: a differentiable inner step, as in MAML); so
    weight decay on parameters that require grad builds no graph step after step."""
    if getattr(update, "_records_only_through_grads", False):
        return update

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        grads = args[0] if args else kwargs.get("grads")
        if not isinstance(grads, ShardedGrads | GroupView | Mapping):
            return update(*args, **kwargs)  # not ours to judge: recorded as written
        if any(isinstance(g, Tensor) and g.requires_grad for g in _grad_leaves(grads)):
            return update(*args, **kwargs)
        with torch.no_grad():
            return update(*args, **kwargs)

    wrapped = functools.wraps(update)(wrapped)
    wrapped._records_only_through_grads = True  # type: ignore[attr-defined]
    return wrapped


@dataclass(frozen=True, eq=False)
class SgdState:
    """Step count and one momentum buffer per parameter leaf (None without momentum)."""

    step: Tensor
    momentum: tuple[Tensor | None, ...]


@dataclass(frozen=True, eq=False)
class AdamState:
    """Step count and the first and second moments per parameter leaf."""

    step: Tensor
    exp_avg: tuple[Tensor | None, ...]
    exp_avg_sq: tuple[Tensor | None, ...]


@dataclass(frozen=True, eq=False)
class ChainState:
    """The states of chained transformations, in order."""

    states: tuple[Any, ...]


@dataclass(frozen=True, eq=False)
class SkipState:
    """The wrapped optimizer's state and how many steps were skipped for NaN or inf."""

    inner: Any
    skipped: Tensor


@dataclass(frozen=True)
class EmptyState:
    """The state of a stateless transformation."""


def _state_record(cls: type, data_fields: tuple[str, ...]) -> None:
    """Register an optimizer state record: a pytree whose tensors are `data_fields`, which a
    donating update replaces by placeholders."""
    register_record(cls, data_fields=data_fields, meta_fields=())
    donatable(cls, data_fields)


_state_record(SgdState, ("step", "momentum"))
_state_record(AdamState, ("step", "exp_avg", "exp_avg_sq"))
_state_record(ChainState, ("states",))
_state_record(SkipState, ("inner", "skipped"))
register_record(EmptyState, data_fields=(), meta_fields=())


def _param_leaves(params: Any) -> list[Tensor]:
    if isinstance(params, ShardedState | GroupView):
        ensure_live(params, "optim")
        return params.leaves()
    if isinstance(params, Mapping):
        ensure_live(params, "optim")
        return list(params.values())
    raise TypeError(
        f"funcshard.optim: params must be a ShardedState or a dict of tensors, got "
        f"{type(params).__name__}."
    )


def _grad_leaves(grads: Any) -> list[Tensor | None]:
    if isinstance(grads, ShardedGrads | GroupView):
        ensure_live(grads, "optim")
        return grads.leaves()
    if isinstance(grads, Mapping):
        ensure_live(grads, "optim")
        return list(grads.values())
    raise TypeError(
        f"funcshard.optim: grads must be ShardedGrads or a dict of tensors, got "
        f"{type(grads).__name__} (reduce LocalGrads with funcshard.reduce first)."
    )


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


def _zeros_like(params: Any) -> tuple[Tensor | None, ...]:
    """A zero buffer per parameter leaf, None for a frozen unit's (it never gets a gradient)."""
    leaves = _param_leaves(params)
    frozen = _frozen_leaves(params) if isinstance(params, ShardedState) else [False] * len(leaves)
    return tuple(None if f else torch.zeros_like(p) for p, f in zip(leaves, frozen, strict=True))


def _frozen_leaves(state: ShardedState) -> list[bool]:
    """Per leaf of `state.leaves()`: whether it never gets a gradient."""
    layout = state.layout
    return [f.frozen for f in layout.flats] + [
        f in layout.replicated_frozen for f in layout.replicated
    ]


def _like(grads: Any, leaves: list[Tensor | None], donated: bool = False) -> Any:
    """Put leaves back into the container type of `grads` (marking `grads` as used up when
    its buffers were `donated` to hold the new leaves)."""
    new = with_leaves(grads, leaves)
    if donated:
        donate_record(grads, "an optimizer update(donate=True)")
    return new


def _lr_at(lr: LearningRate, done: Tensor) -> float:
    """The learning rate of the update that follows `done` updates: a schedule is called
    once, with `done` (0 for the first update), as `torch.optim.lr_scheduler.LambdaLR` and
    optax schedules count. `done` is read as an int only for a schedule: a traced step with
    a schedule breaks its graph there. Call it once per update and pass the rate on: a
    schedule may count its calls."""
    return float(lr(int(done))) if callable(lr) else float(lr)


def _check_rates(where: str, lr: LearningRate, **rates: float) -> None:
    """torch.optim's checks of its hyperparameters, with messages that name them; on every
    rank when the optimizer is made, before any collective."""
    where = f"funcshard.optim.{where}"
    if not callable(lr) and not (_is_number(lr) and lr >= 0):
        raise ValueError(f"{where}: lr must be >= 0 or a callable, got {lr!r}.")
    for name, value in rates.items():
        if not (_is_number(value) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{where}: {name} must be >= 0, got {value!r}.")


def _check_betas(where: str, betas: Any) -> tuple[float, float]:
    """Adam's `betas`: two numbers, each in [0, 1), as torch.optim.Adam requires (a beta of 1
    or more makes the moment an ever-growing sum, not an average)."""
    where = f"funcshard.optim.{where}"
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise TypeError(
            f"{where}: betas must be a pair (beta1, beta2), got {betas!r}. Pass e.g. "
            f"betas=(0.9, 0.999)."
        )
    for i, beta in enumerate(betas):
        if not (_is_number(beta) and 0 <= beta < 1):
            raise ValueError(
                f"{where}: betas[{i}] must be in [0, 1), got {beta!r}. The defaults are "
                f"betas=(0.9, 0.999)."
            )
    return float(betas[0]), float(betas[1])


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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
        updates = [None] * len(state.momentum)
        momenta = list(state.momentum)
        for i, p, g in _live(grads, params):
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
    torch.optim.AdamW with two param groups. On flat shards the per-element mask is built
    from the layout once (see [Note: per-parameter views of a shard]).
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
            step=torch.zeros(()), exp_avg=_zeros_like(params), exp_avg_sq=_zeros_like(params)
        )

    def decays(params: Any) -> list[bool | Tensor]:
        """Per leaf: decay it all (True), none of it (False), or where a bool tensor holds."""
        if weight_decay_mask is None or not weight_decay:
            return [True] * len(_param_leaves(params))
        return segments(params).mask(weight_decay_mask)

    def masked_decay(target: Tensor, g: Tensor, where: Tensor, rate: float, donate: bool):
        """Apply a partial decay by hand (the kernel then runs with none): decoupled, scale
        the parameter first, as torch.optim.AdamW does; else add it to the gradient."""
        if decoupled:
            target.mul_(torch.where(where, 1 - rate * weight_decay, 1.0).to(target.dtype))
            return g
        term = target * where * weight_decay
        return g.add_(term) if donate else g + term

    def fused_step_of(
        target: Tensor,
        g: Tensor,
        m: Tensor,
        v: Tensor,
        step: Tensor,
        rate: float,
        decay: bool | Tensor = True,
        donate: bool = False,
    ) -> None:
        """torch's fused Adam(W) kernel on one tensor, its decay whole, none, or where a bool
        tensor holds: writes `target`, `m` and `v` in place."""
        if isinstance(decay, Tensor):
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
        for members in zip(targets, gs, ms, vs, strict=True):
            groups.setdefault((members[0].device, members[0].dtype, members[1].dtype), []).append(
                members
            )
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
        rate, step = _lr_at(lr, state.step), state.step + 1
        # a traced step keeps the count a tensor (int() would break the graph); torch's
        # fused kernel has no functional form to trace, so tracing takes the unfused math
        tracing = torch.compiler.is_dynamo_compiling()
        n = step.double() if tracing else int(step)
        step_size = rate / (1 - beta1**n)
        bias_correction2_sqrt = (1 - beta2**n) ** 0.5
        updates = [None] * len(state.exp_avg)
        m_all, v_all = list(state.exp_avg), list(state.exp_avg_sq)
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
            decayed = p if decay is True else p * decay  # (decay False: p * False is zeros)
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
        new_state = AdamState(step=step, exp_avg=tuple(m_all), exp_avg_sq=tuple(v_all))
        return _like(grads, updates, donate), new_state

    def fused_step(grads: Any, state: AdamState, params: Any) -> tuple[Any, AdamState] | None:
        live = _live(grads, params)
        if torch.compiler.is_dynamo_compiling():
            return None  # see update(): tracing takes the unfused math
        if not _steps_in_place(params, [p for _, p, _ in live]):
            return None
        rate, step = _lr_at(lr, state.step), state.step + 1
        decay_of = decays(params)
        whole = [(i, p, g) for i, p, g in live if decay_of[i] is True]
        with torch.no_grad():  # parameters that require grad are written in place too
            if whole:
                fused_many(
                    [p for _, p, _ in whole],
                    [g for _, _, g in whole],
                    [state.exp_avg[i] for i, _, _ in whole],
                    [state.exp_avg_sq[i] for i, _, _ in whole],
                    step,
                    rate,
                )
            for i, p, g in live:
                if decay_of[i] is not True:
                    m, v = state.exp_avg[i], state.exp_avg_sq[i]
                    fused_step_of(p, g, m, v, step, rate, decay_of[i], True)
        new_state = AdamState(step=step, exp_avg=state.exp_avg, exp_avg_sq=state.exp_avg_sq)
        return _donated_params(params, grads, "Optimizer.step"), new_state

    return Optimizer(init, update, fused_step)


def clip_by_global_norm(max_norm: float) -> Optimizer:
    """Scale gradients so their global L2 norm is at most `max_norm`, as
    `torch.nn.utils.clip_grad_norm_`. Communicates: one all-reduce of the squared norm over
    the shard axis (replicas hold identical shards)."""
    _check_rates("clip_by_global_norm", 0.0, max_norm=max_norm)

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(
        grads: Any, state: EmptyState, params: Any, donate: bool = False
    ) -> tuple[Any, EmptyState]:
        leaves = _grad_leaves(grads)
        present = [g for g in leaves if g is not None]
        if not present:
            return grads, state
        scale = torch.clamp(max_norm / (global_norm(grads) + 1e-6), max=1.0)
        scaled = [
            None if g is None else (g.mul_(scale.to(g.dtype)) if donate else g * scale.to(g.dtype))
            for g in leaves
        ]
        return _like(grads, scaled, donate), state

    return Optimizer(init, update)


def chain(*optimizers: Optimizer) -> Optimizer:
    """Apply transformations in order, each to the updates of the one before."""

    def init(params: Any) -> ChainState:
        return ChainState(states=tuple(o.init(params) for o in optimizers))

    def update_each(grads: Any, states: tuple, params: Any, donate: bool) -> tuple[Any, tuple]:
        """Run the first len(states) transformations in order, each on the last's output."""
        new_states = []
        for optimizer, inner in zip(optimizers, states, strict=False):
            grads, inner = optimizer.update(grads, inner, params, donate=donate)
            new_states.append(inner)
        return grads, tuple(new_states)

    def update(
        grads: Any, state: ChainState, params: Any, donate: bool = False
    ) -> tuple[Any, ChainState]:
        grads, new_states = update_each(grads, state.states, params, donate)
        return grads, ChainState(states=new_states)

    def fused_step(grads: Any, state: ChainState, params: Any) -> tuple[Any, ChainState]:
        *first, last = state.states
        transformed, new_states = update_each(grads, tuple(first), params, donate=True)
        params, last = optimizers[-1].step(transformed, last, params)
        return params, ChainState(states=(*new_states, last))

    return Optimizer(init, update, fused_step if optimizers else None)


def masked(optimizer: Optimizer, where: Where) -> Optimizer:
    """Apply `optimizer` only where `where` holds (a predicate `(fqn, param) -> bool` or a
    dict FQN -> bool); elsewhere the incoming updates pass through unchanged, as
    `optax.masked`. On flat shards the mask is per element, built once from the layout.

    The wrapped optimizer sees every leaf (its state covers the masked-out elements too, as
    a flat shard cannot leave them out) and never a donation, since the incoming updates
    must survive it."""

    def update(grads: Any, state: Any, params: Any, donate: bool = False) -> tuple[Any, Any]:
        where_of = segments(params).mask(where)
        inner_updates, new_state = optimizer.update(grads, state, params, donate=False)
        chosen = [
            _chosen(w, u, g)
            for w, u, g in zip(
                where_of, _grad_leaves(inner_updates), _grad_leaves(grads), strict=True
            )
        ]
        return _like(grads, chosen, donate), new_state

    return Optimizer(optimizer.init, update)


def _chosen(where: bool | Tensor, then: Tensor | None, otherwise: Tensor | None) -> Any:
    """`then` where `where` holds, else `otherwise` (a None operand counts as zero)."""
    if where is True or (otherwise is None and then is None):
        return then
    if where is False:
        return otherwise
    if then is None:
        return torch.where(where, 0, otherwise)
    return torch.where(where, then, 0 if otherwise is None else otherwise)


@dataclass(frozen=True, eq=False)
class PartitionState:
    """The state of each group's optimizer, by label, and (for sharded params) each group's
    parts (see [Note: a parameter group's view]): what a checkpoint needs to split a packed
    moment into per-parameter pieces."""

    states: dict[str, Any]
    groups: tuple[tuple[str, tuple[Part, ...]], ...] = ()


register_record(PartitionState, data_fields=("states",), meta_fields=("groups",))
donatable(PartitionState, ("states",))


def partition(optimizers: Mapping[str, Optimizer], labels: Labels) -> Optimizer:
    """Parameter groups: each parameter's updates come from the optimizer of its label, as
    `optax.multi_transform` (torch.optim's param groups). `labels` is a function
    `(fqn, param) -> label` (`param` a meta tensor of the full shape) or a dict FQN -> label.

    Each optimizer sees its own group's parameters only: on a dict, the sub-dict; on flat
    shards, a `GroupView` whose leaves hold only the group's elements where groups share a
    buffer (see [Note: a parameter group's view]). So a global norm or a trust ratio counts
    its group alone, `whole_params` makes only its group's parameters whole, and the
    optimizer state is what torch.optim keeps for the same param groups, divided over the
    shard axis, not once per group."""
    names = list(optimizers)
    by_layout: dict[Any, dict[str, frozenset[str]]] = {}

    def members(params: Any) -> dict[str, frozenset[str]]:
        layout = getattr(params, "layout", None)
        if layout is not None and layout in by_layout:
            return by_layout[layout]
        seg = segments(params)
        _check_labels(seg, labels, names)
        pairs = [pair for leaf in seg.params for pair in leaf]
        if isinstance(labels, Mapping):
            label_of = {f: labels.get(f) for f, _ in pairs}
        else:
            label_of = {f: labels(f, p) for f, p in pairs}
        found = {name: frozenset(f for f, lab in label_of.items() if lab == name) for name in names}
        if layout is not None:
            by_layout[layout] = found
        return found

    def groups_of(params: Any, found: dict[str, frozenset[str]]) -> tuple:
        if not isinstance(params, ShardedState):
            return ()
        return tuple((name, group_parts(params.layout, found[name])) for name in names)

    def init(params: Any) -> PartitionState:
        found = members(params)
        states = {name: optimizers[name].init(group_of(params, found[name])) for name in names}
        return PartitionState(states=states, groups=groups_of(params, found))

    def update(
        grads: Any, state: PartitionState, params: Any, donate: bool = False
    ) -> tuple[Any, PartitionState]:
        found = members(params)
        keys = list(grads) if isinstance(grads, Mapping) else None
        out: list[Tensor | None] = [None] * len(_grad_leaves(grads))
        new_states = {}
        for name in names:
            mine = group_of(grads, found[name])
            updates, new_states[name] = optimizers[name].update(
                mine, state.states[name], group_of(params, found[name])
            )
            scatter(mine, updates, out, keys)
        new_state = PartitionState(states=new_states, groups=state.groups)
        return _like(grads, out, donate), new_state

    return Optimizer(init, update)


def _group_mask(labels: Labels, name: str) -> Where:
    """The mask of one group: where a parameter's label is `name`."""
    if isinstance(labels, Mapping):
        return {f: label == name for f, label in labels.items()}
    return lambda fqn, p: labels(fqn, p) == name


def _check_labels(seg: Any, labels: Labels, names: list[str]) -> None:
    """Every parameter's label names one of the optimizers (else a silent no-update)."""
    params = [pair for leaf in seg.params for pair in leaf]
    if isinstance(labels, Mapping):
        got = {f: labels.get(f) for f, _ in params}
    else:
        got = {f: labels(f, p) for f, p in params}
    stray = [f"{f} -> {label!r}" for f, label in got.items() if label not in names]
    if stray:
        raise ValueError(
            f"funcshard.optim.partition: parameters {format_names(stray)} have labels with "
            f"no optimizer (the optimizers are {names}). Label every parameter with one of "
            f"them; use funcshard.optim.sgd(0.0) for a group that must not move."
        )


def skip_nonfinite(optimizer: Optimizer) -> Optimizer:
    """Skip the step on every rank when any rank's gradients hold NaN or inf.

    A skipped step returns None updates (the parameters stay as they are) and the wrapped
    state untouched, and counts itself in `opt_state.skipped`. All ranks decide together
    (see funcshard/finite.py), so replicas never diverge. Communicates: one all-reduce of
    one integer per step.
    """

    def init(params: Any) -> SkipState:
        return SkipState(inner=optimizer.init(params), skipped=torch.zeros((), dtype=torch.int64))

    def update(
        grads: Any, state: SkipState, params: Any, donate: bool = False
    ) -> tuple[Any, SkipState]:
        if finite.any_nonfinite(grads):
            nothing = _like(grads, [None] * len(_grad_leaves(grads)))
            return nothing, SkipState(inner=state.inner, skipped=state.skipped + 1)
        updates, inner = optimizer.update(grads, state.inner, params, donate=donate)
        return updates, SkipState(inner=inner, skipped=state.skipped)

    def fused_step(grads: Any, state: SkipState, params: Any) -> tuple[Any, SkipState]:
        if finite.any_nonfinite(grads):
            return params, SkipState(inner=state.inner, skipped=state.skipped + 1)
        params, inner = optimizer.step(grads, state.inner, params)
        return params, SkipState(inner=inner, skipped=state.skipped)

    return Optimizer(init, update, fused_step)


def difference(a: Any, b: Any) -> Any:
    """`a - b` leaf by leaf, as gradients of these params: ShardedGrads of two states (None
    for frozen leaves, which never move), a dict of two dicts. Local SGD's and DiLoCo's
    outer gradient is `difference(anchor, state)`, the parameters' move since the last outer
    step reversed, which an optimizer then takes as any gradient (examples/diloco.py).

    Communicates: nothing."""
    a_leaves, b_leaves = _param_leaves(a), _param_leaves(b)
    if len(a_leaves) != len(b_leaves) or type(a) is not type(b):
        raise ValueError(
            f"funcshard.optim.difference: both arguments must be params of one model, got a "
            f"{type(a).__name__} of {len(a_leaves)} leaves and a {type(b).__name__} of "
            f"{len(b_leaves)}."
        )
    frozen = _frozen_leaves(a) if isinstance(a, ShardedState) else [False] * len(a_leaves)
    with torch.no_grad():
        leaves = [None if f else x - y for x, y, f in zip(a_leaves, b_leaves, frozen, strict=True)]
    if isinstance(a, ShardedState):
        n = len(a.layout.flats)
        replicated = dict(zip(a.layout.replicated, leaves[n:], strict=True))
        return ShardedGrads(shards=tuple(leaves[:n]), layout=a.layout, replicated=replicated)
    return dict(zip(a.keys(), leaves, strict=True))


def apply_updates(params: Any, updates: Any, donate: bool = False) -> Any:
    """Add `updates` to `params` (None updates leave a leaf unchanged).

    The new leaves have no autograd history and require grad where the old ones did (unless
    the updates carry history themselves, as in a differentiable inner step).
    `donate=True` adds in place into the old params' memory: the caller promises never to
    read the old params again.
    """
    old = _param_leaves(params)
    delta = _grad_leaves(updates)
    if len(old) != len(delta):
        raise ValueError(
            f"funcshard.apply_updates: {len(delta)} updates for {len(old)} parameter leaves; "
            f"pass the updates computed for these params."
        )
    if isinstance(params, ShardedState):
        delta = _without_frozen_members(params, delta)
    with torch.no_grad() if donate else contextlib.nullcontext():  # in place, as torch.optim
        new = [
            p if u is None else (p.add_(u) if donate else _added(p, u))
            for p, u in zip(old, delta, strict=True)
        ]
    result = with_leaves(params, new)
    if donate:
        donate_record(params, "apply_updates(donate=True)")
    return result


def _added(param: Tensor, update: Tensor) -> Tensor:
    """`param + update` as a new leaf, as JAX's optax.apply_updates returns arrays: no autograd
    history (a loop would otherwise chain every step's addition), requiring grad where the
    parameter did. Updates that carry history (a differentiable inner step, as in MAML)
    keep it."""
    if update.requires_grad and torch.is_grad_enabled():
        return param + update
    with torch.no_grad():
        return (param + update).requires_grad_(param.requires_grad)


def _without_frozen_members(state: ShardedState, delta: list[Tensor | None]) -> list:
    """Zero the updates of frozen parameters that share a trainable unit (frozen="warn"):
    their gradients are zero, but weight decay would still move them."""
    rank = state.layout.mesh.shard_rank
    out = list(delta)
    for i, (flat, u) in enumerate(zip(state.layout.flats, delta, strict=False)):
        if u is None or not flat.frozen_fqns:
            continue
        start = rank * flat.shard_numel
        ranges = frozen_ranges(flat, start, start + flat.shard_numel)
        if ranges:
            out[i] = u.clone()  # the caller's updates are not written
            for r in ranges:
                out[i][r] = 0
    return out


def _live(grads: Any, params: Any) -> list[tuple[int, Tensor, Tensor]]:
    """(index, param, grad) for every leaf that has a gradient."""
    param_leaves, grad_leaves = _param_leaves(params), _grad_leaves(grads)
    if len(param_leaves) != len(grad_leaves):
        raise ValueError(
            f"funcshard.optim: {len(grad_leaves)} gradient leaves for {len(param_leaves)} "
            f"parameter leaves; pass the grads of these params."
        )
    return [
        (i, p, g)
        for i, (p, g) in enumerate(zip(param_leaves, grad_leaves, strict=True))
        if g is not None
    ]

from funcshard.muon import muon as muon  # noqa: E402
from funcshard.whole_params import whole_params as whole_params  # noqa: E402  (needs Optimizer)
