"""Every call funcshard makes into torch.distributed.checkpoint (DCP): saving and loading, its
metadata read safely, and the ShardedTensors that carry a rank's pieces of each parameter.
Only the checkpoint code imports it; process groups come in as arguments."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import shutil
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


@contextlib.contextmanager
def _quiet_sharded_tensor() -> Iterator[None]:
    """Silence torch's "we are deprecating ShardedTensor" FutureWarning, which it gives for
    every ShardedTensor made, saved and loaded (on every rank, for every parameter).

    funcshard keeps ShardedTensor on purpose: a parameter's pieces on a rank are wherever
    the flat buffers cut it (uneven, possibly several or none per rank), which a DTensor's
    placements cannot describe, and DCP reshards ShardedTensors across world sizes. Only
    that message is silenced, only around funcshard's own calls into it.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Please use DTensor instead", category=FutureWarning
        )
        yield


def sharded_tensor(
    pieces: list[tuple[int, Tensor]],
    numel: int,
    group: ProcessGroup,
    placed: list[tuple[int, int, int]],
    like: Tensor,
) -> Any:
    """A 1-D tensor of `numel` elements sharded as (start, values) pieces across the group,
    in the form torch.distributed.checkpoint saves and reshards (a ShardedTensor).

    `placed`: every rank's pieces as (global rank, start, numel), which the layout tells
    each rank alike, so no rank asks the others (torch's `_init_from_local_shards` gathers
    them with an all-gather of objects per tensor: 312 of them made a save of the demo's
    small GPT take ~1.5 s). `like`: a tensor of the pieces' dtype and device, for a rank
    that holds none. Other ranks' placements name this rank's device: only their ranks are
    read (DCP plans each rank's writes from its own shards)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    rank = dist.get_rank()  # placements name global ranks, whatever the group
    first = pieces[0][1] if pieces else like
    device = first.device
    shards = [
        Shard(values.reshape(-1), ShardMetadata([start], [values.numel()], f"rank:{rank}/{device}"))
        for start, values in pieces
    ]
    properties = TensorProperties(
        dtype=first.dtype,
        layout=torch.strided,
        requires_grad=first.requires_grad if pieces else False,
        memory_format=torch.contiguous_format,
        pin_memory=first.is_pinned() if pieces else False,
    )
    every = [ShardMetadata([at], [n], f"rank:{r}/{device}") for r, at, n in placed]
    metadata = ShardedTensorMetadata(every, torch.Size([numel]), properties)
    with _quiet_sharded_tensor():
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, metadata, process_group=group
        )


def local_pieces(tensor: Any) -> list[tuple[int, Tensor]]:
    """The (start, values) pieces of a sharded tensor that this rank holds."""
    with _quiet_sharded_tensor():
        return [(s.metadata.shard_offsets[0], s.tensor) for s in tensor.local_shards()]


def global_size(tensor: Any) -> tuple[int, ...]:
    """The full shape of a plain or sharded tensor."""
    with _quiet_sharded_tensor():
        return tuple(tensor.size())


class CheckpointDiskFull(OSError):
    """A save found no space left (or the disk quota exceeded) on some rank's filesystem:
    raised on every rank (DCP gathers the ranks' write errors), naming the directory, the
    ranks that failed and the bytes a rank writes."""


_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def dcp_save(state_dict: dict[str, Any], directory: str, group: ProcessGroup | None = None) -> None:
    """Save through torch.distributed.checkpoint; every rank of `group` (the default group
    when None) writes its own pieces. A full disk is `CheckpointDiskFull`, not DCP's
    CheckpointException (a BaseException) around an OSError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_sharded_tensor():
            dcp.save(state_dict, checkpoint_id=directory, process_group=group)
    except CheckpointException as e:
        full = {
            rank: error
            for rank, (error, _) in e.failures.items()
            if isinstance(error, OSError) and error.errno in _FULL
        }
        if not full:
            raise
        code = next(iter(full.values())).errno or errno.ENOSPC  # (in _FULL: never None)
        raise CheckpointDiskFull(
            code,
            f"funcshard.checkpoint.save: no space left writing {directory!r} on ranks "
            f"{sorted(full)} ({os.strerror(code)}). This rank writes {_local_bytes(state_dict):,} "
            f"bytes there, and its filesystem has {_free_bytes(directory)} free. Free space, or "
            f"pass keep=N to keep fewer checkpoints; nothing half-written is loaded.",
        ) from e


def _local_bytes(state_dict: dict[str, Any]) -> int:
    """The bytes of tensors this rank writes (its pieces of the sharded ones)."""
    total = 0
    for value in state_dict.values():
        if hasattr(value, "local_shards"):  # (a ShardedTensor is a Tensor too)
            total += sum(t.numel() * t.element_size() for _, t in local_pieces(value))
        elif isinstance(value, Tensor):
            total += value.numel() * value.element_size()
    return total


def _free_bytes(directory: str) -> str:
    """The free bytes of the filesystem `directory` is on, in words."""
    path = directory
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return f"{shutil.disk_usage(path or '.').free:,} bytes"
    except OSError:
        return "an unknown number of bytes"


class CheckpointReadError(RuntimeError):
    """DCP could not read a checkpoint's files (raised on every rank: DCP gathers the
    ranks' read errors)."""


def dcp_load(state_dict: dict[str, Any], directory: str, group: ProcessGroup | None = None) -> None:
    """Load in place into `state_dict`'s tensors, reading whichever saved pieces overlap
    (collective over `group`, the default group when None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_sharded_tensor():
            dcp.load(state_dict, storage_reader=_safe_reader(directory), process_group=group)
    except CheckpointException as e:
        raise CheckpointReadError(str(e)) from e


def dcp_read(directory: str, keys: dict[str, str]) -> dict[str, Tensor]:
    """The saved tensors `keys` names (output key -> stored key), whole, on the CPU, read in
    this process alone: no process group, even where one is initialized (DCP's no_dist)."""
    import torch.distributed.checkpoint as dcp

    saved = _safe_reader(directory).read_metadata().state_dict_metadata
    template = {
        stored: torch.empty(tuple(saved[stored].size), dtype=saved[stored].properties.dtype)
        for stored in set(keys.values())
    }
    if template:
        import warnings

        with _quiet_sharded_tensor(), warnings.catch_warnings():
            # one process on purpose: DCP's "assuming ... a single process" says nothing new
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(template, storage_reader=_safe_reader(directory), no_dist=True)
    return {key: template[stored] for key, stored in keys.items()}


def dcp_sizes(directory: str) -> dict[str, tuple[int, ...]]:
    """The saved tensors' names and full shapes, from a checkpoint's metadata."""
    metadata = _safe_reader(directory).read_metadata()
    return {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}


def dcp_dtypes(directory: str) -> dict[str, torch.dtype]:
    """The saved tensors' dtypes, from a checkpoint's metadata."""
    metadata = _safe_reader(directory).read_metadata()
    return {
        k: v.properties.dtype
        for k, v in metadata.state_dict_metadata.items()
        if hasattr(v, "properties")
    }


def global_dtype(tensor: Any) -> torch.dtype:
    """The dtype of a plain or sharded tensor."""
    with _quiet_sharded_tensor():
        if isinstance(tensor, Tensor) and not hasattr(tensor, "local_shards"):
            return tensor.dtype
        return tensor.metadata().tensor_properties.dtype


def dcp_storage(directory: str) -> list[tuple[str, tuple[int, ...], str, int, int]]:
    """Where DCP wrote each chunk: (FQN, chunk offset, file, byte offset, byte length)."""
    metadata = _safe_reader(directory).read_metadata()
    return [
        (index.fqn, tuple(index.offset or ()), info.relative_path, info.offset, info.length)
        for index, info in metadata.storage_data.items()
    ]


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata file and nothing else: weights_only semantics for metadata.

    Tensor data is already read with `torch.load(weights_only=True)`; DCP reads its
    `.metadata` with plain pickle, which would run whatever a crafted file names.
    """

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint")
            or (module == "torch" and name in _TORCH_NAMES)
            or (module, name) in _OTHER_NAMES
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"funcshard.checkpoint: refusing to load {module}.{name} from checkpoint "
                f"metadata; only torch.distributed.checkpoint's own types are allowed."
            )
        return super().find_class(module, name)


_TORCH_NAMES = frozenset(
    {"Size", "device", "layout", "strided", "contiguous_format", "preserve_format"}
    | {str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
)
_OTHER_NAMES = frozenset(
    {("collections", "OrderedDict"), ("builtins", "slice"), ("torch.serialization", "_get_layout")}
    | {("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
)


def _safe_reader(directory: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """A FileSystemReader whose metadata is read by `_MetadataUnpickler`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(directory)
