"""DiLoCo (local SGD with an outer Nesterov step) on a 2x2 HSDP mesh, in user code.

Each replica group (2 ranks sharding one copy of the model) takes H inner AdamW steps alone:
`fs.value_and_grad(..., all_reduce=False)` reduce-scatters within the group and never
all-reduces across replicas. Every H steps the groups average their parameter deltas since
the last outer step (`fs.pmean(..., axis="replicate")`, one all-reduce across replicas) and
apply them with an outer Nesterov SGD from `fs.optim` (Douillard et al., 2023). Cross-replica
traffic drops H-fold; the price is the anchor (a second copy of the shards) and the outer
momentum (a third).

    python examples/diloco.py [--quick] [--steps 200] [--inner-steps 8]

Trains the demo's character-level GPT on 4 local ranks, plain HSDP and DiLoCo, and prints
the bytes sent across replicas per step (counted from the collectives: DiLoCo's only on
every H-th step) and the two loss curves. With H=1, an inner SGD and an outer SGD with lr 1
and no momentum, DiLoCo is plain HSDP SGD (`parity`, run by tests/comm/test_comm.py).
"""

from __future__ import annotations

import argparse
import functools

import torch

import funcshard as fs
from funcshard.cli import demo
from funcshard.comm import bytes_sent, record
from funcshard.testing.models import GPT, Block


def diloco(loss_fn, state, batches, inner, outer, inner_steps: int):
    """Yield (loss, state) per step: `inner_steps` steps per replica group alone, then an
    outer step on the replicas' mean delta."""
    mesh = state.layout.mesh
    anchor, inner_state, outer_state = state, inner.init(state), outer.init(state)
    for step, (x, y) in enumerate(batches):
        loss, grads = fs.value_and_grad(loss_fn, all_reduce=False)(state, x, y)
        updates, inner_state = inner.update(grads, inner_state, state)
        state = fs.apply_updates(state, updates)
        if (step + 1) % inner_steps == 0:  # the outer step: the only talk across replicas
            delta = fs.pmean(fs.optim.difference(anchor, state), mesh, axis="replicate")
            updates, outer_state = outer.update(delta, outer_state, anchor)
            state = anchor = fs.apply_updates(anchor, updates)
        yield loss, state


def plain(loss_fn, state, batches, opt):
    """Yield (loss, state) per step of plain HSDP training."""
    opt_state = opt.init(state)
    for x, y in batches:
        loss, grads = fs.value_and_grad(loss_fn)(state, x, y)
        updates, opt_state = opt.update(grads, opt_state, state)
        state = fs.apply_updates(state, updates)
        yield loss, state


def _setup(quick: bool, steps: int, rank: int):
    nproc = 4
    cfg = demo.DemoConfig(nproc=nproc, steps=steps, batch=4, plot=None)
    if quick:
        cfg = demo.DemoConfig(
            nproc=nproc, steps=steps, batch=4, d_model=32, n_layer=2, block_size=32
        )
    data = torch.frombuffer(bytearray(demo.stdlib_text()), dtype=torch.uint8).long()
    mesh = fs.Mesh(replicate=2, shard=2)
    with torch.device("meta"):
        model = GPT(demo.model_config(cfg))
    state = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), mesh)
    batches = (
        tuple(t.chunk(nproc)[rank] for t in demo.batches(data, cfg, step, cfg.batch * nproc))
        for step in range(steps)
    )
    return functools.partial(demo.lm_loss, model), state, batches, cfg


def parity(rank: int, steps: int = 4) -> dict:
    """H=1, inner SGD, outer SGD lr 1 without momentum, against plain HSDP SGD."""
    loss_fn, state, batches, _ = _setup(True, steps, rank)
    batches = list(batches)
    sgd, unit = fs.optim.sgd(0.1), fs.optim.sgd(1.0)
    *_, (_, local) = diloco(loss_fn, state, batches, sgd, unit, inner_steps=1)
    *_, (_, every) = plain(loss_fn, state, batches, sgd)
    return {"diloco": local.shards, "plain": every.shards}


def train(steps: int, inner_steps: int, quick: bool, rank: int) -> dict:
    loss_fn, state, batches, cfg = _setup(quick, steps, rank)
    inner = fs.optim.adamw(cfg.lr, weight_decay=0.01)
    outer = fs.optim.sgd(0.7, momentum=0.9, nesterov=True)
    batches = list(batches)  # the same batches for both runs
    runs = {
        "plain": plain(loss_fn, state, iter(batches), inner),
        "diloco": diloco(loss_fn, state, iter(batches), inner, outer, inner_steps),
    }
    shard = state.layout.mesh.shard
    out = {}
    for name, run in runs.items():
        losses, across = [], []
        for _ in range(steps):
            with record() as log:
                loss, _ = next(run)
            # a collective across replicas: its ranks are in more than one replica group
            crossing = [r for r in log if len({g // shard for g in r.ranks}) > 1]
            across.append(bytes_sent(crossing))
            losses.append(loss)
        out[name] = {
            "losses": fs.pmean(torch.stack(losses), state.layout.mesh).tolist(),
            "across": across,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 24 steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--inner-steps", type=int, default=8, help="H")
    args = parser.parse_args()
    steps = args.steps or (24 if args.quick else 200)
    h = args.inner_steps
    r = fs.testing.run(functools.partial(train, steps, h, args.quick), 4, timeout=600)[0]
    p, d = r["plain"], r["diloco"]
    print(f"bytes sent across replicas per step and rank, steps 1-{min(steps, 2 * h)}:")
    print(f"  plain HSDP: {p['across'][: 2 * h]}")
    print(f"  DiLoCo H={h}: {d['across'][: 2 * h]}")
    outer = [i + 1 for i, b in enumerate(d["across"]) if b]
    print(f"DiLoCo steps that talked across replicas: {outer}")
    print(
        f"total across replicas: plain {sum(p['across']):,}, DiLoCo {sum(d['across']):,} "
        f"({sum(d['across']) / sum(p['across']):.3f}x)"
    )
    print("step  loss plain  loss DiLoCo")
    for i in sorted({*range(0, steps, max(1, steps // 10)), steps - 1}):
        print(f"{i:4d}  {p['losses'][i]:10.4f}  {d['losses'][i]:11.4f}")


if __name__ == "__main__":
    main()
