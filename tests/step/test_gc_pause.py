"""`value_and_grad` pauses Python's garbage collector for its step (funcshard/step/_gc_pause.py)."""

import contextlib
import gc

import torch

import funcshard as fs
from funcshard import testing
from funcshard.testing.models import MLPBlock, MLPStack, MLPStackConfig

D = 16


def _collector_during_a_step(rank: int) -> dict:
    """Whether the garbage collector is enabled in the forward and the backward of a
    resharding step, after it, after a step that raised, and when the caller disabled it."""
    torch.manual_seed(0)
    model = MLPStack(MLPStackConfig(d_model=D, n_layer=4))
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({MLPBlock})), fs.Mesh(shard=2)
    )
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(rank))
    seen = []

    def loss(s: fs.ShardedState) -> torch.Tensor:
        out = fs.call(model, s, x)
        seen.append(("forward", gc.isenabled()))
        out.register_hook(lambda g: seen.append(("backward", gc.isenabled())))
        for shard in s.shards:  # their gradients come last: the end of backward
            shard.register_hook(lambda g: seen.append(("end of backward", gc.isenabled())))
        return out.square().mean()

    grad_fn = fs.value_and_grad(loss)
    try:
        grad_fn(state)
        after = gc.isenabled()
        with contextlib.suppress(ZeroDivisionError):
            fs.value_and_grad(lambda s: 1 / 0)(state)
        after_error = gc.isenabled()
        gc.disable()  # the caller's own choice is kept
        grad_fn(state)
        kept_disabled = not gc.isenabled()
    finally:
        gc.enable()
    return {
        "inside": sorted(set(seen[: len(seen) // 2])),
        "after": (after, after_error, kept_disabled),
    }


def test_the_collector_is_paused_through_forward_and_backward_and_restored():
    """The Python objects of a resharded call's saved tensors live from forward to backward,
    so the collector is paused meanwhile (see [Note: no garbage collection inside a step])."""
    for result in testing.run(_collector_during_a_step):
        assert result["inside"] == [
            ("backward", False),
            ("end of backward", False),
            ("forward", False),
        ], result
        assert result["after"] == (True, True, True), result
