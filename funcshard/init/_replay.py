"""Replay a `deferred_init` record into this rank's shards, one tensor at a time.

[Note: replaying a deferred model]
Each parameter and buffer is rebuilt alone, on the CPU, from its storage's log and the logs
it names (see [Note: a constructor recorded per storage] in funcshard/init/_deferred.py):
the first entry runs again with the meta device read as the CPU, and each later entry writes
the storage as it did. Inputs at an older version of another storage are rebuilt from that
storage's log up to that version; within one tensor they are kept, after it they are dropped.
A random op first restores the generator state saved for it (the global CPU generator, or a
private generator for one the constructor passed), so the values are bitwise the CPU
constructor's whatever the replay order, and the caller's random state is restored after.

Each rebuilt parameter writes its overlap with this rank's slice of its unit's flat buffer
(zero-padded as in funcshard/init/_materialize.py's `local_slice`) and is dropped before the
next one, so peak memory is the largest parameter and the inputs of its log, plus the local
shards. The shards move to the mesh's device once filled.

What cannot be replayed is found before any collective, the same on every rank: a tensor
replaced after the block (`.to(dtype)`, `to_empty()`), one built outside it, and one made by
an `empty` factory and never written (a CPU build leaves it garbage, so no replay can match).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from funcshard.core._layout import FlatLayout, Layout
from funcshard.core._tree import format_names, join_fqn
from funcshard.init._deferred import (
    DeferredInitError,
    Entry,
    Log,
    Ref,
    generator_arg,
    on_cpu,
    records_of,
    ref_of,
    storage_key,
)
from funcshard.init._materialize import local_slice_of

_EMPTY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def is_deferred(model: nn.Module) -> bool:
    """Whether any module of `model` was built under `deferred_init`."""
    return bool(records_of(model))


def check_deferred(model: nn.Module, where: str) -> None:
    """Raise, before any collective, if some tensor of a deferred model cannot be replayed."""
    records = records_of(model)
    logs = _logs(model)
    moved, outside, never_written = [], [], []
    for prefix, module in model.named_modules():
        entry = records.get(id(module))
        meta_at_close = entry[1] if entry else frozenset()
        for name, t in (*module._parameters.items(), *module._buffers.items()):
            if t is None:
                continue
            fqn = join_fqn(prefix, name)
            key = storage_key(t) if t.is_meta else None
            if key is not None and key in logs:
                if _never_written(logs[key]):
                    never_written.append(fqn)
            elif name in meta_at_close:
                moved.append(fqn)
            elif t.is_meta:
                outside.append(fqn)
    if moved:
        raise ValueError(
            f"{where}: {format_names(moved)} were replaced after the deferred_init block "
            f"(.to(), to_empty(), or a new tensor assigned), so their recorded construction no "
            f"longer describes them. Pass the model to {where.removeprefix('funcshard.')} as "
            f"the block left it: it materializes and moves the shards itself."
        )
    if outside:
        raise ValueError(
            f"{where}: {format_names(outside)} are on the meta device but were not built in "
            f"the deferred_init block, so nothing records their values. Build them inside the "
            f"block (wrappers such as get_peft_model too)."
        )
    if never_written:
        raise ValueError(
            f"{where}: {format_names(never_written)} are made by torch.empty in the "
            f"constructor and never written, so their values are whatever memory held (no "
            f"replay can match them). Initialize them in the constructor."
        )


def materialize_deferred(
    model: nn.Module, layout: Layout, shard_rank: int, device: torch.device, where: str
) -> tuple[list[Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """This rank's shards (layout order), replicated parameters and buffers of a deferred
    model, per [Note: replaying a deferred model]; `model` is not changed."""
    replay = _Replay(_logs(model), where)
    params: dict[str, Tensor] = dict(model.named_parameters())
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        shards = [_shard(flat, params, replay, shard_rank).to(device) for flat in layout.flats]
        replicated = {f: replay.value(f, params[f]).to(device) for f in layout.replicated}
        buffers = {f: replay.value(f, b).to(device) for f, b in model.named_buffers()}
    return shards, replicated, buffers


def _shard(flat: FlatLayout, params: dict[str, Tensor], replay: _Replay, rank: int) -> Tensor:
    """This rank's (shard_numel,) slice of `flat`, each member rebuilt and dropped in turn."""
    return local_slice_of(lambda i: replay.value(flat.fqns[i], params[flat.fqns[i]]), flat, rank)


def _logs(model: nn.Module) -> dict[int, Log]:
    logs: dict[int, Log] = {}
    for record, _ in {id(r): (r, n) for r, n in records_of(model).values()}.values():
        logs.update(record.logs)
    return logs


def _never_written(log: Log) -> bool:
    first = log.entries[0].func
    return len(log.entries) == 1 and first._schema.name.split("::")[-1] in _EMPTY


class _Replay:
    """Rebuilds storages from their logs; keeps those one tensor needs until it is built."""

    def __init__(self, logs: dict[int, Log], where: str) -> None:
        self.logs, self.where = logs, where
        self.built: dict[tuple[int, int], torch.UntypedStorage] = {}

    def value(self, fqn: str, t: Tensor) -> Tensor:
        """The tensor `t` (a parameter or buffer) as the CPU constructor left it."""
        if not t.is_meta:
            return t.detach().clone()
        key = storage_key(t)
        ref = ref_of(t, len(self.logs[key].entries))
        try:
            return self._view(ref)  # holds its storage once the others are dropped
        except DeferredInitError:
            raise
        except Exception as e:
            raise DeferredInitError(
                f"{self.where}: replaying the construction of {fqn!r} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        finally:
            self.built.clear()

    def _view(self, ref: Ref, current: tuple[int, torch.UntypedStorage] | None = None) -> Tensor:
        """A real view like `ref`; `current` is the storage being written, still in progress."""
        if current is not None and current[0] == ref.key:
            storage = current[1]
        else:
            storage = self._storage(ref.key, ref.version)
        return torch.empty(0, dtype=ref.dtype).set_(storage, ref.offset, ref.size, ref.stride)

    def _storage(self, key: int, version: int) -> torch.UntypedStorage:
        """Storage `key` after the first `version` entries of its log."""
        if (key, version) in self.built:
            return self.built[(key, version)]
        log = self.logs[key]
        storage = self._create(log.entries[0], log.storage.nbytes())
        for entry in log.entries[1:version]:
            self._write(entry, (key, storage))
        self.built[(key, version)] = storage
        return storage

    def _create(self, entry: Entry, nbytes: int) -> torch.UntypedStorage:
        """Run a storage's first entry; its output laid out as the meta one was."""
        inputs: list[int] = []
        out = pytree.tree_leaves(self._run(entry, None, inputs))[entry.output]
        view = entry.view
        assert view is not None  # a first entry records the view it made
        if (
            out.untyped_storage()._cdata not in inputs
            and out.untyped_storage().nbytes() == nbytes
            and (out.stride(), out.storage_offset()) == (view.stride, view.offset)
        ):
            return out.untyped_storage()
        storage = torch.UntypedStorage(nbytes)
        fresh = torch.empty(0, dtype=view.dtype).set_(storage, view.offset, view.size, view.stride)
        fresh.copy_(out)
        return storage

    def _write(self, entry: Entry, current: tuple[int, torch.UntypedStorage]) -> None:
        """Replay an op that wrote the storage `current` (others it wrote get copies)."""
        self._run(entry, current, [])

    def _run(
        self, entry: Entry, current: tuple[int, torch.UntypedStorage] | None, inputs: list[int]
    ) -> Any:
        written = _written_positions(entry.func)

        def resolve(x: Any, copy: bool = False) -> Any:
            if isinstance(x, Ref):
                view = self._view(x, current)
                inputs.append(view.untyped_storage()._cdata)
                own = current is not None and x.key == current[0]
                return view.clone() if copy and not own else view
            if isinstance(x, Tensor):
                return x.clone() if copy else x
            return on_cpu(x)

        args = [
            pytree.tree_map(lambda x, i=i: resolve(x, i in written), a)
            for i, a in enumerate(entry.args)
        ]
        kwargs = {
            k: pytree.tree_map(lambda x, k=k: resolve(x, k in written), v)
            for k, v in entry.kwargs.items()
        }
        if entry.rng is not None:
            _restore_generator(entry, args, kwargs)
        return entry.func(*args, **kwargs)


def _restore_generator(entry: Entry, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Set the state a random op drew from: a private generator in place of one the
    constructor passed, else the global CPU generator (forked by the caller)."""
    assert entry.rng is not None  # only random ops are restored
    found = generator_arg(entry.func)
    if found is not None and kwargs.get(found[1]) is not None:
        kwargs[found[1]] = torch.Generator().set_state(entry.rng)
    elif found is not None and found[0] < len(args) and args[found[0]] is not None:
        args[found[0]] = torch.Generator().set_state(entry.rng)
    else:
        torch.random.set_rng_state(entry.rng)


def _written_positions(func: Any) -> set[int | str]:
    """Positions and names of the arguments `func` writes."""
    found: set[int | str] = set()
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            found.update((i, arg.name))
    return found
