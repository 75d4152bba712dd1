"""Run a model on a sharded state, gathering each unit just before it runs (see [Note:
per-unit gathering] in funcshard/step/_unit_schedule.py).

[Note: generate across ranks]
A sharded call's forward communicates (every unit is all-gathered over the shard axis), so
every rank must run the same number of forwards. A generation loop (transformers'
`generate`) runs one forward per new token and stops when its own sequences are done, and
ranks with other prompts finish at other steps: the first to finish returns, and the
others' next all-gathers meet whatever it issues next (gloo aborts on mismatched shapes)
or nothing (a hang). transformers' answer for FSDP and ZeRO-3 is `synced_gpus=True`: before
each step every rank all-reduces "am I done" over the default process group, and a
finished rank keeps running forwards (outputs discarded) until all are done. transformers
turns it on by itself only for modules FSDP manages; `call` does so for funcshard: when
the state's shard axis has more than one rank and the method takes a `synced_gpus`
argument the caller did not pass, it is passed True. Its all-reduce goes to the default
group, which a `Mesh(...)` spans (its sizes multiply to the world size; a mesh from a
DeviceMesh over part of the world needs every rank of the world to generate); every rank
issues it at the same point of the same loop, so it interleaves with funcshard's gathers
in one order on every rank. A DDP state (shard axis of one rank) gathers nothing and is
left alone; `synced_gpus=False` turns it off.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from funcshard.comm import _failures as failures
from funcshard.comm import _waits as waits
from funcshard.comm._comm import Comm
from funcshard.core import _recompute as recompute
from funcshard.core._binding import bind, get_slot, restore_snapshot, set_slot, snapshot_slots
from funcshard.core._module import call as call_on_dict
from funcshard.core._precision import cast_inputs, cast_outputs, root_policy
from funcshard.core._state import ShardedState, ensure_live
from funcshard.step import _compiled as compiled
from funcshard.step import _inplace as inplace
from funcshard.step._call_recomputation import Recomputation
from funcshard.step._gather_spec import Differentiated
from funcshard.step._unit_schedule import Run, install_hooks


def call(
    model: nn.Module,
    params: ShardedState | Mapping[str, Tensor],
    *args: Any,
    buffers: Mapping[str, Tensor] | None = None,
    mutable: bool = False,
    method: str = "forward",
    comm: Comm | None = None,
    **kwargs: Any,
) -> Any:
    """Run `model.<method>(*args, **kwargs)` on a params dict or a sharded state.

    On a ShardedState each unit is all-gathered just before its module runs and released
    after it (see [Note: per-unit gathering]); the state's buffers are used (cloned, so the
    state is never written) and `mutable=True` returns `(out, new_buffers)`. `comm` (a
    `funcshard.Comm`) replaces the all-gather and the backward's reduce-scatter with the
    user's functions (see [Note: communication as user functions]); without it, the one
    `value_and_grad(comm=...)` was given, if any. A params dict ignores it. A method that
    takes `synced_gpus` (transformers' `generate`) is passed `synced_gpus=True` on a sharded
    state unless the caller passes it, so that ranks whose generation stops at other steps
    keep running forwards together (see [Note: generate across ranks]).
    Communicates (sharded): one all-gather per unit and flat buffer over the shard axis.
    """
    if not isinstance(params, ShardedState):
        return call_on_dict(
            model, params, *args, buffers=buffers, mutable=mutable, method=method, **kwargs
        )
    state = params
    if torch.compiler.is_dynamo_compiling():
        return compiled.call(model, state, args, kwargs, buffers, mutable, method, comm)
    if _needs_sync(model, state, method, kwargs):  # see [Note: generate across ranks]
        kwargs = {**kwargs, "synced_gpus": True}
    start = failures.count_issued()
    try:
        return _eager_call(
            model,
            state,
            *args,
            buffers=buffers,
            mutable=mutable,
            method=method,
            comm=comm,
            **kwargs,
        )
    except BaseException as error:  # see [Note: a rank out of step] in comm/_failures.py
        waits.left_step("funcshard.call", error, start, state.layout.mesh.ranks)
        raise


def _needs_sync(
    model: nn.Module, state: ShardedState, method: str, kwargs: Mapping[str, Any]
) -> bool:
    """Whether `method` is a generation loop to keep in step across the shard axis."""
    if method == "forward" or "synced_gpus" in kwargs or state.layout.mesh.shard_size == 1:
        return False
    target = getattr(model, method, None)
    try:
        return callable(target) and "synced_gpus" in inspect.signature(target).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return False


def _eager_call(
    model: nn.Module,
    state: ShardedState,
    *args: Any,
    buffers: Mapping[str, Tensor] | None,
    mutable: bool,
    method: str,
    comm: Comm | None,
    **kwargs: Any,
) -> Any:
    """`call` on a sharded state, eagerly (see [Note: per-unit gathering])."""
    ensure_live(state, "call")
    binding = bind(model, state.layout)
    if isinstance(state, Differentiated) and not torch.is_grad_enabled():
        recompute.refuse_reentrant_checkpoint("call")
    run = Run(binding, state, comm)
    new_buffers = {
        k: v.clone() for k, v in (buffers if buffers is not None else state.buffers).items()
    }
    mp = root_policy(state.mp, state.layout.flats)  # the state's, or the root unit's own
    args, kwargs = cast_inputs(mp, args, kwargs)
    originals = snapshot_slots(binding)
    hooks = install_hooks(binding, run)
    try:
        for slot, fqn in binding.replicated_slots:
            set_slot(slot, state.replicated[fqn])
        for slot, fqn in binding.buffer_slots:
            set_slot(slot, new_buffers[fqn])
        run.start()
        for unit in range(len(binding.unit_names)):
            if unit in binding.whole_call:
                run.enter(unit)
            else:
                run._swap_out(unit)
        saved = run.regather.hooks() if run.regather is not None else contextlib.nullcontext()
        recomputation = Recomputation(run)
        with saved, recompute.calling(binding.module_ids, recomputation):
            target = model if method == "forward" else getattr(model, method)
            try:
                out = target(*args, **kwargs)
            except RuntimeError as e:  # see [Note: in-place writes to gathered parameters]
                refusal = inplace.refusal(e, model, binding)
                if refusal is None:
                    raise
                raise refusal from None
        new_buffers = {fqn: get_slot(slot) for slot, fqn in binding.buffer_slots}
        recomputation.buffers = new_buffers
    finally:
        for handle in hooks:
            handle.remove()
        restore_snapshot(originals)
        run.drain()
    run.after_call()
    out = cast_outputs(mp, out)
    return (out, new_buffers) if mutable else out
