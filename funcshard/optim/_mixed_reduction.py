"""A warning for per-parameter math written per leaf: a reduction over a flat shard that mixes
parameters, inside a user's optimizer update.

[Note: mixed-parameter reductions]
An optimizer's leaves are flat shards (see [Note: the optimizer's leaves]): one holds pieces
of several parameters, and on a shard axis of more than one rank only this rank's piece of
each. Elementwise math is right on them; a reduction over a whole leaf is not any parameter's
number (LARS's `w.norm() / g.norm()` per leaf is right on a params dict and silently wrong,
differently on every mesh and plan, once sharded). So the first call of a user's `update`
runs under a TorchFunctionMode that watches for one, and warns once
(`MixedParameterReductionWarning`) naming the leaf, the parameters it mixes and the remedy.

What is watched. At the start of that call each leaf that is a flat shard mixing parameters
(more than one parameter, or one split over the shard axis) is marked with its buffer: the
leaves of the grads (ShardedGrads), of the params (ShardedState), of a `partition` group's
view of either (GroupView, whose packed leaves hold the group's pieces of a buffer), and the
optimizer state's per-leaf tensors (any list or tuple in the state record with one entry per
leaf, entry i of leaf i's shape). An op's output takes the mark of a marked input of its
shape (derived elementwise: `g * g`, `m.lerp(g, 0.1)`, an in-place `v.addcmul_(g, g)`);
outputs of other shapes (indexing, `segments.sum`'s `index_add_`) carry none. A reduction
(`norm`, `vector_norm`, `sum`, `mean`, `amax`, `max`, `var`, `std`, `dot`, ...: see
`_REDUCTIONS`) of a marked input whose floating-point result has another shape is flagged.
Boolean and integer results (`isfinite().all()`, counts) are not: a per-leaf yes or no is
a coarser answer, not a wrong number.

Who is watched. Only a user's own update: `Optimizer.__post_init__` wraps an update unless
its function lives in the funcshard package (sgd, adam, adamw, clip_by_global_norm, chain,
masked, partition, skip_nonfinite, whole_params, muon reduce whole leaves where that is
meant, and are never wrapped). Inside a watched update, an op called from funcshard's own
code (`fs.global_norm`, `Segments.sum`, a funcshard optimizer the user calls) is never
flagged: the first frame outside torch that called the op decides. A `whole_params`
transform is a user's update too, but it receives dicts of whole tensors, which carry no
marks. Nested watched updates (a user's optimizer calling another's) share the outer mode.

What it costs. Nothing after the first call: the wrapper then only tests a flag. The first
call on a params dict, or on a state with no mixing leaf, pushes no mode either; one traced
by dynamo is not watched (and does not count as the first).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, cast

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from funcshard.core._groups import GroupView
from funcshard.core._layout import FlatLayout
from funcshard.core._state import ShardedGrads, ShardedState
from funcshard.core._tree import format_names


class MixedParameterReductionWarning(UserWarning):
    """A user's optimizer update reduced a whole flat shard that mixes parameters.

    Warned once per optimizer, on its first update (see [Note: mixed-parameter reductions] in
    funcshard/optim/_mixed_reduction.py), at the line of the reduction. Per-parameter math belongs
    in `fs.optim.whole_params(transform)` (whole tensors) or goes through
    `fs.optim.segments(params)` (per-parameter sums on the shards). A reduction that is meant
    per leaf can be silenced with
    `warnings.filterwarnings("ignore", category=fs.optim.MixedParameterReductionWarning)`.
    """


@dataclass(frozen=True)
class _Mixed:
    """A flat buffer whose shards mix parameters: how the warning names it."""

    name: str  # FlatLayout.name
    fqns: tuple[str, ...]
    ranks: int  # the shard axis's size (1: whole parameters, several in one buffer)

    def __str__(self) -> str:
        split = f", split over {self.ranks} ranks" if self.ranks > 1 else ""
        return f"leaf {self.name!r} (holds {format_names(self.fqns)}{split})"


_REDUCTION_NAMES = (
    "norm", "sum", "nansum", "mean", "nanmean", "amax", "amin", "max", "min", "aminmax",
    "var", "std", "var_mean", "std_mean", "prod", "logsumexp", "dot", "vdot", "inner",
    "matmul", "median", "nanmedian", "_foreach_norm",
)  # fmt: skip
_REDUCTIONS = frozenset(
    f
    for f in [
        *(getattr(torch, n, None) for n in _REDUCTION_NAMES),
        *(getattr(Tensor, n, None) for n in _REDUCTION_NAMES),
        torch.linalg.norm,
        torch.linalg.vector_norm,
    ]
    if f is not None
)
# Same-shape outputs that are not derived from their input's values.
_FRESH = frozenset({torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like})


def warning_on_mixed_reductions(update: Callable[..., Any]) -> Callable[..., Any]:
    """`update` that, on its first call, warns of reductions over flat shards that mix
    parameters (see the Note); funcshard's own updates come back unwrapped."""
    if _is_funcshard_own(update):
        return update
    pending = [True]

    def wrapped(grads: Any, state: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        if not pending[0] or torch.compiler.is_compiling():
            return update(grads, state, params, *args, **kwargs)
        pending[0] = False
        marks = _marks(grads, state, params)
        if not marks or _Detector.active is not None:
            return update(grads, state, params, *args, **kwargs)
        with _Detector(marks) as detector:
            out = update(grads, state, params, *args, **kwargs)
        detector.warn(update)
        return out

    wrapped = functools.wraps(update)(wrapped)
    wrapped._mixed_reduction_pending = pending  # type: ignore[attr-defined]
    return wrapped


def _is_funcshard_own(update: Callable[..., Any]) -> bool:
    while isinstance(update, functools.partial):
        update = update.func
    module = getattr(update, "__module__", None) or ""
    return module == "funcshard" or module.startswith("funcshard.")


def _marks(grads: Any, state: Any, params: Any) -> dict[int, tuple[weakref.ref, _Mixed]]:
    """id -> (the tensor, its buffer) for the leaves that mix parameters (see the Note)."""
    container = next((c for c in (params, grads) if _mixed_leaves(c) is not None), None)
    mixed = _mixed_leaves(container)
    if container is None or mixed is None or not any(mixed):
        return {}
    marks: dict[int, tuple[weakref.ref, _Mixed]] = {}
    for tree in (grads, params):
        if _mixed_leaves(tree) is not None:
            _mark_lined_up(tree.leaves(), mixed, marks)
    for sequence in _sequences(state, len(mixed), depth=0):
        _mark_lined_up(sequence, mixed, marks)
    return marks


def _mixed_leaves(container: Any) -> list[_Mixed | None] | None:
    """Per leaf of a sharded container, its buffer if it mixes parameters (more than one, or
    one split over the shard axis), else None; None for a container of whole tensors."""
    pairs: list[tuple[FlatLayout | None, tuple[str, ...]]]
    if isinstance(container, ShardedState | ShardedGrads):
        flats = container.layout.flats
        pairs = [(f, f.fqns) for f in flats] + [(None, ())] * len(container.layout.replicated)
    elif isinstance(container, GroupView):  # a partition group's (packed) leaves
        flats = container.layout.flats
        pairs = [
            (flats[p.source] if p.source < len(flats) else None, p.fqns) for p in container.parts
        ]
    else:
        return None
    return [
        _Mixed(f.name, fqns, f.shard_size)
        if f is not None and (len(fqns) > 1 or f.shard_size > 1)
        else None
        for f, fqns in pairs
    ]


def _mark_lined_up(tensors: Any, mixed: list[_Mixed | None], marks: dict) -> None:
    for t, m in zip(tensors, mixed, strict=False):
        if m is not None and isinstance(t, Tensor):
            marks[id(t)] = (weakref.ref(t), m)


def _sequences(record: Any, leaves: int, depth: int) -> list[list[Any]]:
    """The lists and tuples of `leaves` items inside an optimizer state record (dataclasses,
    dicts, lists and tuples, a few levels deep): per-leaf tensors such as moments."""
    if depth > 6:
        return []
    if isinstance(record, list | tuple):
        children = list(record)
        found = [children] if len(children) == leaves else []
    elif isinstance(record, Mapping):
        children, found = list(record.values()), []
    elif dataclasses.is_dataclass(record) and not isinstance(record, type):
        children = [getattr(record, f.name) for f in dataclasses.fields(record)]
        found = []
    else:
        return []
    for child in children:
        found += _sequences(child, leaves, depth + 1)
    return found


class _Detector(TorchFunctionMode):
    """The mode of the first watched call: carries marks through elementwise ops and records
    reductions of marked tensors called from outside funcshard (see the Note)."""

    active: _Detector | None = None  # the mode in force, so nested updates share it

    def __init__(self, marks: dict[int, tuple[weakref.ref, _Mixed]]) -> None:
        super().__init__()
        self.marks = marks
        self.found: dict[_Mixed, list[str]] = {}  # buffer -> "op at file:line"
        self.where: tuple[str, int, dict] | None = None  # the first one's frame

    def __enter__(self) -> _Detector:
        _Detector.active = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _Detector.active = None
        super().__exit__(*exc)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = self._marked([*args, *kwargs.values()])
        if inputs and func not in _FRESH:
            if func in _REDUCTIONS:
                self._reduced(func, inputs, out)
            else:
                self._carry(inputs, out)
        return out

    def _marked(self, values: list[Any]) -> list[tuple[Tensor, _Mixed]]:
        """The marked tensors among an op's arguments (and inside list arguments)."""
        found: list[tuple[Tensor, _Mixed]] = []
        for v in values:
            for t in v if isinstance(v, list | tuple) else (v,):
                entry = self.marks.get(id(t)) if isinstance(t, Tensor) else None
                if entry is not None and entry[0]() is t:
                    found.append((cast(Tensor, t), entry[1]))  # marked: a Tensor
        return found

    def _carry(self, inputs: list[tuple[Tensor, _Mixed]], out: Any) -> None:
        """Mark each output tensor shaped like a marked input (position by position for
        lists, as `_foreach_` ops pair them)."""
        outputs = out if isinstance(out, list | tuple) else (out,)
        for i, o in enumerate(outputs):
            if not isinstance(o, Tensor):
                continue
            paired = inputs[i] if len(inputs) == len(outputs) else None
            same = [m for t, m in inputs if t.shape == o.shape]
            if paired is not None and paired[0].shape == o.shape:
                self.marks[id(o)] = (weakref.ref(o), paired[1])
            elif same:
                self.marks[id(o)] = (weakref.ref(o), same[0])

    def _reduced(self, func: Any, inputs: list[tuple[Tensor, _Mixed]], out: Any) -> None:
        """Record a floating-point reduction of marked inputs called from a user's frame."""
        outputs = out if isinstance(out, list | tuple) else (out,)
        results = [o for o in outputs if isinstance(o, Tensor)]
        floating = [o for o in results if o.is_floating_point() or o.is_complex()]
        if not floating or all(o.shape == t.shape for o in floating for t, _ in inputs):
            if results:
                self._carry(inputs, out)  # elementwise after all (`torch.max(a, b)`)
            return
        frame = _caller()
        if frame is None:
            return  # funcshard's own code
        name = getattr(func, "__name__", str(func)).removeprefix("linalg_")
        at = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        for _, mixed in inputs:
            self.found.setdefault(mixed, []).append(f"{name} at {at}")
        if self.where is None:
            self.where = (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)

    def warn(self, update: Callable[..., Any]) -> None:
        """Warn once for everything found, at the first reduction's line."""
        if not self.found or self.where is None:
            return
        filename, lineno, module_globals = self.where
        warnings.warn_explicit(
            _message(update, self.found),
            MixedParameterReductionWarning,
            filename,
            lineno,
            module=module_globals.get("__name__", "__main__"),
            registry=module_globals.setdefault("__warningregistry__", {}),
            module_globals=module_globals,
        )


def _caller() -> Any:
    """The frame that called the op being handled, past torch's own; None if that frame is
    funcshard's (whose whole-leaf reductions are meant: see the Note)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == __name__ or module == "torch" or module.startswith("torch."):
            frame = frame.f_back
            continue
        return None if module == "funcshard" or module.startswith("funcshard.") else frame
    return None


def _message(update: Callable[..., Any], found: dict[_Mixed, list[str]]) -> str:
    name = getattr(update, "__qualname__", repr(update))
    what = "; ".join(f"{', '.join(dict.fromkeys(ops))} over {m}" for m, ops in found.items())
    return (
        f"funcshard.optim: the update {name} reduced whole flat shards that mix parameters: "
        f"{what}. A flat shard holds pieces of several parameters (and on a shard axis only "
        f"this rank's piece), so such a number is no parameter's and changes with the mesh "
        f"and the plan. Write per-parameter math over whole tensors and wrap it in "
        f"fs.optim.whole_params(transform), or take per-parameter sums on the shards with "
        f"fs.optim.segments(params).sum(...) and .expand(...). Checked on the first update "
        f"only; silence a reduction meant per leaf with warnings.filterwarnings('ignore', "
        f"category=fs.optim.MixedParameterReductionWarning)."
    )
