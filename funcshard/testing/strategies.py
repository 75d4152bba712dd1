"""Hypothesis strategies for sharding tests: parameter pytrees, module trees, mesh shapes.

Everything drawn is small and picklable, so a test draws an example once in the parent and
sends it to every rank (`testing.run(functools.partial(check, example))`): ranks that drew
their own examples would disagree and hang in a collective. Tensor values come from a drawn
seed through a `torch.Generator`, never zeros.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor, nn

from funcshard.comm._mesh import Mesh
from funcshard.core import _policy as policy

DTYPES = (torch.float32, torch.bfloat16)

# Sizes that stress padding: 0-d, fewer elements than ranks, primes, and round numbers.
_DIM = st.sampled_from([1, 2, 3, 5, 7, 8, 13, 16])
SHAPES = st.one_of(
    st.just(()),
    st.tuples(_DIM),
    st.tuples(_DIM, _DIM),
    st.tuples(st.sampled_from([1, 2]), _DIM, st.sampled_from([3, 5])),
)


@st.composite
def pytrees(
    draw: st.DrawFn, min_leaves: int = 1, max_leaves: int = 6, dtypes: tuple = DTYPES
) -> dict[str, Tensor]:
    """Dicts FQN -> random tensor with mixed shapes (0-d, tiny, prime) and dtypes."""
    n = draw(st.integers(min_leaves, max_leaves))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    params = {}
    for i in range(n):
        shape = draw(SHAPES)
        dtype = draw(st.sampled_from(dtypes))
        name = f"layers.{i}.{draw(st.sampled_from(['weight', 'bias', 'scale']))}"
        params[name] = torch.randn(shape, generator=generator).to(dtype)
    return params


@dataclass(frozen=True)
class MeshShape:
    """A (replicate, shard) mesh shape, drawn in the parent and built on every rank."""

    replicate: int
    shard: int

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    def build(self) -> Mesh:
        """The Mesh of this shape (call it on every rank of a `world_size` process group)."""
        return Mesh(replicate=self.replicate, shard=self.shard)


@st.composite
def meshes(draw: st.DrawFn, world_sizes: tuple[int, ...] = (1, 2, 3, 4)) -> MeshShape:
    """Mesh shapes for the given world sizes: FSDP, DDP and every HSDP factorization."""
    world = draw(st.sampled_from(world_sizes))
    shard = draw(st.sampled_from([s for s in range(1, world + 1) if world % s == 0]))
    return MeshShape(replicate=world // shard, shard=shard)


# A module tree is drawn as a spec (nested tuples) and built from a seed, so any process
# builds the same module. Leaves: (kind, frozen); containers: (kind, children).
_LEAF_KINDS = ("linear", "linear_nobias", "layernorm", "batchnorm", "scale", "tied", "shared")
_BATCH_STATS_KINDS = ("batchnorm",)  # mix the rows of a batch in train mode
_CONTAINER_KINDS = ("sequential", "stack", "residual")


@functools.cache  # one recursive strategy per option set, not one per draw
def _specs(kinds: tuple[str, ...], frozen: bool | None) -> st.SearchStrategy:
    """Nested spec tuples of at most 8 leaves, each leaf one of `kinds` and frozen as given
    (drawn per leaf when None)."""
    return st.recursive(
        st.tuples(st.sampled_from(kinds), st.booleans() if frozen is None else st.just(frozen)),
        lambda children: st.tuples(
            st.sampled_from(_CONTAINER_KINDS), st.lists(children, min_size=1, max_size=3).map(tuple)
        ),
        max_leaves=8,
    )


@dataclass(frozen=True)
class ModuleSpec:
    """A random module tree: its structure, width and init seed. `build()` makes the module."""

    tree: tuple
    width: int
    seed: int

    def build(self) -> RandomTree:
        """Build the module; the same spec gives bitwise the same module in any process."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return RandomTree(self.tree, self.width)

    def example_input(self, batch: int = 4, seed: int = 0) -> Tensor:
        """A random (batch, width) input for the built module."""
        return torch.randn(batch, self.width, generator=torch.Generator().manual_seed(seed))


@st.composite
def modules(
    draw: st.DrawFn, max_width: int = 8, batch_stats: bool = True, frozen_mixes: bool = True
) -> ModuleSpec:
    """Random module trees: nested Sequential/ModuleList/custom modules with tied and frozen
    parameters and buffers. Build with `.build()`.

    Laws every drawn tree satisfies (tests/testing/test_testing_toolkit.py checks them):

    - `spec.build()` gives bitwise the same module in any process, and that module maps a
      (batch, width) float32 input, such as `spec.example_input()`, to (batch, width).
    - It has at least one parameter, all float32, and may tie them: a module registered under
      two names ("tied") or a parameter held by two modules ("shared").
    - With `batch_stats=False` (no BatchNorm) the forward is pure and per row, in train mode
      too: buffers are never written and row i of the output depends on row i of the input
      only, so a batch split over ranks gives one process's mean loss and gradients. BatchNorm
      in train mode breaks both: it updates its running stats and normalizes by the batch's.
      With BatchNorm, call `.eval()` for the same laws.
    - With `frozen_mixes=False` all parameters of a tree are frozen or none is (drawn once per
      tree), so `funcshard.plan` with its default `frozen="error"` accepts it under any
      policy; otherwise frozen leaves mix with trainable ones and a unit that holds both needs
      `frozen="warn"`.
    """
    kinds = tuple(k for k in _LEAF_KINDS if batch_stats or k not in _BATCH_STATS_KINDS)
    frozen = None if frozen_mixes else draw(st.booleans())
    return ModuleSpec(
        tree=draw(_specs(kinds, frozen)),
        width=draw(st.integers(2, max_width)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


class Scale(nn.Module):
    """Elementwise affine with a 0-d bias and a persistent buffer."""

    shift: Tensor

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))
        self.bias = nn.Parameter(torch.randn(()))
        self.register_buffer("shift", torch.randn(width))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight + self.bias + self.shift


class SharedScale(nn.Module):
    """Uses another module's parameter under its own name (a tied parameter, not module)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class Stack(nn.Module):
    """Applies a ModuleList in order."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Residual(nn.Module):
    """x + body(x)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.body = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


class RandomTree(nn.Module):
    """The root of a drawn module tree; maps (batch, width) to (batch, width)."""

    def __init__(self, tree: tuple, width: int) -> None:
        super().__init__()
        self.width = width
        self._linears: list[nn.Linear] = []
        self._scales: list[nn.Parameter] = []
        self.body = self._build(tree)
        del self._linears, self._scales

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def _build(self, spec: tuple) -> nn.Module:
        kind, arg = spec
        if kind in ("sequential", "stack", "residual"):
            children = [self._build(child) for child in arg]
            return {
                "sequential": lambda c: nn.Sequential(*c),
                "stack": Stack,
                "residual": Residual,
            }[kind](children)
        module = self._leaf(kind)
        if arg:  # frozen
            module.requires_grad_(False)
        return module

    def _leaf(self, kind: str) -> nn.Module:
        w = self.width
        if kind == "tied" and self._linears:  # the same module registered a second time
            return self._linears[0]
        if kind == "shared" and self._scales:  # a parameter shared by two modules
            return SharedScale(self._scales[0])
        if kind in ("linear", "linear_nobias", "tied"):
            self._linears.append(nn.Linear(w, w, bias=kind != "linear_nobias"))
            return self._linears[-1]
        if kind == "layernorm":
            return nn.LayerNorm(w)
        if kind == "batchnorm":
            return nn.BatchNorm1d(w)
        scale = Scale(w)
        self._scales.append(scale.weight)
        return scale


@dataclass(frozen=True)
class PlanCase:
    """A random module tree and the arguments to plan it with; ignored entries are indices
    into the built model's submodules (resolved by `kwargs`)."""

    spec: ModuleSpec
    policy: Any
    keep_fp32: tuple[type[nn.Module], ...]
    ignored: tuple[int, ...]

    def kwargs(self, model: nn.Module) -> dict[str, Any]:
        """Keyword arguments for `funcshard.plan(model, **kwargs)`; frozen mixing only warns."""
        names = [name for name, _ in model.named_modules() if name]
        ignored = sorted({names[i % len(names)] for i in self.ignored}) if names else []
        # An ignored module inside another ignored one is redundant but legal; keep both.
        return {
            "policy": self.policy,
            "keep_fp32": self.keep_fp32,
            "ignored": ignored,
            "frozen": "warn",
        }


_POLICY_CLASSES = (nn.Linear, nn.LayerNorm, nn.Sequential, Stack, Residual, Scale)


def _policies() -> st.SearchStrategy:
    classes = st.lists(st.sampled_from(_POLICY_CLASSES), min_size=1, max_size=3)
    single = st.one_of(
        classes.map(policy.module_classes),
        st.sampled_from([1, 8, 30, 100]).map(policy.size),
    )
    several = st.lists(single, min_size=2, max_size=3).map(lambda p: policy.any_of(*p))
    return st.one_of(single, several, st.none())


@st.composite
def plans(draw: st.DrawFn) -> PlanCase:
    """Random module trees with random policies, keep_fp32 classes and ignored submodules."""
    return PlanCase(
        spec=draw(modules()),
        policy=draw(_policies()),
        keep_fp32=draw(st.sampled_from([(nn.LayerNorm, Scale), (nn.LayerNorm,), (Scale,), ()])),
        ignored=draw(st.sampled_from([(), (), ()]) | st.tuples(st.integers(0, 50))),
    )


class ParamBag(nn.Module):
    """A module holding given tensors as parameters at their FQNs (nested as needed)."""

    def __init__(self, params: dict[str, Tensor]) -> None:
        super().__init__()
        for fqn, tensor in params.items():
            *path, name = fqn.split(".")
            owner: nn.Module = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(name, nn.Parameter(tensor.clone()))
