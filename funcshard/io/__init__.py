"""Checkpoints: torch.distributed.checkpoint saves and loads at any world size, their
checksums, and Hugging Face safetensors in and out of shards.

May import: compiling, optim, step, init, core, comm.
"""

# The wing's public names are funcshard.checkpoint's (io/_checkpoint.py's __all__).
from funcshard.io._checkpoint import *  # noqa: F403
from funcshard.io._checkpoint import __all__ as __all__
