"""train_ddp.py ported to funcshard: the same training, sharded (FSDP) or replicated (DDP).

    torchrun --standalone --nproc-per-node 2 examples/port_ddp/train_funcshard.py [--out-dir out]
    python examples/port_ddp/train_funcshard.py      # one process

Each change from train_ddp.py is a step of docs/guides/porting.md: the mesh from the
launcher, the model built the same way on every rank and then sharded, the loss a function
of the state, the param groups a weight-decay mask, the LambdaLR a schedule, clip_grad_norm_
the head of an optimizer chain, no_sync `reduce=False` with one `fs.reduce` per step, the
evaluation a `fs.pmean`, and torch.save a `fs.checkpoint.save` on every rank, with the
model's settings in its `extra` and a plain ckpt.pt for sampling written at the end.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import funcshard as fs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tinygpt


def loss_fn(
    model: torch.nn.Module, state: fs.ShardedState, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """The DDP script's loss line, with the model called on the state: `fs.call`."""
    return F.cross_entropy(fs.call(model, state, x).flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model, state, data, args, mesh, rank: int, world: int) -> float:
    """The validation loss over every rank's batches: each rank its own, then `fs.pmean`."""
    model.eval()
    losses = []
    for k in range(args.eval_iters):
        x, y = tinygpt.get_batch(data, k, 0, rank, world, args.batch, model.cfg.block_size)
        losses.append(loss_fn(model, state, x, y))
    mean = fs.pmean(torch.stack(losses).mean(), mesh)
    model.train()
    return mean.item()


def main(argv: list[str] | None = None) -> dict:
    """Train; return this rank's loss per step and the validation losses (for the tests)."""
    parser = tinygpt.parser(__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["fsdp", "replicate"], default="fsdp")
    args = parser.parse_args(argv)
    # torchrun's ranks, or one process under plain python; shard=1: DDP's mesh of replicas
    mesh = fs.Mesh.from_env(shard=1 if args.mode == "replicate" else None)
    rank, world = mesh.rank, mesh.size
    resume = bool(args.resume and args.out_dir and fs.checkpoint.exists(args.out_dir))

    model_args, start = tinygpt.model_args(args), 0
    if resume:  # the settings first, from the checkpoint, in any one process
        _, extra = fs.checkpoint.read_meta(args.out_dir)
        model_args = extra["model_args"]
    torch.manual_seed(args.seed)  # the same initial weights on every rank, as under DDP
    model = tinygpt.GPT(tinygpt.GPTConfig(**model_args))
    if args.mode == "replicate":  # DDP's layout: whole parameters on every rank
        state = fs.replicate(model, mesh)
    else:  # FSDP's: each rank keeps a shard of each parameter
        plan = fs.plan(model, policy=fs.policy.module_classes({tinygpt.Block}))
        state = fs.shard(model, plan, mesh)

    opt = fs.optim.chain(
        fs.optim.clip_by_global_norm(args.grad_clip),
        fs.optim.adamw(
            lambda step: args.lr * tinygpt.lr_factor(step, args),  # LambdaLR's lambda, times lr
            betas=(0.9, 0.95),
            weight_decay=args.weight_decay,
            weight_decay_mask=lambda fqn, p: p.dim() >= 2,  # the decay group
        ),
    )
    opt_state = opt.init(state)
    if resume:
        state, opt_state, start, _ = fs.checkpoint.load(args.out_dir, like=(state, opt_state))

    train, val = tinygpt.corpus("train"), tinygpt.corpus("val")
    block = model_args["block_size"]

    def micro_loss(state, x, y):
        return loss_fn(model, state, x, y) / args.grad_accum

    local_grad = fs.value_and_grad(micro_loss, reduce=False)  # DDP's no_sync: nothing reduced
    losses, val_losses = [], []
    for step in range(start, args.max_iters):
        if step % args.eval_interval == 0:
            val_losses.append(evaluate(model, state, val, args, mesh, rank, world))
            if rank == 0:
                print(f"step {step}: val loss {val_losses[-1]:.4f}", flush=True)
        total, summed = None, 0.0
        for micro in range(args.grad_accum):
            x, y = tinygpt.get_batch(train, step, micro, rank, world, args.batch, block)
            loss, grads = local_grad(state, x, y)
            total = grads if total is None else fs.accumulate(total, grads)
            summed += loss.item()
        grads = fs.reduce(state, total)  # once per step, as DDP's last micro-batch does
        state, opt_state = opt.step(grads, opt_state, state)  # clip, AdamW, scheduled lr
        losses.append(summed)
        done = step + 1
        if args.out_dir and (done % args.eval_interval == 0 or done == args.max_iters):
            fs.checkpoint.save(
                args.out_dir, state, opt_state, step=done, extra={"model_args": model_args}, keep=2
            )  # every rank
    val_losses.append(evaluate(model, state, val, args, mesh, rank, world))
    if rank == 0:
        print(f"step {args.max_iters}: val loss {val_losses[-1]:.4f}", flush=True)
    if args.out_dir:  # a plain file for a sampling script: the DDP script's ckpt.pt format
        sd = fs.full_state_dict(state)  # every rank calls it; the first gets the dict
        if sd is not None:
            torch.save(
                {"model": sd, "model_args": model_args, "iter_num": args.max_iters},
                os.path.join(args.out_dir, "ckpt.pt"),
            )
    return {"train": losses, "val": val_losses}


if __name__ == "__main__":
    main()
    fs.shutdown()
