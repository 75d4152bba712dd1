"""`with fs.deferred_init(): model = Model(...)`: build any model on the meta device while
recording how its constructor makes each tensor, for `shard` to replay one tensor at a time.

[Note: a constructor recorded per storage]
The block runs the constructor under `torch.device("meta")` and a TorchDispatchMode that
sees every op. Tensors are followed by storage, not by Python object: `.data`, `.detach()`,
`nn.Parameter(t)`, views and `param.data = t` all keep or share a storage, so the tensor a
module finally holds is found from its storage alone. Each storage has a log:
- its first entry is the op that made it (a factory, or an out-of-place op such as
  `w * 2` or `clone`), with its inputs;
- each later entry is an op that wrote it (`normal_`, `copy_`, `fill_` through a view).
An input is a reference to (storage, version): the storage and the length of its log when
the op ran, plus the view's size, stride, offset and dtype. So the logs form a DAG, and one
tensor can be rebuilt from its own log and the logs it names, without the rest of the model.

Random ops keep the caller's random stream where a CPU build leaves it. For each op tagged
`nondeterministic_seeded`, the state of the generator it draws from (the CPU default one, or
the one passed, about 5 KB) is saved in its entry, and the op then runs once on a CPU scratch
of the same view (zeros), which is dropped. So the generator advances exactly as on the CPU,
and after the block torch's random state is what the CPU constructor leaves. The replay
restores the saved state before each random op, so replay order does not matter and each
tensor can be materialized alone. Ops whose number of draws depends on the input values
(gamma, Poisson, multinomial samplers) are refused: a scratch of zeros would draw differently.

Refused at construction, before any collective: reading a value into Python
(`aten._local_scalar_dense`: `.item()`, `.tolist()`, a tensor in an `if`), any op the meta
device cannot run (data-dependent shapes), and a meta tensor made outside the block (nothing
to replay it from). The error names the innermost module whose `__init__` is running (from
the Python stack), the op, and the first line outside torch and funcshard. Nested blocks are
refused: one recorder owns the device context.

Factories are made meta at dispatch (an op with no tensor input and a `device` argument that
is the CPU or unset), not by entering `torch.device("meta")`: transformers' `init_weights`
skips the model's initialization when `torch.tensor([])` lands on meta, and that tensor
(made by `lift_fresh`, no factory) stays on the CPU here. A CPU tensor that meets a meta one
in an op is recorded as a constant and moved to meta for that op.

Modules that register a parameter, buffer or child inside the block are remembered in a
weak map from module to record, with the names of their tensors that were meta when the block
closed; nothing is written on the modules themselves. `shard` looks a model up there, so a
tensor replaced after the block (`.to(dtype)`, `to_empty()`, a new layer assigned) is found
and refused by name. `.to(device)` of a meta model is refused by torch itself.

The log holds aten ops (callables) and constants: it is a recording, not a static record, and
lives only as long as the modules built in the block.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten


class DeferredInitError(ValueError):
    """A constructor under `funcshard.deferred_init()` did something the record cannot replay."""


@dataclass(frozen=True)
class Ref:
    """An op's input that is a recorded tensor: a view of `key`'s storage after `version`
    entries of its log."""

    key: int
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass
class Entry:
    """One op in a storage's log: `func(*args, **kwargs)` with `Ref`s for recorded inputs.

    `output` is the index (in the flattened outputs) of the tensor that made the storage, for
    a first entry; `rng` the saved generator state for a random op; `where` the user's line,
    for errors on replay."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: int = -1
    view: Ref | None = None  # the made tensor's view, for a first entry
    rng: Tensor | None = None
    where: str = ""


@dataclass
class Log:
    """The entries that made and then wrote one storage, and its meta storage (held, so that
    its identity is never reused while the record lives)."""

    storage: torch.UntypedStorage
    entries: list[Entry] = field(default_factory=list)


@dataclass
class Record:
    """Every storage recorded in one block, by storage identity."""

    logs: dict[int, Log] = field(default_factory=dict)


# module -> (its record, names of its own tensors that were meta when the block closed)
_DEFERRED: weakref.WeakKeyDictionary[nn.Module, tuple[Record, frozenset[str]]]
_DEFERRED = weakref.WeakKeyDictionary()
_active: list[_Recorder] = []


def storage_key(t: Tensor) -> int:
    """The identity of `t`'s storage (shared by its views, `.data` and `.detach()`)."""
    return t.untyped_storage()._cdata


def ref_of(t: Tensor, version: int) -> Ref:
    """A reference to the view `t` of its storage after `version` entries of its log."""
    return Ref(
        storage_key(t),
        version,
        tuple(t.shape),
        tuple(t.stride()),
        int(t.storage_offset()),
        t.dtype,
    )


def records_of(model: nn.Module) -> dict[int, tuple[Record, frozenset[str]]]:
    """id(module) -> (record, names meta at the block's close) for each module of `model` built
    under `deferred_init`; empty for a model built otherwise."""
    found = {}
    for module in model.modules():
        entry = _DEFERRED.get(module)
        if entry is not None:
            found[id(module)] = entry
    return found


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Build a model on the meta device, recording how its constructor makes its tensors.

    `with fs.deferred_init(): model = Model(...)` holds no parameter memory; `fs.shard` or
    `fs.replicate` of `model` then replays the record one tensor at a time into local shards,
    bitwise the values the same constructor gives on the CPU from the random state the block
    began with (see [Note: a constructor recorded per storage]). The global random state
    after the block is the one the CPU constructor leaves. `shard`'s `seed=` and `init=` do
    not apply to such a model.
    """
    if _active:
        raise DeferredInitError(
            "funcshard.deferred_init: blocks do not nest, got a block inside another. Build "
            "the whole model inside one block (submodules built in it are recorded too)."
        )
    recorder = _Recorder()
    modules: list[nn.Module] = []
    hooks = [
        register(lambda m, *_: modules.append(m))
        for register in (
            torch_module.register_module_parameter_registration_hook,
            torch_module.register_module_buffer_registration_hook,
            torch_module.register_module_module_registration_hook,
        )
    ]
    _active.append(recorder)
    try:
        with recorder:
            yield
    finally:
        _active.pop()
        for hook in hooks:
            hook.remove()
    record = recorder.record
    for m in {id(m): m for m in modules}.values():
        own = [*m._parameters.items(), *m._buffers.items()]
        _DEFERRED[m] = (record, frozenset(n for n, t in own if t is not None and t.is_meta))


_UNREPLAYABLE = {
    "_standard_gamma",
    "_sample_dirichlet",
    "poisson",
    "binomial",
    "multinomial",
}


class _Recorder(TorchDispatchMode):
    """Appends each op that makes or writes a meta tensor to its storage's log."""

    def __init__(self) -> None:
        super().__init__()
        self.record = Record()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:
            raise _refused(
                func, "reads a tensor's value into Python (.item(), .tolist(), a tensor in an if)"
            )
        kwargs = _on_meta(func, args, kwargs)
        metas = [t for t in pytree.tree_leaves((args, kwargs)) if _is_meta(t)]
        unknown = [t for t in metas if storage_key(t) not in self.record.logs]
        if unknown:
            raise _refused(func, "uses a meta tensor made outside the deferred_init block")
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if seeded and func._schema.name.split("::")[-1] in _UNREPLAYABLE:
            raise _refused(func, "draws a number of random values that depends on its inputs")
        leaves = pytree.tree_leaves((args, kwargs))
        if not metas and not any(on_cpu(x) is not x for x in leaves):
            out = func(*args, **kwargs)  # no recorded tensor, no meta device: a plain op
            if not any(_is_meta(t) for t in pytree.tree_leaves(out)):
                return out
            raise _refused(func, "made a meta tensor from no meta input or device")
        ref_args, ref_kwargs = self._refs(args), self._refs(kwargs)
        rng = _generator_state(func, args, kwargs) if seeded else None
        if metas:  # CPU tensors (torch.tensor(data) stays on the CPU) meet meta ones on meta
            if any(not _is_meta(t) for t in _written(func, args, kwargs)):
                raise _refused(func, "writes a CPU tensor from a meta one")
            args, kwargs = pytree.tree_map(_to_meta, (args, kwargs))
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            raise _refused(func, f"cannot run on the meta device ({type(e).__name__}: {e})") from e
        outs = pytree.tree_leaves(out)
        if seeded:
            _advance_on_scratch(func, args, kwargs)
        where = _user_line()
        entry = Entry(func, ref_args, ref_kwargs, rng=rng, where=where)
        for key in _written_keys(func, args, kwargs):
            self.record.logs[key].entries.append(entry)
        inputs = {storage_key(t) for t in metas}
        for i, t in enumerate(outs):
            key = storage_key(t) if _is_meta(t) else None
            if key is not None and key not in inputs and key not in self.record.logs:
                view = ref_of(t, 0)
                first = Entry(func, ref_args, ref_kwargs, i, view, rng, where)
                self.record.logs[key] = Log(t.untyped_storage(), [first])
        return out

    def _refs(self, tree: Any) -> Any:
        """`tree` with meta tensors replaced by `Ref`s and other tensors by copies."""

        def ref(x: Any) -> Any:
            if _is_meta(x):
                return ref_of(x, len(self.record.logs[storage_key(x)].entries))
            if isinstance(x, Tensor):
                return x.detach().clone()  # a constant from the CPU, as it was then
            return x

        return pytree.tree_map(ref, tree)


def _on_meta(func: Any, args: tuple, kwargs: dict) -> dict:
    """`kwargs` with a factory's CPU or default device made the meta device.

    Only ops with no tensor input and a `device` argument are factories; what the user
    passes explicitly as the CPU becomes meta too, since the replay runs on the CPU anyway.
    """
    if any(isinstance(x, Tensor) for x in pytree.tree_leaves((args, kwargs))):
        return kwargs
    if not any(a.name == "device" and a.kwarg_only for a in func._schema.arguments):
        return kwargs
    device = kwargs.get("device")
    if device is None or torch.device(device).type == "cpu":
        return {**kwargs, "device": torch.device("meta")}
    return kwargs


def _to_meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, Tensor) and x.device.type == "cpu" else x


def _is_meta(x: Any) -> bool:
    return isinstance(x, Tensor) and x.is_meta


def _written(func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors `func` writes, from its schema."""
    found = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = kwargs.get(arg.name, args[i] if i < len(args) and not arg.kwarg_only else None)
            for t in value if isinstance(value, list | tuple) else (value,):
                if isinstance(t, Tensor):
                    found.append(t)
    return found


def _written_keys(func: Any, args: tuple, kwargs: dict) -> list[int]:
    """Storage identities of the meta tensors `func` writes."""
    return list(dict.fromkeys(storage_key(t) for t in _written(func, args, kwargs) if _is_meta(t)))


def generator_arg(func: Any) -> tuple[int, str] | None:
    """(position, name) of `func`'s generator argument, or None if it takes none."""
    for i, arg in enumerate(func._schema.arguments):
        if "Generator" in str(arg.type):
            return i, arg.name
    return None


def _generator_of(func: Any, args: tuple, kwargs: dict) -> torch.Generator | None:
    found = generator_arg(func)
    if found is None:
        return None
    i, name = found
    value = kwargs.get(name, args[i] if i < len(args) else None)
    return value if isinstance(value, torch.Generator) else None


def _generator_state(func: Any, args: tuple, kwargs: dict) -> Tensor:
    """The state of the generator `func` draws from on the CPU, before it draws."""
    generator = _generator_of(func, args, kwargs)
    if generator is not None and generator.device.type != "cpu":
        raise _refused(func, f"draws from a {generator.device.type} generator; pass a CPU one")
    return (generator or torch.default_generator).get_state()


def _advance_on_scratch(func: Any, args: tuple, kwargs: dict) -> None:
    """Run a random op once on CPU zeros of the same views, so the generator advances as the
    CPU constructor advances it; the result is dropped."""

    def scratch(x: Any) -> Any:
        if _is_meta(x):
            storage = torch.zeros(x.untyped_storage().nbytes(), dtype=torch.uint8)
            return torch.empty(0, dtype=x.dtype).set_(
                storage.untyped_storage(), x.storage_offset(), x.shape, x.stride()
            )
        return on_cpu(x)

    func(*pytree.tree_map(scratch, args), **pytree.tree_map(scratch, kwargs))


def on_cpu(x: Any) -> Any:
    """The meta device in an op's arguments, as the CPU (where the record replays)."""
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


def _refused(func: Any, why: str) -> DeferredInitError:
    return DeferredInitError(
        f"funcshard.deferred_init: {_building()} at {_user_line()}: {func} {why}, which the "
        f"record cannot replay. Keep tensor values out of the constructor's Python logic, or "
        f"build this model on the meta device without the block and pass "
        f"fs.shard(..., init=fn) instead."
    )


def _building() -> str:
    """The innermost nn.Module whose `__init__` is on the stack, as 'building Name'."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), nn.Module):
            return f"building {type(frame.f_locals['self']).__qualname__}"
        frame = frame.f_back
    return "in the block"


_SKIPPED = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (torch, sys.modules[__name__.split(".")[0]])
    if m.__file__
)


def _user_line() -> str:
    """'file:line' of the innermost frame outside torch and funcshard."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_SKIPPED) and not name.startswith("<"):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "an unknown line"
