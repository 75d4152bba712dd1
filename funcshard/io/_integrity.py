"""Checksums of a checkpoint's bytes: written at save, checked before a load uses them.

[Note: checkpoint integrity]
Bytes rot on disks and copies get cut short; torch.distributed.checkpoint reads whatever is
there, so a flipped bit in tensor data loads as a silently wrong weight, and one in the
serialization framing fails with torch's unrelated weights_only advice. So a save records,
in `funcshard.checksums.json` beside DCP's files and before `LATEST` commits it, the size and
CRC-32 (zlib's, ~1 GB/s: a fraction of the time the save itself takes) of DCP's `.metadata`,
of funcshard's own `funcshard.json`, and of every chunk DCP wrote: each (parameter FQN, chunk
offset) maps to a byte range of a `.distcp` file in DCP's metadata, and each rank checksums
an equal share of the chunks. A load checks the metadata before unpickling it and each rank
checks its share of the chunks before DCP reads any; every rank learns every mismatch (one
all-gather of the findings), so all raise `CheckpointCorrupted` together, naming the file,
the tensor and chunk, and the previous complete checkpoint to load instead. `verify(path)`
checks a whole checkpoint offline, with no process group. Checkpoints written before
checksums existed still load, with a warning that they were not verified. The checksums
file carries a CRC-32 of its own content, so a damaged checksums file is named as such
rather than as damaged tensor data.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from funcshard.io import _dcp as dcp

CHECKSUMS = "funcshard.checksums.json"
DCP_METADATA = ".metadata"
_BLOCK = 1 << 22  # bytes read at a time


class CheckpointCorrupted(ValueError):
    """A checkpoint's bytes differ from what its save wrote (or cannot be read at all)."""


@dataclass(frozen=True)
class Chunk:
    """A byte range of one DCP file holding one chunk of one saved tensor."""

    fqn: str
    offset: tuple[int, ...]  # where the chunk starts in the full tensor
    file: str
    start: int
    length: int

    def describe(self) -> str:
        return f"{self.fqn!r} (chunk at {list(self.offset)}, bytes {self.start}..{self.end})"

    @property
    def end(self) -> int:
        return self.start + self.length


def crc(path: str, start: int = 0, length: int | None = None) -> int:
    """CRC-32 of `length` bytes of a file from `start` (to its end when None); a file
    shorter than the range raises CheckpointCorrupted (truncated)."""
    value, left = 0, length
    with open(path, "rb") as f:
        f.seek(start)
        while left is None or left > 0:
            block = f.read(_BLOCK if left is None else min(_BLOCK, left))
            if not block:
                break
            value = zlib.crc32(block, value)
            if left is not None:
                left -= len(block)
    if left:
        raise CheckpointCorrupted(f"{path} is truncated: {left} bytes missing at its end")
    return value


def chunks(directory: str) -> list[Chunk]:
    """Every chunk DCP wrote into `directory`, in a fixed order (from its metadata)."""
    found = [
        Chunk(fqn, tuple(offset), file, start, length)
        for fqn, offset, file, start, length in dcp.dcp_storage(directory)
    ]
    return sorted(found, key=lambda c: (c.file, c.start))


def checksum_share(directory: str, share: int, shares: int) -> list[dict]:
    """Records of chunks `share`, `share + shares`, ... : each rank checksums its share."""
    return [
        {
            **_key(c),
            "file": c.file,
            "start": c.start,
            "length": c.length,
            "crc32": crc(os.path.join(directory, c.file), c.start, c.length),
        }
        for c in chunks(directory)[share::shares]
    ]


def write(directory: str, chunk_records: Iterable[dict], files: Iterable[str]) -> None:
    """Write the checksums file: the chunk records and whole-file records of `files`."""
    record: dict[str, Any] = {
        "algorithm": "crc32",
        "files": {f: _file_record(os.path.join(directory, f)) for f in files},
        "chunks": sorted(chunk_records, key=lambda r: (r["file"], r["start"])),
    }
    record["self_crc32"] = _self_crc(record)
    tmp = os.path.join(directory, CHECKSUMS + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(directory, CHECKSUMS))


def read(directory: str) -> dict | None:
    """The checksums file of a checkpoint, or None for one saved before checksums."""
    path = os.path.join(directory, CHECKSUMS)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
        if record.get("algorithm") != "crc32" or "chunks" not in record:
            raise ValueError("not a checksums file funcshard wrote")
    except (ValueError, OSError) as e:
        raise CheckpointCorrupted(f"{path} cannot be read ({e})") from e
    if "self_crc32" in record and record["self_crc32"] != _self_crc(record):
        raise CheckpointCorrupted(
            f"{path} itself is damaged: its own CRC-32 does not match what it holds, so it "
            f"cannot tell which chunks are intact (the tensor data may well be). Restore it "
            f"from a copy, or load the checkpoint with verify=False if you trust its data"
        )
    return record


def _self_crc(record: dict) -> int:
    """CRC-32 of a checksums record without its own CRC (a damaged record is named as
    such, not as damaged tensor data)."""
    body = {k: v for k, v in record.items() if k != "self_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def check_files(directory: str, record: dict) -> list[str]:
    """Mismatches of the whole files the record covers (DCP's metadata, funcshard.json)."""
    problems = []
    for name, expected in record["files"].items():
        path = os.path.join(directory, name)
        try:
            actual = _file_record(path)
        except (OSError, CheckpointCorrupted) as e:
            problems.append(f"{path}: cannot be read ({e})")
            continue
        if actual != expected:
            problems.append(
                f"{path}: {actual['size']} bytes with CRC-32 {actual['crc32']:08x}, but the "
                f"save wrote {expected['size']} bytes with CRC-32 {expected['crc32']:08x}"
            )
    return problems


def check_chunks(directory: str, record: dict, share: int = 0, shares: int = 1) -> list[str]:
    """Mismatches among chunks `share`, `share + shares`, ... of the record."""
    problems = []
    for entry in record["chunks"][share::shares]:
        path = os.path.join(directory, entry["file"])
        chunk = Chunk(
            entry["fqn"], tuple(entry["offset"]), entry["file"], entry["start"], entry["length"]
        )
        try:
            actual = crc(path, chunk.start, chunk.length)
        except FileNotFoundError:
            problems.append(f"{path}: missing (it holds {chunk.describe()})")
            continue
        except (OSError, CheckpointCorrupted) as e:
            problems.append(f"{path}: {chunk.describe()} cannot be read ({e})")
            continue
        if actual != entry["crc32"]:
            problems.append(
                f"{path}: {chunk.describe()} has CRC-32 {actual:08x}, the save wrote "
                f"{entry['crc32']:08x}"
            )
    return problems


@dataclass(frozen=True)
class Report:
    """What `verify` found: one line per file, and every problem."""

    directory: str
    lines: tuple[str, ...]
    problems: tuple[str, ...]
    verified: bool  # False for a checkpoint saved without checksums

    @property
    def ok(self) -> bool:
        return self.verified and not self.problems


def verify(directory: str) -> Report:
    """Check every byte a checkpoint directory's checksums cover, offline (see [Note:
    checkpoint integrity])."""
    record = read(directory)
    if record is None:
        line = f"{directory}: saved without checksums (before funcshard wrote them): not verified"
        return Report(directory, (line,), (), verified=False)
    problems = check_files(directory, record)
    chunk_problems = check_chunks(directory, record)
    lines = [
        f"{name}: {'ok' if not _about(name, problems) else 'CORRUPTED'}" for name in record["files"]
    ]
    per_file: dict[str, int] = {}
    for entry in record["chunks"]:
        per_file[entry["file"]] = per_file.get(entry["file"], 0) + 1
    for name, count in sorted(per_file.items()):
        bad = len(_about(name, chunk_problems))
        state = "ok" if not bad else f"CORRUPTED ({bad} of {count} chunks)"
        lines.append(f"{name}: {count} chunks, {state}")
    return Report(directory, tuple(lines), tuple(problems + chunk_problems), verified=True)


def _about(name: str, problems: list[str]) -> list[str]:
    return [p for p in problems if p.split(": ", 1)[0].endswith(os.sep + name)]


def _key(chunk: Chunk) -> dict:
    return {"fqn": chunk.fqn, "offset": list(chunk.offset)}


def _file_record(path: str) -> dict:
    return {"size": os.path.getsize(path), "crc32": crc(path)}
