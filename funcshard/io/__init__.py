"""Checkpoints: torch.distributed.checkpoint saves and loads at any world size, their
checksums, and Hugging Face safetensors in and out of shards.

May import: compiling, optim, step, init, core, comm.
"""

from funcshard.io._integrity import CheckpointCorrupted as CheckpointCorrupted

__all__ = [
    "CheckpointCorrupted",
]
