"""The pieces `fs.testing.check` runs a user's model with, on every rank and in the reference:
what is checked (`Case`, `Config`), how the model is built and sharded, how the global batch
is drawn and split, and the standard training step.

The standard step is the one README.md teaches: `fs.value_and_grad` of the loss with
`fs.call(model, state, ...)` inside, `opt.update`, `fs.apply_updates`, and the call's new
buffers threaded into the next state; a configuration's recipe switches add activation
checkpointing, frozen parts, compilation, clipping, accumulation, parameter groups, a
schedule and a user `Comm` to it (see [Note: recipes compose] in recipe.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor, nn

from funcshard.comm import _failures as failures
from funcshard.comm._mesh import Mesh
from funcshard.compiling import _jit as jit
from funcshard.core import _placement as placement
from funcshard.core import _policy as policy
from funcshard.core._plan import plan
from funcshard.core._precision import MixedPrecision
from funcshard.core._rng import data_parallel_index, fold_in
from funcshard.core._state import ShardedState
from funcshard.init._materialize import StillOnMeta
from funcshard.init._replay import is_deferred
from funcshard.optim._base import Optimizer
from funcshard.optim._params import apply_updates
from funcshard.step import _sharded_call as sharded_call
from funcshard.step._autodiff import accumulate, value_and_grad
from funcshard.step._reduction import reduce
from funcshard.step._replicate import replicate
from funcshard.step._sharding import shard
from funcshard.testing import recipe

LAWS = ("round_trip", "parity", "determinism", "checkpoint", "collectives", "purity", "memory")
MP = {"bf16": torch.bfloat16, "fp16": torch.float16}
ADAMW_EPS = 1e-3  # see DESIGN.md §10 item 4: at 1e-8 roundoff in zero grads becomes lr-sized


class PhaseFailed(Exception):
    """A rank's work broke `law` before it could be observed whole (an exception, or a
    collective that differs across ranks)."""

    def __init__(self, law: str, message: str) -> None:
        super().__init__(law, message)
        self.law, self.message = law, message

    def __str__(self) -> str:
        return f"{self.law}: {self.message}"


@contextlib.contextmanager
def phase(law: str) -> Iterator[None]:
    """Raise what goes wrong inside as `PhaseFailed(law, ...)` (`collectives` for a
    collective that differs across ranks, whatever the phase)."""
    try:
        yield
    except PhaseFailed:
        raise
    except failures.CollectiveError as e:
        raise PhaseFailed("collectives", first_lines(e)) from e
    except Exception as e:
        raise PhaseFailed(law, f"{type(e).__name__}: {first_lines(e)}") from e


def first_lines(error: BaseException, lines: int = 6) -> str:
    return "\n".join(str(error).splitlines()[:lines])


@dataclass(frozen=True)
class Case:
    """The user's model, data and loss, and the options that hold for every configuration.

    Everything here is sent to every rank, so the callables pickle by reference
    (module-level functions or classes).
    """

    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Tensor]
    policy: Any = None
    steps: int = 3
    optimizer: recipe.OptimizerChoice = "adamw"  # or a factory of a user's own
    lr: float = 1e-2
    batch_stats: bool | None = None  # None: whether the model holds batch-norm layers
    meta: bool | None = None  # None: try the meta device, fall back to the CPU
    setup: Callable[[], contextlib.AbstractContextManager] | None = None
    laws: tuple[str, ...] = LAWS
    backend: str = "aot_eager"  # fs.compile's, for configurations that compile the step


@dataclass(frozen=True, order=True)
class Config:
    """One configuration to check: a mesh, a plan, resharding, precision and a seed, and the
    recipe switches (see [Note: recipes compose] in recipe.py), all off by default."""

    replicate: int
    shard: int
    ddp: bool  # fs.replicate (DDP buckets) rather than fs.shard
    policy: str  # "given", "blocks", "size", "root" or "buckets" (DDP)
    reshard_after_forward: bool | int
    mp: str | None
    seed: int
    resume_world: int  # the world size the checkpoint is loaded at
    checkpointing: bool = False  # every other block recomputed in backward
    frozen: bool = False  # each block's first Linear frozen, plan(frozen="split")
    compiled: bool = False  # the step through fs.compile
    clip: bool = False  # clip_by_global_norm before the optimizer
    micro_batches: int = 1  # gradient accumulation over this many micro-batches
    groups: bool = False  # two parameter groups (fs.optim.partition)
    schedule: bool = False  # a warmup schedule of the learning rate
    comm: bool = False  # a user fs.Comm does the gathers and reduces
    owned: bool = False  # placement "owned" for every unit within its bound

    @property
    def recipe(self) -> str:
        """The switches that are on, in words ("" for none)."""
        words = [
            ("checkpointing", self.checkpointing),
            ("frozen split", self.frozen),
            ("compiled", self.compiled),
            ("clip", self.clip),
            (f"{self.micro_batches} micro-batches", self.micro_batches > 1),
            ("param groups", self.groups),
            ("schedule", self.schedule),
            ("user comm", self.comm),
            ("owned placement", self.owned),
        ]
        return ", ".join(word for word, on in words if on)

    @property
    def world(self) -> int:
        return self.replicate * self.shard

    @property
    def mesh_name(self) -> str:
        if self.world == 1:
            return "1 rank"
        if self.ddp:
            return f"ddp {self.replicate}"
        if self.replicate == 1:
            return f"fsdp {self.shard}"
        return f"hsdp {self.replicate}x{self.shard}"

    def __str__(self) -> str:
        reshard = "" if self.shard == 1 else f", reshard {self.reshard_after_forward}"
        policy = "" if self.ddp else f", policy {self.policy}"
        recipe = f", {self.recipe}" if self.recipe else ""
        return (
            f"{self.mesh_name}{policy}{reshard}, {self.mp or 'fp32'}{recipe}, seed "
            f"{self.seed}, resume at {self.resume_world}"
        )


@contextlib.contextmanager
def user_setup(case: Case) -> Iterator[None]:
    """The case's `setup()` context, if it has one."""
    with case.setup() if case.setup is not None else contextlib.nullcontext():
        yield


def mesh_of(config: Config) -> Mesh:
    """The configuration's mesh, every collective compared across ranks before it is issued."""
    return Mesh(replicate=config.replicate, shard=config.shard, check_collectives=True)


def build(case: Case, config: Config, mesh: Mesh) -> tuple[nn.Module, ShardedState, str]:
    """Build and shard the model: on the meta device where `fs.shard` can initialize it
    (unless `case.meta` is False), else on the CPU after `torch.manual_seed(seed)`. Returns
    the model, its state and where it was built ("meta" or "cpu")."""
    with phase("round_trip"):
        with torch.random.fork_rng(devices=[]):  # a deferred model draws as on the CPU
            torch.manual_seed(config.seed)
            model = _on_meta(case)
        if model is not None:
            try:
                model = _prepared(model, config)
                return model, _shard(case, config, model, mesh), "meta"
            except StillOnMeta:  # a tensor no reset_parameters() initializes
                if case.meta:
                    raise
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = _prepared(case.make_model(), config)
        return model, _shard(case, config, model, mesh), "cpu"


def _on_meta(case: Case) -> nn.Module | None:
    """`make_model()` on the meta device; None when `case.meta` is False or it cannot be
    built there (its constructor reads values, say) and `case.meta` is not True."""
    if case.meta is False:
        return None
    try:
        with torch.device("meta"):
            return case.make_model()
    except Exception:
        if case.meta:
            raise
        return None


def _prepared(model: nn.Module, config: Config) -> nn.Module:
    """Eval mode (dropout off on both sides) with batch-norm layers in train mode, so that
    their batch statistics and running averages are checked too; frozen and checkpointed
    blocks as the configuration says."""
    model.eval()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.train()
    return recipe.prepare(model, config.checkpointing, config.frozen)


def _shard(case: Case, config: Config, model: nn.Module, mesh: Mesh) -> ShardedState:
    seed = None if is_deferred(model) else config.seed  # deferred: the constructor's values
    if config.ddp:  # about three buckets; mixed precision is DDP's compressed all-reduce
        mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 3 / 2**20
        dtype = MP[config.mp] if config.mp is not None else None
        return replicate(
            model, mesh, bucket_mb=mb, first_bucket_mb=mb / 2, comm_dtype=dtype, seed=seed
        )
    frozen = "split" if config.frozen else "error"
    model_policy = _policy(case, config.policy, model)
    owned = functools.partial(_owned_where_it_fits, config.shard) if config.owned else None
    model_plan = plan(model, policy=model_policy, frozen=frozen, placement=owned)
    return shard(
        model,
        model_plan,
        mesh,
        mp=mixed_precision(config.mp),
        reshard_after_forward=config.reshard_after_forward,
        seed=seed,
    )


def _owned_where_it_fits(shard_size: int, unit: Any) -> str:
    """The `owned` switch's placement: "owned" for every unit within the bound over
    `shard_size` ranks (see [Note: owned placement]), "even" for the others."""
    return "owned" if placement.fits(unit, shard_size) else "even"


def mixed_precision(name: str | None) -> MixedPrecision | None:
    """bf16 or fp16 gathers and compute, fp32 reduction and outputs; None for fp32."""
    if name is None:
        return None
    return MixedPrecision(
        param_dtype=MP[name], reduce_dtype=torch.float32, output_dtype=torch.float32
    )


def _policy(case: Case, name: str, model: nn.Module) -> Any:
    """The policy a configuration names, built for this model."""
    if name == "given":
        return case.policy
    if name == "blocks":
        return policy.module_classes(_block_classes(model))
    if name == "size":
        return policy.size(max(1, sum(p.numel() for p in model.parameters()) // 4))
    return None  # "root": one unit


def _block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes inside the model's first non-empty ModuleList (transformer blocks)."""
    return {type(child) for child in recipe.blocks(model)}


def has_batch_stats(model: nn.Module) -> bool:
    """Whether a layer normalizes by the statistics of the batch in train mode."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def bitwise(a: Tensor, b: Tensor) -> bool:
    """Same shape, dtype and bytes (NaN equals itself here, unlike `torch.equal`)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(_as_bytes(a), _as_bytes(b))


def _as_bytes(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def optimizer(case: Case, config: Config) -> Optimizer:
    """AdamW with eps 1e-3 (see ADAMW_EPS), or SGD with momentum 0.9, at the case's rate, in
    groups, on a schedule and after clipping as the configuration says; or the case's own
    factory's optimizer, after clipping as the configuration says."""
    return recipe.optimizer(
        case.optimizer, case.lr, ADAMW_EPS, config.groups, config.schedule, config.clip
    )


def global_batch(case: Case, config: Config, step: int) -> tuple[Any, Any]:
    """`make_batch(step)`, with torch's generator seeded by (seed, step): every rank and the
    reference get the same batch even from a make_batch that draws unseeded."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(fold_in(config.seed, step))
        return case.make_batch(step)


def split(tree: Any, index: int, parts: int) -> Any:
    """Chunk `index` of `parts` of every tensor of `tree` along dim 0, refusing a batch whose
    rows do not split evenly: the ranks' mean losses would then weigh rows unequally, and
    parity with one process on the global batch would fail for no fault of the step."""
    for x in optree.tree_leaves(tree, none_is_leaf=False):
        if isinstance(x, Tensor) and (x.dim() == 0 or x.shape[0] % parts):
            rows = x.shape[0] if x.dim() else "no"
            raise ValueError(
                f"funcshard.testing: make_batch gives a tensor with {rows} rows, which do not "
                f"split into {parts} equal parts (one per data-parallel rank, or per "
                f"micro-batch). Make the global batch's rows a multiple of every world size "
                f"times micro-batch count the check draws, or draw only world sizes that "
                f"divide it."
            )
    return optree.tree_map(
        lambda x: x.chunk(parts)[index] if isinstance(x, Tensor) else x, tree, none_is_leaf=False
    )


def local_batch(case: Case, config: Config, step: int, mesh: Mesh) -> tuple[Any, Any]:
    """This rank's micro-batch of step `step`: its data-parallel index's chunk."""
    inputs, targets = global_batch(case, config, step)
    index = data_parallel_index(mesh)
    return split(inputs, index, mesh.size), split(targets, index, mesh.size)


def call(model: nn.Module, params: Any, inputs: Any, **options: Any) -> Any:
    """`fs.call` with the inputs as `model(**inputs)` (a dict), `model(*inputs)` (a tuple or
    list) or `model(inputs)`."""
    if isinstance(inputs, dict):
        return sharded_call.call(model, params, **inputs, **options)
    if isinstance(inputs, tuple | list):
        return sharded_call.call(model, params, *inputs, **options)
    return sharded_call.call(model, params, inputs, **options)


Step = Callable[..., tuple[Tensor, Any, Any]]  # (state, opt_state, inputs, targets) -> ...


def make_step(case: Case, config: Config, model: nn.Module, opt: Optimizer) -> Step:
    """The standard step for this configuration, `(state, opt_state, inputs, targets) ->
    (this rank's loss, new state, new optimizer state)`: compiled with the case's backend
    when the configuration says so (one compiled function per training run)."""
    fn = functools.partial(_step, case, config, model, opt)
    return jit.compile(fn, backend=case.backend) if config.compiled else fn


def _step(
    case: Case,
    config: Config,
    model: nn.Module,
    opt: Optimizer,
    state: ShardedState,
    opt_state: Any,
    inputs: Any,
    targets: Any,
) -> tuple[Tensor, ShardedState, Any]:
    comm = recipe.USER_COMM if config.comm else None
    parts = config.micro_batches

    def loss_of(state: ShardedState, inputs: Any, targets: Any) -> tuple[Tensor, Any]:
        out, buffers = call(model, state, inputs, mutable=True)
        return case.loss_fn(out, targets) / parts, buffers

    if parts == 1:
        grad_fn = value_and_grad(loss_of, has_aux=True, comm=comm)
        (loss, buffers), grads = grad_fn(state, inputs, targets)
        if buffers:
            state = state.replace(buffers=buffers)
    else:  # each micro-batch's loss divided by their number: fs.accumulate sums
        grad_fn = value_and_grad(loss_of, has_aux=True, reduce=False, comm=comm)
        local, losses = None, []
        for i in range(parts):
            part = split(inputs, i, parts), split(targets, i, parts)
            (loss, buffers), grads = grad_fn(state, *part)
            if buffers:
                state = state.replace(buffers=buffers)
            local = grads if local is None else accumulate(local, grads)
            losses.append(loss)
        assert local is not None  # parts > 1: the loop ran
        grads, loss = reduce(state, local, comm=comm), sum(losses)
    updates, opt_state = opt.update(grads, opt_state, state)
    return loss, apply_updates(state, updates), opt_state
