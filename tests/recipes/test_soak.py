"""No leaks over a long run: 200 steps of the demo's training loop on 2 ranks.

The demo's loop (its loss, batches, optimizer chain and donation) on a smaller GPT than the
demo's (2 blocks of d 32 over 16 tokens, not 4 of d 128 over 64): a leak is a tensor or an
object left behind per step or per unit, whatever the units' sizes, and the smaller model
makes each of the 200 steps cheaper, not fewer.

The rank task runs inside `only_new_objects()` (a freeze), as tests/step/test_memory.py's
[Note: walking only the task's objects] says: the collections (the two asked for, and those
the interpreter runs by itself over 200 steps) and the object count skip the 300k objects a
worker already holds; a leak is made by the steps, after the freeze, so it is still counted,
and growth (late minus early) is what is asserted. Live bytes are read settled
(`LiveTensors.settled`, [Note: a finished collective's tensors outlive its wait]): read at
once, gloo's worker thread sometimes still held the global norm's 4-byte buffer, and
the two readings differed by 4 bytes without a leak."""

import functools
import gc

import pytest
import torch

import funcshard as fs
from funcshard import testing
from funcshard.cli import _demo as demo
from funcshard.testing.collector import only_new_objects
from funcshard.testing.memory import LiveTensors
from funcshard.testing.models import GPT, Block

# Live bytes must be equal at steps 10 and STEPS: any tensor leaked in the 190 steps between
# fails. Python objects (gc-tracked): a leak of one every 4 steps adds 47 > OBJECTS (400
# steps with a bound of 100 let 97 through; a list leaked every 4 steps fails 47 < 40); a
# healthy run's growth measured 0 on both ranks.
STEPS = 200
OBJECTS = 40


def _soak(rank: int) -> dict:
    with only_new_objects():
        return _steps(rank)


def _steps(rank: int) -> dict:
    cfg = demo.DemoConfig(batch=2, block_size=16, d_model=32, n_layer=2)  # 2 units and the root
    data = torch.randint(256, (100_000,), generator=torch.Generator().manual_seed(0))
    mesh = fs.Mesh(shard=2)
    with torch.device("meta"):
        model = GPT(demo.model_config(cfg))
    state = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), mesh)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(cfg.lr))
    opt_state = opt.init(state)
    grad_fn = fs.value_and_grad(functools.partial(demo.lm_loss, model))
    seen = {}
    with LiveTensors() as memory:
        memory.adopt((state, opt_state))
        for step in range(1, STEPS + 1):
            x, y = demo.batches(data, cfg, step, cfg.batch * 2)
            x, y = x.chunk(2)[rank], y.chunk(2)[rank]
            loss, grads = grad_fn(state, x, y)
            updates, opt_state = opt.update(grads, opt_state, state, donate=True)
            state = fs.apply_updates(state, updates, donate=True)
            del grads, updates
            if step in (10, STEPS):  # settled: the last all-reduce's buffer let go (a Note)
                seen[step] = {"live": memory.settled(), "objects": len(gc.get_objects())}
    return {"seen": seen, "loss": loss.item()}


@pytest.mark.timeout(900)
def test_hundreds_of_steps_keep_live_tensor_bytes_flat_and_python_objects_bounded():
    for result in testing.run(_soak, timeout=900):
        early, late = result["seen"][10], result["seen"][STEPS]
        assert late["live"] == early["live"], (early, late)
        assert late["objects"] - early["objects"] < OBJECTS, (early, late)
