"""Checkpoints: torch.distributed.checkpoint saves and loads at any world size, their
checksums, and Hugging Face safetensors in and out of shards.

May import: compiling, optim, step, init, core, comm.
"""

from funcshard.io._checkpoint import load as load
from funcshard.io._checkpoint import save as save
from funcshard.io._checkpoint_dir import CheckpointConflict as CheckpointConflict
from funcshard.io._checkpoint_latest import CheckpointRetired as CheckpointRetired
from funcshard.io._checkpoint_verify import verify as verify
from funcshard.io._hf import load_hf as load_hf
from funcshard.io._hf_save import save_hf as save_hf
from funcshard.io._integrity import CheckpointCorrupted as CheckpointCorrupted
from funcshard.io._integrity import Report as Report

__all__ = [
    "CheckpointConflict",
    "CheckpointCorrupted",
    "CheckpointRetired",
    "Report",
    "load",
    "load_hf",
    "save",
    "save_hf",
    "verify",
]
