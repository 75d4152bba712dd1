"""Differentiate a loss with respect to a sharded state (or a plain params dict).

`value_and_grad(f)(state, batch)` runs `f` with every sharded call recording its units'
gradients (see [Note: per-unit gathering]): each unit's reduce-scatter starts the moment
autograd finishes that unit and overlaps the rest of backward; all of them are waited on
before the grads are returned, shaped like the state's shards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor

from funcshard import collectives, compiled, finite, recompute
from funcshard.layout import param_views
from funcshard.precision import reduce_dtype
from funcshard.sharded_call import GradRecorder, Prefetch, recording
from funcshard.state import LocalGrads, ShardedGrads, ShardedState


def value_and_grad(
    f: Callable[..., Any],
    has_aux: bool = False,
    reduce: bool = True,
    all_reduce: bool = True,
    prefetch: bool | Prefetch = True,
    check_finite: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """Return a function computing `f(params, *args)` and its gradient w.r.t. `params`.

    `params` is a ShardedState (grads come back as ShardedGrads, reduced to this rank's shard
    of the mean over data-parallel ranks) or a plain dict (plain autograd; frozen parameters
    get None). `reduce=False` returns LocalGrads instead; `all_reduce=False` skips the HSDP
    all-reduce across replicas. `prefetch` is True, False or a `funcshard.Prefetch` with
    explicit unit orders. With `has_aux`, `f` returns `(loss, aux)`.
    `check_finite=True` raises `funcshard.finite.NonFiniteError` on every rank together when
    any rank's loss or gradients hold NaN or inf (one more all-gather of one flag per buffer).
    Communicates (sharded): per unit one all-gather in forward, one more in backward when
    resharded after forward, and one reduce-scatter; one all-reduce per unit on HSDP meshes.
    """
    if not isinstance(prefetch, bool | Prefetch):
        raise TypeError(
            f"funcshard.value_and_grad: prefetch must be True (the next unit in plan order in "
            f"forward, the one that ran before in backward), False, or funcshard.Prefetch(...) "
            f"with explicit orders; got {type(prefetch).__name__}."
        )

    @functools.wraps(f, updated=())  # (merging f.__dict__ is untraceable for a partial)
    def wrapped(params: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if isinstance(params, ShardedState) and torch.compiler.is_dynamo_compiling():
            (loss, aux), grads = compiled.value_and_grad(
                f, has_aux, reduce, all_reduce, params, args, kwargs, _split
            )
            value = _value(loss, aux, has_aux)
        elif isinstance(params, ShardedState):
            recorder = GradRecorder(params, reduce, all_reduce, prefetch)
            value, grads = _sharded_value_and_grad(f, has_aux, recorder, args, kwargs)
        elif isinstance(params, Mapping):
            value, grads = _dict_value_and_grad(f, has_aux, params, args, kwargs)
        else:
            raise TypeError(
                f"funcshard.value_and_grad: the first argument must be a ShardedState or a "
                f"dict of tensors, got {type(params).__name__}."
            )
        if check_finite:
            finite.check(value[0] if has_aux else value, grads)
        return value, grads

    return wrapped


def grad(f: Callable[..., Any], has_aux: bool = False, **options: Any) -> Callable[..., Any]:
    """Like `value_and_grad`, returning only the gradient (and aux, with `has_aux`)."""
    inner = value_and_grad(f, has_aux=has_aux, **options)

    @functools.wraps(f, updated=())
    def wrapped(params: Any, *args: Any, **kwargs: Any) -> Any:
        value, grads = inner(params, *args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def _split(out: Any, has_aux: bool, where: str) -> tuple[Tensor, Any]:
    loss, aux = out if has_aux else (out, None)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(
            f"funcshard.{where}: the function must return a scalar loss tensor"
            f"{' (as the first of (loss, aux))' if has_aux else ''}, got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, Tensor) else ''}."
        )
    return loss, aux


def _value(loss: Tensor, aux: Any, has_aux: bool) -> Any:
    """What value_and_grad returns as its value: the loss (and aux), detached: values, not
    handles into a backward pass that has already run."""
    if not has_aux:
        return loss.detach()
    return loss.detach(), optree.tree_map(
        lambda x: x.detach() if isinstance(x, Tensor) else x, aux, none_is_leaf=True
    )


def _sharded_value_and_grad(f, has_aux, recorder, args, kwargs):
    state = recorder.state
    try:
        with recording(recorder), recompute.recording() as ran:
            loss, aux = _split(f(state, *args, **kwargs), has_aux, "value_and_grad")
        if recorder.leaves and loss.requires_grad:
            with recompute.recomputing(ran):
                torch.autograd.backward(loss, inputs=recorder.leaves)
        for run in recorder.runs:
            run.flush()
    finally:
        for run in recorder.runs:
            run.finish()
        recorder.leaves.clear()
        recorder.runs.clear()
    grads = _finish(recorder)
    return _value(loss, aux, has_aux), grads


def _finish(recorder: GradRecorder) -> ShardedGrads | LocalGrads:
    """Wait for every reduce-scatter and assemble the grads (zeros for unused units)."""
    state = recorder.state
    layout = state.layout
    mesh = layout.mesh
    if not recorder.reduce:
        grads: dict[str, Tensor | None] = {}
        for flat, local in zip(layout.flats, recorder.local, strict=True):
            if flat.frozen:
                grads.update(dict.fromkeys(flat.fqns))
                continue
            if local is None:
                local = torch.zeros(
                    flat.padded_numel, dtype=reduce_dtype(state.mp, flat), device=mesh.device
                )
            grads.update(zip(flat.fqns, param_views(local, flat), strict=True))
        return LocalGrads(grads=grads, layout=layout)
    summed: list[Tensor | None] = []
    for flat, pending in zip(layout.flats, recorder.pending, strict=True):
        if flat.frozen:
            summed.append(None)
            continue
        parts = [p.wait() for p in pending]
        if not parts:
            parts = [
                torch.zeros(
                    flat.shard_numel, dtype=reduce_dtype(state.mp, flat), device=mesh.device
                )
            ]
        summed.append(functools.reduce(torch.add, parts))
    if recorder.all_reduce:  # across replicas, unless a bucket did so already in backward
        across = [
            None
            if s is None or done
            else collectives.all_reduce(s, mesh.replicate_group, "avg", what=flat.unit)
            for s, done, flat in zip(summed, recorder.all_reduced, layout.flats, strict=True)
        ]
        summed = [s if p is None else p.wait() for s, p in zip(summed, across, strict=True)]
    shards = tuple(
        None if s is None else s.to(flat.dtype)
        for s, flat in zip(summed, layout.flats, strict=True)
    )
    return ShardedGrads(shards=shards, layout=layout)


def _dict_value_and_grad(f, has_aux, params, args, kwargs):
    inputs = {k: v.detach().requires_grad_(v.requires_grad) for k, v in params.items()}
    with recompute.recording() as ran:
        loss, aux = _split(f(inputs, *args, **kwargs), has_aux, "value_and_grad")
    trainable = [k for k, v in inputs.items() if v.requires_grad]
    with recompute.recomputing(ran):
        found = (
            torch.autograd.grad(loss, [inputs[k] for k in trainable], allow_unused=True)
            if trainable and loss.requires_grad
            else [None] * len(trainable)
        )
    grads: dict[str, Tensor | None] = dict.fromkeys(params)
    for k, g in zip(trainable, found, strict=True):
        grads[k] = torch.zeros_like(inputs[k]) if g is None else g
    return _value(loss, aux, has_aux), grads


def accumulate(a: Any, b: Any) -> Any:
    """Sum two gradients of the same kind (ShardedGrads, LocalGrads or dicts); None is zero."""
    if type(a) is not type(b):
        raise TypeError(
            f"funcshard.accumulate: both gradients must be of one kind, got "
            f"{type(a).__name__} and {type(b).__name__}."
        )
    if isinstance(a, ShardedGrads):
        return ShardedGrads(shards=tuple(map(_add, a.shards, b.shards)), layout=a.layout)
    if isinstance(a, LocalGrads):
        return LocalGrads(grads={k: _add(a.grads[k], b.grads[k]) for k in a.grads}, layout=a.layout)
    if isinstance(a, Mapping):
        return {k: _add(a[k], b[k]) for k in a}
    raise TypeError(f"funcshard.accumulate: cannot add {type(a).__name__} gradients.")


def _add(x: Tensor | None, y: Tensor | None) -> Tensor | None:
    if x is None:
        return y
    return x if y is None else x + y
