"""funcshard on one CUDA GPU over NCCL at world size 1 (issue 22).

The CPU suite skips this file (no GPU); `scripts/gpu_check.sh` runs it on a machine with
one. With one GPU there is one NCCL rank: `collectives.communicate_alone()` sends the
collectives of its one-rank groups through NCCL anyway, so that they launch real kernels on
the collective streams (see [Note: collectives on their own streams]). What one GPU cannot
show (NCCL between GPUs, overlap over NVLink) is not tested here.
"""

from __future__ import annotations

import copy
import functools
import gc
import itertools
import json
import os
import tempfile

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.comm import _collectives as collectives
from funcshard.testing.compare import assert_trees_close
from funcshard.testing.harness import ADAMW_EPS
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()),
    reason="needs a CUDA GPU with NCCL: scripts/gpu_check.sh runs this file on the GPU machine",
)

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=128, dropout=0.0)
MESHES = {"FSDP": {"shard": 1}, "HSDP": {"replicate": 1, "shard": 1}, "DDP": {"replicate": 1}}
LR = 1e-3
# the helpers below run on this device: a CPU run of them (FUNCSHARD_GPU_TEST_DEVICE=cpu, on
# gloo) checks the code before GPU time is spent on it
DEVICE = os.environ.get("FUNCSHARD_GPU_TEST_DEVICE", "cuda")
BACKEND = "nccl" if DEVICE == "cuda" else "gloo"


def _on_gpu(fn, *args, fresh=False):
    """`fn(*args, rank)` on one NCCL rank of the worker pool (its own CUDA context); `fresh`:
    in a new process, whose GPU memory holds nothing of earlier tests."""
    call = functools.partial(fn, *args)
    return testing.run(call, world_size=1, backend=BACKEND, timeout=240, fresh=fresh)[0]


def _loss(model, state, x, y):
    logits = fs.call(model, state, x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _plain_steps(model, batches, mp_dtype=None):
    """The reference: one plain process, torch.optim.AdamW (bf16 compute copies of the
    fp32 parameters under mixed precision, gradients applied in fp32)."""
    params = {k: p.detach().clone().requires_grad_() for k, p in model.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=LR, eps=ADAMW_EPS, weight_decay=0.01)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        if mp_dtype is None:
            used = params
        else:
            used = {k: p.detach().to(mp_dtype).requires_grad_() for k, p in params.items()}
        logits = torch.func.functional_call(model, used, (x,))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        if mp_dtype is not None:
            for k, p in params.items():
                p.grad = used[k].grad.float()
        opt.step()
        losses.append(loss.item())
    return losses, {k: p.detach() for k, p in params.items()}


def _sharded_steps(model, batches, mesh, mp=None, offload=False):
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    state = fs.shard(model, plan, mesh, mp=mp, offload=offload)
    opt = fs.optim.adamw(lr=LR, eps=ADAMW_EPS, weight_decay=0.01)
    opt_state = opt.init(state)
    losses = []
    with collectives.record() as log:
        for x, y in batches:
            loss, grads = fs.value_and_grad(lambda s, x, y: _loss(model, s, x, y))(state, x, y)
            updates, opt_state = opt.update(grads, opt_state, state)
            state = fs.apply_updates(state, updates)
            losses.append(loss.item())
    return losses, fs.unshard(state), state, sorted({r.op for r in log})


def _step_parity(mesh_kwargs, mp_name, communicate, rank):
    torch.manual_seed(0)
    model = GPT(CFG).to(DEVICE)
    batches = [tuple(t.to(DEVICE) for t in random_tokens(CFG, 4, seed=step)) for step in range(3)]
    mp_dtype = torch.bfloat16 if mp_name == "bf16" else None
    mp = fs.MixedPrecision(param_dtype=mp_dtype, reduce_dtype=torch.float32) if mp_dtype else None
    with collectives.communicate_alone(communicate):
        losses, params, state, ops = _sharded_steps(model, batches, fs.Mesh(**mesh_kwargs), mp)
    ref_losses, ref_params = _plain_steps(model, batches, mp_dtype)
    tol = 1e-5 if mp is None else 2e-3  # bf16 compute: same kernels, summed in other orders
    assert_trees_close(params, ref_params, rtol=tol, atol=tol / 10)
    assert losses == pytest.approx(ref_losses, rel=tol)
    return ops, [s.device.type for s in state.shards]


@pytest.mark.parametrize("mp_name", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", sorted(MESHES))
def test_step_matches_one_plain_process_on_cuda_with_collectives_through_nccl(layout, mp_name):
    """Three AdamW steps of a GPT on one GPU, every collective through NCCL at world size 1,
    equal plain PyTorch's (fp32 within 1e-5 relative; bf16 compute within 2e-3)."""
    ops, devices = _on_gpu(_step_parity, MESHES[layout], mp_name, True)
    assert set(devices) == {DEVICE}
    assert ops == ["all_gather", "all_reduce", "reduce_scatter"]  # each axis, one rank


def test_step_matches_one_plain_process_on_cuda_without_collectives():
    """The default at world size 1: no collective at all, same numbers."""
    ops, _ = _on_gpu(_step_parity, MESHES["FSDP"], "fp32", False)
    assert ops == []


def _offload_parity(rank):
    torch.manual_seed(0)
    model = GPT(CFG).to(DEVICE)
    batches = [tuple(t.to(DEVICE) for t in random_tokens(CFG, 4, seed=step)) for step in range(3)]
    with collectives.communicate_alone():
        losses, params, state, _ = _sharded_steps(model, batches, fs.Mesh(shard=1), offload=True)
    ref_losses, ref_params = _plain_steps(model, batches)
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    return [s.device.type for s in state.shards]


def test_offloaded_step_matches_one_plain_process():
    """offload=True: shards, gradients and optimizer state in CPU memory (the optimizer
    steps there); the numbers are plain PyTorch's."""
    assert set(_on_gpu(_offload_parity)) == {"cpu"}


def _round_trips(rank):
    @settings(max_examples=20, deadline=None, database=None)
    @given(
        widths=st.lists(st.integers(1, 40), min_size=2, max_size=5),
        communicate=st.booleans(),
        offload=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def shard_then_unshard_is_the_identity(widths, communicate, offload, seed):
        torch.manual_seed(seed)
        model = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths))).to(DEVICE)
        plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
        with collectives.communicate_alone(communicate):
            state = fs.shard(model, plan, fs.Mesh(shard=1), offload=offload)
            full = fs.unshard(state)
        for name, p in model.named_parameters():
            assert full[name].device.type == DEVICE
            assert torch.equal(full[name], p.detach()), name
        for s in state.shards:
            want = ("cpu", DEVICE == "cuda") if offload else (DEVICE, False)
            assert (s.device.type, s.is_pinned()) == want

    shard_then_unshard_is_the_identity()
    return True


def test_shard_and_unshard_round_trip_bitwise_on_cuda():
    assert _on_gpu(_round_trips)


def _kernel_intervals(trace_path):
    """(stream, start, end, name) of every GPU kernel and memcpy in a chrome trace."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out.append((e["args"].get("stream"), e["ts"], e["ts"] + e["dur"], e["name"]))
    return out


def _profiled_steps(out_dir, rank):
    # compute-bound: each block's kernels take longer than the CPU takes to issue them, so
    # the GPU is busy when a collective runs (on a small model it idles, waiting for the CPU)
    cfg = GPTConfig(
        vocab_size=1024, block_size=512, n_layer=6, n_head=16, d_model=2048, dropout=0.0
    )
    torch.manual_seed(0)
    model = GPT(cfg).to(DEVICE)
    x, y = (t.to(DEVICE) for t in random_tokens(cfg, 16, seed=0))
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with collectives.communicate_alone():
        state = fs.shard(model, plan, fs.Mesh(shard=1), mp=mp)
        opt = fs.optim.adamw(lr=LR)
        opt_state = opt.init(state)
        grad_fn = fs.value_and_grad(lambda s: _loss(model, s, x, y))

        def step(state, opt_state):
            _, grads = grad_fn(state)
            return opt.step(grads, opt_state, state)

        state, opt_state = step(state, opt_state)  # warm up: kernels chosen, NCCL set up
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(2):
                state, opt_state = step(state, opt_state)
            torch.cuda.synchronize()
    path = os.path.join(out_dir, "trace.json")
    prof.export_chrome_trace(path)
    compute = torch.cuda.current_stream().stream_id
    return _kernel_intervals(path), compute


def test_collectives_run_on_their_own_streams_overlapping_compute():
    """A profiler trace of two steps: the collectives' GPU work (NCCL's kernels, or its
    copies: at one rank NCCL may copy rather than launch a kernel) runs on streams other than
    the compute stream, and some of it while compute kernels run (the next unit's all-gather
    during this unit's forward, a unit's reduce-scatter during the next one's backward)."""
    out_dir = os.environ.get("FUNCSHARD_GPU_OUT") or tempfile.mkdtemp()
    intervals, _ = _on_gpu(_profiled_steps, out_dir)
    per_stream: dict = {}
    for iv in intervals:
        per_stream.setdefault(iv[0], []).append(iv)
    compute_stream = max(per_stream, key=lambda k: len(per_stream[k]))  # the default stream
    compute = per_stream[compute_stream]
    side = [iv for iv in intervals if iv[0] != compute_stream]
    names = sorted({iv[3][:60] for iv in side})
    overlapping = [n for n in side if any(c[1] < n[2] and n[1] < c[2] for c in compute)]
    summary = (
        f"{len(compute)} kernels on the compute stream {compute_stream}; {len(side)} on streams "
        f"{sorted(set(per_stream) - {compute_stream})}: {names[:12]}; {len(overlapping)} of "
        f"them overlap a compute kernel"
    )
    print(summary)
    assert any("nccl" in iv[3].lower() for iv in intervals) or side, summary
    assert not any("nccl" in c[3].lower() for c in compute), summary
    assert overlapping, summary


def _peaks(rank):
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.common import fsdp2_step, plain_step, sharded_step

    cfg = GPTConfig(vocab_size=8192, block_size=256, n_layer=8, n_head=8, d_model=512, dropout=0.0)
    x, y = (t.to(DEVICE) for t in random_tokens(cfg, 8, seed=0))
    torch.manual_seed(0)

    def peak(build):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step = build()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    model = GPT(cfg)
    plain_step(copy.deepcopy(model).to(DEVICE), x, y)()  # once-per-process CUDA allocations
    ours = peak(lambda: sharded_step(lambda: GPT(cfg), Block, fs.Mesh(shard=1), x, y))
    theirs = peak(
        lambda: fsdp2_step(copy.deepcopy(model).to(DEVICE), init_device_mesh("cuda", (1,)), x, y)
    )
    with torch.device("meta"):
        meta = GPT(cfg)
    plan = fs.plan(meta, policy=fs.policy.module_classes({Block}))
    options = dict(device="cuda", donate=True, loop=False)  # as sharded_step runs
    without = fs.estimate(plan, fs.Mesh(shard=1), **options)
    step = dict(model=meta, loss_fn=functools.partial(_loss, meta), args=(x.cpu(), y.cpu()))
    planned = fs.estimate(plan, fs.Mesh(shard=1), **options, **step)
    return ours, theirs, without.peak, planned.peak


def test_peak_memory_is_at_most_fsdp2s_and_near_the_estimate():
    """The step's peak (torch.cuda.max_memory_allocated) is at most FSDP2's, and within 5%
    of funcshard.estimate's dry run of the same step (activations counted)."""
    ours, theirs, without, planned = _on_gpu(_peaks)
    print(
        f"peak: funcshard {ours / 2**20:.1f} MiB, FSDP2 {theirs / 2**20:.1f} MiB; estimate "
        f"{planned / 2**20:.1f} MiB ({without / 2**20:.1f} MiB without activations)"
    )
    assert ours <= theirs
    assert abs(planned - ours) <= 0.05 * ours


def _offload_under_budget(budget_gib, rank):
    torch.set_num_threads(os.cpu_count() or 1)  # the optimizer steps on the CPU here
    torch.manual_seed(0)
    width, depth = 4096, 24  # 403M parameters: 1.6 GB, 6.4 GB with gradients and AdamW state
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))
    plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
    gc.collect()
    torch.cuda.empty_cache()  # earlier tests' cached blocks count against the budget
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(budget_gib * 2**30 / total)
    try:
        try:
            fs.shard(model, plan, fs.Mesh(shard=1))
            fits = True
        except torch.OutOfMemoryError:
            fits = False
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        state = fs.shard(model, plan, fs.Mesh(shard=1), offload=True)
        opt = fs.optim.adamw(lr=1e-4)
        opt_state = opt.init(state)
        x = torch.randn(16, width, device=DEVICE)

        def loss(s):
            return fs.call(model, s, x).square().mean()

        losses = []
        for _ in range(2):
            value, grads = fs.value_and_grad(loss)(state)
            state, opt_state = opt.step(grads, opt_state, state)
            losses.append(value.item())
        peak = torch.cuda.max_memory_allocated()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return fits, losses, peak, state.shards[0].device.type, opt_state_devices(opt_state)


def opt_state_devices(opt_state):
    return sorted(
        {
            leaf.device.type
            for leaf in optree.tree_leaves(opt_state)
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
        }
    )


def test_offload_trains_a_model_larger_than_the_gpu_memory_budget():
    """A 403M-parameter model (6.4 GB to train with AdamW) under a 1 GiB budget: it does
    not fit unsharded, and trains with offload=True, the optimizer stepping on the CPU."""
    fits, losses, peak, shard_device, state_devices = _on_gpu(
        _offload_under_budget, 1.0, fresh=True
    )
    print(
        f"offload: peak GPU memory {peak / 2**20:.0f} MiB under a 1024 MiB budget; losses {losses}"
    )
    assert not fits
    assert shard_device == "cpu" and state_devices == ["cpu"]
    assert peak <= 2**30 and all(torch.isfinite(torch.tensor(losses)))
