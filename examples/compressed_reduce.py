"""A 4-bit compressed gradient reduce with error feedback, as a user function.

Each rank adds its residual (what compression dropped so far) to its full gradient, splits
it into one chunk per rank, quantizes each chunk to 4 bits in blocks of 128 (two codes a byte,
one fp32 scale a block), sends chunk j to rank j (an all-to-all: what a reduce-scatter
sends), and averages the chunks it receives, dequantized. The new residual is what this
step's quantization dropped, sent with the next step's gradient (error feedback, as in
1-bit Adam and EF-SGD: over the run every rank sends the sum of its gradients, up to the last
residual). On the wire: (1/2 + 4/128) bytes a gradient element against bf16's 2, 0.27x.

The residual is state the caller threads, as optimizer state (`carry=` in, the new carry
out): one full-size fp32 buffer per flat buffer, 4 bytes per parameter of the whole model on
every rank, the size of DDP's gradient buffer.

    python examples/compressed_reduce.py [--quick] [--steps 200] [--plot compressed_reduce.png]

Trains the demo's character-level GPT on 2 local ranks with a bf16 reduce-scatter (the
default, `reduce_dtype=bf16`) and with the 4-bit reduce, prints the bytes reduced per step
(counted from the collectives) and the loss curves, and plots them.
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

BLOCK = 128  # gradient elements per fp32 scale


def ef4_reduce(full: torch.Tensor, axis: fs.MeshAxis, residual: torch.Tensor):
    """4-bit blockwise reduce-scatter with error feedback: (this rank's mean chunk, residual)."""
    x = full + residual
    chunks = x.view(axis.size, -1)  # chunk j goes to rank j
    n = chunks.shape[1]
    blocks = F.pad(chunks, (0, -n % BLOCK)).view(axis.size, -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 7  # codes in [-7, 7]
    codes = torch.round(blocks / scale).clamp(-7, 7)
    sent = (codes * scale).view(axis.size, -1)[:, :n].reshape(-1)  # what the others decode
    packed = ((codes[..., 0::2] + 8) * 16 + codes[..., 1::2] + 8).to(torch.uint8)
    packed, scale = axis.all_to_all(packed), axis.all_to_all(scale)  # every rank's chunk r
    high, low = packed.div(16, rounding_mode="floor"), packed.remainder(16)
    got = torch.stack((high, low), -1).view(axis.size, -1, BLOCK).float() - 8
    mean = (got * scale).view(axis.size, -1)[:, :n].mean(0)  # (n,)
    return mean, x - sent


EF4 = fs.Comm(reduce=ef4_reduce)


def train(steps: int, quick: bool, comm: fs.Comm | None, rank: int) -> dict:
    """The demo model, AdamW; `comm=None` reduces in bf16 (the default's compression)."""
    nproc = 2
    cfg = demo.DemoConfig(nproc=nproc, steps=steps, plot=None)
    if quick:
        cfg = demo.DemoConfig(nproc=nproc, steps=steps, d_model=64, n_layer=2, block_size=32)
    data = torch.frombuffer(bytearray(demo.stdlib_text()), dtype=torch.uint8).long()
    mesh = fs.Mesh(shard=nproc)
    with torch.device("meta"):
        model = GPT(demo.model_config(cfg))
    mp = None if comm else fs.MixedPrecision(reduce_dtype=torch.bfloat16)
    state = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), mesh, mp=mp)
    opt = fs.optim.adamw(cfg.lr, weight_decay=0.01)
    opt_state = opt.init(state)
    loss_fn = functools.partial(demo.lm_loss, model)
    residual = fs.carry_zeros(state) if comm else None
    losses, reduced = [], []
    for step in range(steps):
        x, y = demo.batches(data, cfg, step, cfg.batch * nproc)
        x, y = x.chunk(nproc)[rank], y.chunk(nproc)[rank]
        with record() as log:
            if comm:
                grad_fn = fs.value_and_grad(loss_fn, comm=comm, carry=residual)
                loss, grads, residual = grad_fn(state, x, y)  # the residual threaded
            else:
                loss, grads = fs.value_and_grad(loss_fn)(state, x, y)
        reduced.append(bytes_sent([r for r in log if r.op != "all_gather"]))
        state, opt_state = opt.step(grads, opt_state, state)
        losses.append(loss)
    residual_bytes = sum(r.numel() * r.element_size() for r in residual or () if r is not None)
    return {
        "losses": fs.pmean(torch.stack(losses), mesh).tolist(),
        "reduced": reduced[-1],
        "residual_bytes": residual_bytes,
        "shard_bytes": sum(s.numel() * s.element_size() for s in state.shards),
    }


def plot(curves: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, losses in curves.items():
        ax.plot(losses, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("demo GPT, 2 ranks: bf16 reduce vs 4-bit reduce with error feedback")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 20 steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--plot", default=None, help="write the loss curves here (png)")
    args = parser.parse_args()
    steps = args.steps or (20 if args.quick else 200)
    default = fs.testing.run(functools.partial(train, steps, args.quick, None), 2)[0]
    ef = fs.testing.run(functools.partial(train, steps, args.quick, EF4), 2)[0]
    ratio = ef["reduced"] / default["reduced"]
    print(
        f"bytes reduced per step and rank: bf16 {default['reduced']:,}, "
        f"4-bit {ef['reduced']:,} ({ratio:.3f}x)"
    )
    print(
        f"residual held per rank: {ef['residual_bytes']:,} bytes "
        f"(the rank's fp32 shards: {ef['shard_bytes']:,})"
    )
    print("step  loss bf16  loss 4-bit+EF")
    for i in sorted({*range(0, steps, max(1, steps // 10)), steps - 1}):
        print(f"{i:4d}  {default['losses'][i]:9.4f}  {ef['losses'][i]:9.4f}")
    tail = max(1, steps // 10)  # the last tenth of the run, averaged: one step's noise aside
    a, b = (sum(r["losses"][-tail:]) / tail for r in (default, ef))
    print(
        f"final loss (mean of the last {tail} steps): bf16 {a:.4f}, 4-bit+EF {b:.4f} "
        f"({(b - a) / a:+.2%})"
    )
    if args.plot:
        plot({"bf16 reduce": default["losses"], "4-bit + error feedback": ef["losses"]}, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
