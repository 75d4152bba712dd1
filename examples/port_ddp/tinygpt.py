"""What the two port_ddp scripts share: the settings, the model, the data and the schedule.

train_ddp.py is a plain DDP training script; train_funcshard.py is the same script ported
to funcshard (docs/guides/porting.md walks the port). Everything that is not part of the
port lives here, so the two differ only where a port changes something.

[Note: a corpus made in code]
The data is a synthetic token stream made from a seeded generator: each token follows the
previous one by a fixed rule most of the time and is random otherwise, so a model can learn
it and the loss goes down, with nothing downloaded. A batch is a function of the step (and
the micro-batch): the same global batch on every rank, each rank taking its own rows. So a
run resumed from a checkpoint sees the batches the uninterrupted run saw, with no data
loader state to save, and both scripts see the same rows on the same rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from funcshard.testing.models import GPT, Block, GPTConfig

__all__ = [
    "GPT",
    "Block",
    "GPTConfig",
    "corpus",
    "get_batch",
    "lr_factor",
    "model_args",
    "parser",
    "sample",
]


def parser(description: str) -> argparse.ArgumentParser:
    """The settings both scripts take (nanoGPT's names), with defaults small enough for CPUs."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out-dir", default=None, help="checkpoints go here; --resume reads them")
    p.add_argument("--resume", action="store_true", help="resume from --out-dir if it holds one")
    p.add_argument("--max-iters", type=int, default=50, help="train up to this step")
    p.add_argument("--lr-decay-iters", type=int, default=50, help="the schedule's length")
    p.add_argument("--warmup-iters", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--eval-iters", type=int, default=2)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--d-model", type=int, default=32)
    return p


def model_args(args: argparse.Namespace) -> dict:
    """The model's settings as plain values, which a checkpoint keeps to rebuild the model."""
    cfg = GPTConfig(
        vocab_size=61,
        block_size=16,
        n_layer=args.n_layer,
        n_head=2,
        d_model=args.d_model,
        dropout=0.0,
    )
    return dataclasses.asdict(cfg)


def corpus(split: str, n: int = 20_000) -> torch.Tensor:
    """A learnable token stream (see [Note: a corpus made in code]); "val" is another draw."""
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    vocab = 61
    noise = torch.randint(vocab, (n,), generator=g).tolist()
    keep = (torch.rand(n, generator=g) < 0.8).tolist()
    tokens = [0]
    for i in range(1, n):  # next = 7 * previous + 3 (mod vocab), 80% of the time
        tokens.append((7 * tokens[-1] + 3) % vocab if keep[i] else noise[i])
    return torch.tensor(tokens)


def get_batch(
    data: torch.Tensor, step: int, micro: int, rank: int, world: int, batch: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step `step`'s micro-batch `micro`: inputs and next-token targets."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    starts = torch.randint(len(data) - block - 1, (batch * world,), generator=g)
    windows = torch.stack([data[s : s + block + 1] for s in starts.tolist()])
    mine = windows.chunk(world)[rank]
    return mine[:, :-1], mine[:, 1:]


def lr_factor(step: int, args: argparse.Namespace) -> float:
    """Linear warmup then cosine decay to min_lr, as a factor of lr (a LambdaLR's lambda)."""
    if step < args.warmup_iters:
        return (step + 1) / (args.warmup_iters + 1)
    if step > args.lr_decay_iters:
        return args.min_lr / args.lr
    ratio = (step - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return (args.min_lr + coeff * (args.lr - args.min_lr)) / args.lr


@torch.no_grad()
def sample(ckpt_path: str, prompt: list[int], n: int = 8) -> list[int]:
    """A plain sampling script's core: `torch.load` a ckpt.pt, greedy-decode n tokens."""
    ckpt = torch.load(ckpt_path, map_location="cpu")
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    tokens, block = torch.tensor([prompt]), ckpt["model_args"]["block_size"]
    for _ in range(n):
        logits = model(tokens[:, -block:])
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0, len(prompt) :].tolist()
