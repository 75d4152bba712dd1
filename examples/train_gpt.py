"""Train a character-level GPT with funcshard, one process per rank, as a plain script.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py [--steps 300] [--mode fsdp]
        [--optimizer adamw|muon]
    python examples/train_gpt.py [--steps 300]      # one process, no launcher

On GPUs torchrun starts one rank per GPU and `Mesh.from_env()` picks NCCL; on CPUs, gloo.
The text is the Python standard library's own source, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
from datetime import timedelta

import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard.testing.models import GPT, Block, GPTConfig


def stdlib_bytes(limit: int = 2_000_000) -> torch.Tensor:
    """The standard library's Python sources as a 1-D tensor of byte values."""
    paths = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    text = b"".join(open(p, "rb").read() for p in paths)[:limit]  # noqa: SIM115
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def loss_fn(model: GPT, state: fs.ShardedState, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = fs.call(model, state, x)  # each block gathered just before it runs
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def optimizer(name: str) -> fs.optim.Optimizer:
    """AdamW on everything, or Muon on the blocks' matrices and AdamW on the rest (each
    matrix orthogonalized whole, once, on one owner rank: see fs.optim.whole_params)."""
    if name == "adamw":
        return fs.optim.adamw(3e-3)

    def label(fqn: str, param: torch.Tensor) -> str:
        return "muon" if param.ndim == 2 and fqn.startswith("blocks.") else "adamw"

    groups = {"muon": fs.optim.muon(0.02, weight_decay=0.01), "adamw": fs.optim.adamw(3e-3)}
    return fs.optim.partition(groups, label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--mode", choices=["fsdp", "replicate"], default="fsdp")
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--checkpoint-dir", default=None, help="saves here; resumes from here")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    args = parser.parse_args()

    # shard over every rank torchrun started; a collective waits at most a minute for the others
    mesh = fs.Mesh.from_env(timeout=timedelta(minutes=1))
    if args.mode == "replicate":
        mesh = fs.Mesh(replicate=mesh.size, timeout=mesh.timeout)
    rank, world = torch.distributed.get_rank(), mesh.size
    cfg = GPTConfig(
        vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=128, dropout=args.dropout
    )
    with torch.device("meta"):
        model = GPT(cfg)  # no memory: shard() initializes only this rank's slices
    if args.mode == "replicate":
        state = fs.replicate(model, mesh)
    else:
        state = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), mesh)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), optimizer(args.optimizer))
    opt_state = opt.init(state)
    start = 0
    if args.checkpoint_dir and os.path.exists(os.path.join(args.checkpoint_dir, "LATEST")):
        state, opt_state, start, _ = fs.checkpoint.load(
            args.checkpoint_dir, like=(state, opt_state)
        )  # e.g. after torchrun --max-restarts restarted every rank
        if rank == 0:
            print(f"resumed from step {start}", flush=True)

    data = stdlib_bytes()
    grad_fn = fs.value_and_grad(functools.partial(loss_fn, model))
    for step in range(start, args.steps):
        fs.manual_seed(0, mesh, step)  # this rank's own dropout stream, resumable by step
        g = torch.Generator().manual_seed(step)  # the same global batch on every rank...
        starts = torch.randint(len(data) - cfg.block_size - 1, (args.batch * world,), generator=g)
        windows = torch.stack([data[s : s + cfg.block_size + 1] for s in starts.tolist()])
        x, y = windows[:, :-1].chunk(world)[rank], windows[:, 1:].chunk(world)[rank]  # ...split
        loss, grads = grad_fn(state, x.to(mesh.device), y.to(mesh.device))
        # update and apply in one, reusing the old state's and grads' memory (donated)
        state, opt_state = opt.step(grads, opt_state, state)
        if step % 50 == 0:
            mean = fs.pmean(loss.detach(), mesh).item()  # every rank's batch, not just ours
            if rank == 0:
                print(f"step {step} loss {mean:.3f}", flush=True)
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            fs.checkpoint.save(args.checkpoint_dir, state, opt_state, step=step + 1)
    mean = fs.pmean(loss.detach(), mesh).item()
    if rank == 0:
        print(f"final loss {mean:.3f}")
    fs.shutdown()


if __name__ == "__main__":
    main()
