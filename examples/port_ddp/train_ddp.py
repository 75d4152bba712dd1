"""A small GPT trained with plain PyTorch DDP: the script docs/guides/porting.md ports.

    torchrun --standalone --nproc-per-node 2 examples/port_ddp/train_ddp.py [--out-dir out]
    python examples/port_ddp/train_ddp.py            # one process

DistributedDataParallel, AdamW with decay and no-decay param groups, a LambdaLR warmup and
cosine schedule, clip_grad_norm_, gradient accumulation with no_sync, an evaluation on every
rank logged on rank 0, torch.save checkpoints on rank 0 and a resume from them.
train_funcshard.py is the same script ported to funcshard.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tinygpt


def setup() -> None:
    """Join torchrun's process group, or make a world of one process without a launcher."""
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor, args, rank: int, world: int) -> float:
    """The validation loss over every rank's batches: each rank its own, then an all-reduce."""
    model.eval()
    block = model.cfg.block_size
    losses = []
    for k in range(args.eval_iters):
        x, y = tinygpt.get_batch(data, k, 0, rank, world, args.batch, block)
        losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    mean = torch.stack(losses).mean()
    dist.all_reduce(mean)  # gloo has no AVG: sum, then divide
    model.train()
    return mean.item() / world


def main(argv: list[str] | None = None) -> dict:
    """Train; return this rank's loss per step and the validation losses (for the tests)."""
    args = tinygpt.parser(__doc__.splitlines()[0]).parse_args(argv)
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt") if args.out_dir else None

    model_args, start, checkpoint = tinygpt.model_args(args), 0, None
    if args.resume and ckpt_path and os.path.exists(ckpt_path):
        checkpoint = torch.load(ckpt_path, map_location="cpu")
        model_args, start = checkpoint["model_args"], checkpoint["iter_num"]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = tinygpt.GPT(tinygpt.GPTConfig(**model_args))
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
    ddp = DDP(model)

    params = dict(model.named_parameters())
    decay = [p for p in params.values() if p.dim() >= 2]  # matrices and embeddings decay
    no_decay = [p for p in params.values() if p.dim() < 2]  # biases and norms do not
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: tinygpt.lr_factor(step, args)
    )
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])

    train, val = tinygpt.corpus("train"), tinygpt.corpus("val")
    block = model_args["block_size"]
    losses, val_losses = [], []
    for step in range(start, args.max_iters):
        if step % args.eval_interval == 0:
            val_losses.append(evaluate(model, val, args, rank, world))
            if rank == 0:
                print(f"step {step}: val loss {val_losses[-1]:.4f}", flush=True)
        total = 0.0
        for micro in range(args.grad_accum):
            x, y = tinygpt.get_batch(train, step, micro, rank, world, args.batch, block)
            last = micro == args.grad_accum - 1
            with contextlib.nullcontext() if last else ddp.no_sync():  # all-reduce on the last
                loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()) / args.grad_accum
                loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        done = step + 1
        if ckpt_path and (done % args.eval_interval == 0 or done == args.max_iters) and rank == 0:
            os.makedirs(args.out_dir, exist_ok=True)
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "model_args": model_args,
                    "iter_num": done,
                },
                ckpt_path,
            )
    val_losses.append(evaluate(model, val, args, rank, world))
    if rank == 0:
        print(f"step {args.max_iters}: val loss {val_losses[-1]:.4f}", flush=True)
    dist.barrier()  # rank 0's last save is complete before any rank returns
    return {"train": losses, "val": val_losses}


if __name__ == "__main__":
    setup()
    main()
    dist.destroy_process_group()
