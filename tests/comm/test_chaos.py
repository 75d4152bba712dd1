"""Collective order is a function of the program, never of timing (see [Note: chaos]).

Each rank runs a gradient step (forward, backward, reduce; with accumulation, two micro-
batches) of many configurations under chaos (seeded per-rank delays and garbage collections
wherever funcshard communicates or runs a hook), with every collective compared across ranks
before it is issued (`check_collectives`): a mismatch raises there. Each rank must also issue
the same sequence as without chaos, and get bitwise the same gradients.

[Note: chaos collects only the task's objects]
A chaos point's `gc.collect()` is there to free what funcshard made (buffers, bookkeeping,
graphs) at a different moment on each rank. A worker also holds the 300k objects of torch
and of earlier tasks, and a full collection over them took 0.3-1 s: six or so per
configuration and rank were most of this test's time. The rank task runs inside
`only_new_objects()` (a freeze): objects alive before it move to the collector's
permanent generation, which a collection skips, while everything the steps make is still
collected at each chaos point.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import funcshard as fs
from funcshard import testing
from funcshard.comm import _collectives as collectives
from funcshard.testing.collector import only_new_objects
from funcshard.testing.models import GPT, Block, GPTConfig, frozen_embedding_gpt, random_tokens

STEPS = 1  # gradient steps per configuration: a second adds time, not coverage
BLOCKS = fs.policy.module_classes({Block})
WITH_EMBEDDINGS = fs.policy.module_classes({Block, torch.nn.Embedding})


class _CheckpointedGPT(GPT):
    """A GPT whose blocks torch.utils.checkpoint recomputes in backward."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x)) * self.cfg.d_model**-0.5


def _loss(model, state, x, y):
    logits = fs.call(model, state, x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


# name -> (mesh axes, model, shard() options, value_and_grad options, micro-batches)
CONFIGS = {
    2: {
        "fsdp": ({"shard": 2}, GPT, {}, {}, 1),
        "fsdp, no prefetch": ({"shard": 2}, GPT, {}, {"prefetch": False}, 1),
        "fsdp bf16, kept gathered": (
            {"shard": 2},
            GPT,
            {
                "mp": fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                "reshard_after_forward": False,
            },
            {},
            1,
        ),
        "ddp": ({"replicate": 2}, GPT, {}, {}, 1),
        "frozen unit": ({"shard": 2}, frozen_embedding_gpt, {"policy": WITH_EMBEDDINGS}, {}, 1),
        "checkpointed": ({"shard": 2}, _CheckpointedGPT, {}, {}, 1),
        "accumulated": ({"shard": 2}, GPT, {}, {}, 2),
    },
    4: {
        "hsdp 2x2": ({"replicate": 2, "shard": 2}, GPT, {}, {}, 1),
        "fsdp 4, reshard to 2": ({"shard": 4}, GPT, {"reshard_after_forward": 2}, {}, 1),
        "hsdp checkpointed, accumulated": (
            {"replicate": 2, "shard": 2},
            _CheckpointedGPT,
            {},
            {},
            2,
        ),
    },
}


def _steps(name: str, world_size: int, rank: int) -> tuple[list, list[torch.Tensor]]:
    """Gradient steps of one configuration: the collectives issued and the last grads."""
    axes, make_model, options, grad_options, micro = CONFIGS[world_size][name]
    options = dict(options)
    policy = options.pop("policy", BLOCKS)
    torch.manual_seed(0)
    model = make_model(GPTConfig(n_layer=3))  # 3: a backward prefetch to decide
    mesh = fs.Mesh(**axes, check_collectives=True)
    state = fs.shard(model, fs.plan(model, policy=policy), mesh, **options)
    grad_fn = fs.value_and_grad(functools.partial(_loss, model), **grad_options)
    with collectives.record() as log:
        for step in range(STEPS):
            grads = None
            for m in range(micro):
                x, y = random_tokens(model.cfg, 2, seed=100 * step + 10 * m + rank)
                g = grad_fn(state, x, y)[1]
                grads = g if grads is None else fs.accumulate(grads, g)
    issued = [(r.op, len(r.ranks), r.numel, r.dtype) for r in log]
    return issued, [s.clone() for s in grads.shards if s is not None]  # None: frozen


def _under_chaos(world_size: int, seed: int, rank: int) -> dict:
    with only_new_objects():  # see [Note: chaos collects only the task's objects]
        return _calm_and_chaotic(world_size, seed, rank)


def _calm_and_chaotic(world_size: int, seed: int, rank: int) -> dict:
    results = {}
    for name in CONFIGS[world_size]:
        calm = _steps(name, world_size, rank)
        with testing.chaos(seed, gc_chance=0.03, delay_chance=0.5, max_delay=0.004) as chaos:
            issued, grads = _steps(name, world_size, rank)
        same = all(torch.equal(a, b) for a, b in zip(calm[1], grads, strict=True))
        results[name] = (issued, issued == calm[0], same, chaos.points)
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_issues_the_same_collectives_whatever_the_timing(world_size):
    results = testing.run(
        functools.partial(_under_chaos, world_size, 1234), world_size=world_size, timeout=200
    )
    for name in CONFIGS[world_size]:
        sequences = [r[name][0] for r in results]
        assert len(sequences[0]) > 0, name
        assert all(s == sequences[0] for s in sequences), name
        for rank, r in enumerate(results):
            _, as_without_chaos, same_grads, points = r[name]
            assert points > 10, (name, rank, points)  # chaos was on
            assert as_without_chaos, (name, rank)
            assert same_grads, (name, rank)
