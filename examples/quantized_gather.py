"""An int8 blockwise quantized weight all-gather (DeepSpeed ZeRO++'s "qwZ") as a user function.

Each rank quantizes its shard in blocks of 256 (int8 codes, one fp32 scale, absmax / 127,
per block), all-gathers codes and scales, and dequantizes: (1 + 4/256) bytes a weight on the
wire against bf16's 2, 0.51x. The master weights stay fp32 and are never quantized; only the
gathered copy the model computes with is, each weight within half a step (absmax / 254) of
its true value. Its gradient is the straight-through one: funcshard's gather op differentiates
as if the gather were exact, so backward reduces the gradient taken at the dequantized weights
(tests/comm/test_comm.py checks fs.grad, torch.autograd.grad and torch.func.grad against one plain
process on those weights).

    python examples/quantized_gather.py [--quick] [--nproc 2] [--steps 200]

Trains the demo's character-level GPT twice on 2 local ranks, with bf16 gathers (the
default, under mixed precision) and with int8 gathers, and prints the bytes all-gathered per
step (counted from the collectives) and the two loss curves.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard.cli import demo
from funcshard.comm import bytes_sent, record
from funcshard.testing.models import GPT, Block

BLOCK = 256  # weights per scale: 4 bytes of scale per 256 bytes of codes


def q8_gather(shard: torch.Tensor, axis: fs.MeshAxis) -> torch.Tensor:
    """int8 blockwise: quantize this rank's shard, all-gather codes and scales, dequantize."""
    blocks = F.pad(shard.float(), (0, -shard.numel() % BLOCK)).view(-1, BLOCK)
    scale = blocks.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127  # (blocks, 1)
    codes = torch.round(blocks / scale).to(torch.int8)  # (blocks, BLOCK)
    codes, scale = axis.all_gather(codes), axis.all_gather(scale)  # every rank's, in order
    full = (codes.float() * scale).view(axis.size, -1)[:, : shard.numel()]
    return full.reshape(-1)  # (axis.size * shard.numel(),)


Q8 = fs.Comm(gather=q8_gather)


def train(steps: int, quick: bool, comm: fs.Comm | None, rank: int) -> dict:
    """The demo model, bf16 compute, AdamW; this rank's part of each global batch."""
    nproc = 2
    cfg = demo.DemoConfig(nproc=nproc, steps=steps, mp="bf16", plot=None)
    if quick:
        cfg = demo.DemoConfig(nproc=nproc, steps=steps, d_model=64, n_layer=2, block_size=32)
    data = torch.frombuffer(bytearray(demo.stdlib_text()), dtype=torch.uint8).long()
    mesh = fs.Mesh(shard=nproc)
    with torch.device("meta"):
        model = GPT(demo.model_config(cfg))
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    state = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), mesh, mp=mp)
    opt = fs.optim.adamw(cfg.lr, weight_decay=0.01)
    opt_state = opt.init(state)
    grad_fn = fs.value_and_grad(functools.partial(demo.lm_loss, model), comm=comm)  # None or Q8
    losses, gathered = [], []
    for step in range(steps):
        x, y = demo.batches(data, cfg, step, cfg.batch * nproc)
        x, y = x.chunk(nproc)[rank], y.chunk(nproc)[rank]
        with record() as log:
            loss, grads = grad_fn(state, x, y)
        gathered.append(bytes_sent([r for r in log if r.op == "all_gather"]))
        state, opt_state = opt.step(grads, opt_state, state)
        losses.append(loss)
    return {"losses": fs.pmean(torch.stack(losses), mesh).tolist(), "gathered": gathered[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 20 steps")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (20 if args.quick else 200)
    default = fs.testing.run(functools.partial(train, steps, args.quick, None), 2)[0]
    q8 = fs.testing.run(functools.partial(train, steps, args.quick, Q8), 2)[0]
    ratio = q8["gathered"] / default["gathered"]
    print(
        f"bytes all-gathered per step and rank: bf16 {default['gathered']:,}, "
        f"int8 {q8['gathered']:,} ({ratio:.3f}x)"
    )
    print("step  loss bf16  loss int8")
    for i in sorted({*range(0, steps, max(1, steps // 10)), steps - 1}):
        print(f"{i:4d}  {default['losses'][i]:9.4f}  {q8['losses'][i]:9.4f}")
    gap = max(abs(a - b) / a for a, b in zip(default["losses"], q8["losses"], strict=True))
    print(f"largest relative loss gap: {gap:.2%}")


if __name__ == "__main__":
    main()
