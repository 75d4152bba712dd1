"""`funcshard.step._gather`: what a gather's backward makes before it reduces, and what it writes.

A DDP bucket's all-reduce runs in place in the flat gradient (see [Note: reducing in place]);
a bucket's gradients are cast to the reduce dtype as they are concatenated. Multi-rank
examples run through `funcshard.testing.run` on gloo.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.step import _gather as gather
from funcshard.step._gather_spec import specs_and_sinks
from funcshard.testing.memory import LiveTensors


class _AddBiases(nn.Module):
    """`a + bias + bias2`, both biases the shape of `a`: autograd hands the three inputs one
    and the same gradient tensor (AddBackward passes its gradient through)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-1, 1, 8).reshape(2, 4))
        self.bias2 = nn.Parameter(torch.linspace(1, -1, 8).reshape(2, 4))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a + self.bias + self.bias2


class _SharedGradient(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.add = _AddBiases()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.add(self.lin(x)) ** 2).sum()


def _inputs() -> list[torch.Tensor]:
    return [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]


def _shared_gradient_errors(rank: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = _SharedGradient()
    mean: dict[str, torch.Tensor] = {}
    for x in _inputs():  # one process: the mean of the ranks' gradients
        model.zero_grad()
        model(x).backward()
        for name, p in model.named_parameters():
            mean[name] = mean.get(name, 0) + p.grad / 2
    # a bucket per parameter: the biases' buckets each hold the one shared gradient tensor
    state = fs.replicate(model, fs.Mesh(replicate=2), bucket_mb=1e-6, first_bucket_mb=1e-6)
    assert all(len(flat.fqns) == 1 for flat in state.layout.flats)
    grad_fn = fs.grad(lambda s, x: fs.call(model, s, x))
    errors: dict[str, float] = {}
    for _ in range(3):  # the corruption raced the rest of backward: try it more than once
        got = dict(zip(state.layout.flats, grad_fn(state, _inputs()[rank]).shards, strict=True))
        for flat, g in got.items():
            name = flat.fqns[0]
            err = (g.view(flat.shapes[0]) - mean[name]).abs().max().item()
            errors[name] = max(errors.get(name, 0.0), err)
    return errors


def test_a_ddp_bucket_never_reduces_in_place_a_gradient_autograd_also_hands_elsewhere():
    """A bucket of one parameter, whose incoming gradient autograd also handed to the layer
    below (`a + bias`), was all-reduced in place in that very tensor: the layer below read
    the rank-averaged values (lin.weight off by ~1, every run after the first)."""
    for errors in testing.run(_shared_gradient_errors, world_size=2):
        assert max(errors.values()) < 1e-5, errors


def _peak_over_params(model: nn.Module, comm_dtype: torch.dtype | None, rank: int) -> float:
    """Peak live bytes of one gradient of a replicated `model` (its state counted), in units
    of its parameters' bytes."""
    state = fs.replicate(model, fs.Mesh(replicate=2), comm_dtype=comm_dtype)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(rank))
    grad_fn = fs.grad(lambda s: fs.call(model, s, x).square().sum())
    with LiveTensors() as memory:
        memory.adopt(state)
        grads = grad_fn(state)
    del grads
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return memory.peak / params


def test_a_lone_gradient_nothing_else_holds_is_still_reduced_in_place():
    """The guard above copies only gradients autograd shares: a weight's own gradient (made
    by a matmul) is all-reduced in place, with no second buffer: params + one gradient."""
    torch.manual_seed(0)
    model = nn.Linear(256, 256, bias=False)  # one bucket of one parameter
    peaks = testing.run(functools.partial(_peak_over_params, model, None), world_size=2)
    assert max(peaks) < 2.1, peaks  # a copy would make it 3


def test_a_compressed_reduce_casts_while_concatenating():
    """With comm_dtype=bf16, a bucket's fp32 gradients were concatenated into an fp32 flat
    and then cast: backward held the pieces, the fp32 flat and its bf16 copy at once (3.5x
    the parameters with them). Now the pieces go straight into the bf16 flat; the peak is
    where the reduced bf16 gradient comes back as fp32 (params + 0.5 + 1)."""
    torch.manual_seed(0)
    model = nn.Linear(256, 256)  # one bucket of two parameters: concatenated
    peaks = testing.run(functools.partial(_peak_over_params, model, torch.bfloat16), world_size=2)
    assert max(peaks) < 2.6, peaks


def _concat_against_cat_then_cast(rank: int) -> list[bool]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7))
    out = []
    for reduce in (torch.bfloat16, torch.float16):
        state = fs.replicate(model, fs.Mesh(replicate=1), comm_dtype=reduce, bucket_mb=1e3)
        specs, _ = specs_and_sinks(state)
        for spec in specs:
            g = torch.Generator().manual_seed(1)
            grads = tuple(
                torch.randn(s, generator=g) * 10.0 ** torch.randint(-8, 6, s, generator=g)
                for s in spec.flat.shapes
            )
            with torch.no_grad():
                fused = gather._concat(grads, spec)
            reference = torch.cat([t.reshape(-1) for t in grads]).to(reduce)
            out.append(fused.dtype == reduce and torch.equal(fused, reference))
    return out


def test_casting_while_concatenating_equals_concatenating_then_casting():
    (results,) = testing.run(_concat_against_cat_then_cast, world_size=1)
    assert results and all(results)
