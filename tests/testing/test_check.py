"""`fs.testing.check`: the sharding laws on a user's model in one call (testing/check.py).

It passes on the library's own models (GPT, Llama, a BatchNorm ConvNet, a transformers causal
LM when transformers is installed), and it catches, by the law's name, problems planted in a
model (a forward or a buffer that depends on the rank, a parameter created in forward, noise
seeded by the rank) and in funcshard itself (gradients summed instead of averaged, the
all-reduce across replicas left out: planted on every rank through `setup`), shrinking each
to a small configuration. Everything the ranks run is defined at module level: they unpickle
it by reference.
"""

import contextlib
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard as fs
from funcshard.comm import _collectives as collectives
from funcshard.step import _gather as gather
from funcshard.testing.harness import LAWS, split
from funcshard.testing.models import GPT, ConvNet, GPTConfig, Llama, LlamaConfig
from funcshard.testing.recipe import Axes

# World sizes 1 and 2, two steps, few configurations: the laws fail at 2 ranks already.
QUICK = {"world_sizes": (1, 2), "steps": 2, "examples": 3, "shrink_budget": 10}


def gpt() -> GPT:
    return GPT(GPTConfig(n_layer=2))


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(61, (4, 17), generator=torch.Generator().manual_seed(step))
    return t[:, :-1], t[:, 1:]


def llama() -> Llama:
    return Llama(LlamaConfig(vocab_size=61, d_model=32, n_layer=2, n_head=2, ffn_hidden=64))


def images(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(10, (8,), generator=g)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def one_block_gpt() -> GPT:
    return GPT(GPTConfig(n_layer=1))


def test_the_laws_hold_for_the_library_gpt_and_the_report_says_so():
    """Two configurations (seed 0): one rank with every switch off, then FSDP on 2 ranks with
    most recipe switches on, compiled. A third drew another compiled step (HSDP 2x1 with
    clipping: HSDP's laws are the four-rank test's, a compiled HSDP step is
    tests/compiling/test_compile.py's `[hsdp]` case, clipping the recipe property test's).
    One block (the drawn configurations do not depend on it): dynamo traces each block it
    inlines; the compiled configuration's block is checkpointed and partly frozen, under the
    "root" policy (one unit)."""
    report = fs.testing.check(one_block_gpt, tokens, cross_entropy, **{**QUICK, "examples": 2})
    assert report.ok and report.smallest is None
    assert {r.law for r in report.results} == set(LAWS)
    assert any(c.world == 2 for c in report.configs)
    table = report.table()
    assert "parity" in table and "every law held" in table and f"{report.seconds:.1f} s" in table


def test_every_mesh_of_four_ranks_is_checked_once_with_four_examples():
    report = fs.testing.check(gpt, tokens, cross_entropy, world_sizes=(4,), steps=2, examples=4)
    assert report.ok, report.table()
    assert {c.mesh_name for c in report.configs} == {"fsdp 4", "hsdp 2x2", "hsdp 4x1", "ddp 4"}


def test_the_laws_hold_for_llama_under_a_given_policy_and_mixed_precision():
    """Every recipe switch but compilation: the compiled draws (FSDP 2 in bf16, DDP 2) were
    90% of the time, and compiled steps are the GPT check's, compiled bf16 gathers
    tests/compiling/test_compiled_reshard.py's."""
    from funcshard.testing.models import LlamaBlock

    policy = fs.policy.module_classes({LlamaBlock})
    report = fs.testing.check(
        llama,
        tokens,
        cross_entropy,
        policy=policy,
        mixed_precision=True,
        recipes=Axes(compiled=False),
        **QUICK,
    )
    assert report.ok, report.table()
    assert {c.policy for c in report.configs} <= {"given", "buckets"}
    assert any(c.mp == "bf16" and c.world == 2 for c in report.configs), report.table()


def test_batchnorm_running_statistics_pass_against_per_rank_micro_batches():
    """BatchNorm's running statistics differ across ranks, as they do under DDP without
    SyncBatchNorm: the reference runs each rank's micro-batch and keeps its buffers apart.
    No compiled draw (two of three were, most of the time): a compiled step's updated
    batch-norm buffers are tests/compiling/test_compile.py's."""
    report = fs.testing.check(ConvNet, images, recipes=Axes(compiled=False), **QUICK)
    assert report.ok, report.table()
    parity = [r for r in report.results if r.law == "parity" and r.config.world == 2]
    assert parity and "micro-batches" in parity[0].detail


# Planted problems. A model's rank, where torch.distributed runs (the reference is rank 0).
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Small(nn.Module):
    """Two linear layers in a ModuleList (so the drawn policies give several units)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.tanh(self.layers[0](x)))


def regression(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


class RankDependentForward(Small):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.1 * _rank()


class RankDependentBuffer(Small):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1 + _rank()
        return super().forward(x)


class ParameterCreatedInForward(Small):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "scale" not in self._parameters:
            self.scale = nn.Parameter(torch.ones(2))
        return super().forward(x) * self.scale


class RankSeededNoise(Small):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(_rank())
        return super().forward(x) + 0.01 * torch.randn(x.shape[0], 2, generator=g)


class RankDependentBranch(Small):
    """Rank 1 skips the first layer: its collectives part from rank 0's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _rank() == 1:
            return self.layers[1](torch.zeros(x.shape[0], 8))
        return super().forward(x)


def _caught(make_model, expected: set[str], **options) -> fs.testing.Report:
    """Check a planted problem: it must fail one of `expected`, shrunk to 2 ranks at most."""
    started = time.monotonic()
    with pytest.raises(fs.testing.LawViolation) as caught:
        fs.testing.check(make_model, regression, **{**QUICK, **options})
    report = caught.value.report
    failed = {r.law for r in report.failures}
    assert failed & expected, report.table()
    assert caught.value.law in failed and caught.value.config == report.smallest
    assert max(report.smallest.world, report.smallest.resume_world) == 2, report.table()
    assert report.smallest.seed == 0, report.table()
    print(f"\n{sorted(failed)}: {report.smallest} ({time.monotonic() - started:.1f} s)")
    return report


def test_a_forward_that_depends_on_the_rank_breaks_parity():
    report = _caught(RankDependentForward, {"parity"})
    assert "loss" in report.failures[0].detail


def test_a_buffer_written_with_the_rank_breaks_parity_naming_the_buffer():
    """Recipes off: the first failing configuration drew a compiled step, and shrinking it
    compiled five more (70 s against 7 s, to the same smallest configuration). The other
    planted problems keep the recipe switches drawn (the missing all-reduce all but
    compilation)."""
    report = _caught(RankDependentBuffer, {"parity"}, recipes=False)
    assert "buffer calls on rank 1" in next(r.detail for r in report.failures if r.law == "parity")


def test_a_parameter_created_in_forward_breaks_purity_naming_it():
    report = _caught(ParameterCreatedInForward, {"purity"})
    detail = next(r.detail for r in report.failures if r.law == "purity")
    assert "gained parameter scale" in detail


def test_noise_seeded_by_the_rank_breaks_parity():
    _caught(RankSeededNoise, {"parity"})


def test_a_layer_skipped_on_one_rank_breaks_collectives_naming_where_the_ranks_part():
    report = _caught(RankDependentBranch, {"collectives"})
    assert "about to issue different collectives" in report.failures[0].detail


# Bugs planted in funcshard's collectives on every rank (never in comm/_collectives.py itself).
_REAL_REDUCE_SCATTER = collectives.reduce_scatter
_REAL_ALL_REDUCE = collectives.all_reduce


def _summed_reduce_scatter(flat, group, op="avg", what=None, owned=False, loads=()):
    return _REAL_REDUCE_SCATTER(flat, group, "sum", what=what, owned=owned, loads=loads)


def _summed_all_reduce(tensor, group, op="avg", inplace=False, what=None):
    return _REAL_ALL_REDUCE(tensor, group, "sum", inplace=inplace, what=what)


def _skipped_mean_all_reduce(tensor, group, op="avg", inplace=False, what=None):
    if op == "avg":  # gradients across replicas: left out (metrics sum, and still reduce)
        return collectives.Pending(tensor, done=True)
    return _REAL_ALL_REDUCE(tensor, group, op, inplace=inplace, what=what)


@contextlib.contextmanager
def sum_instead_of_mean():
    with (
        mock.patch.object(collectives, "reduce_scatter", _summed_reduce_scatter),
        mock.patch.object(collectives, "all_reduce", _summed_all_reduce),
    ):
        yield


@contextlib.contextmanager
def no_all_reduce_across_replicas():
    with mock.patch.object(collectives, "all_reduce", _skipped_mean_all_reduce):
        yield


@pytest.mark.quick
def test_gradients_summed_instead_of_averaged_break_parity():
    _caught(Small, {"parity"}, setup=sum_instead_of_mean)


def test_a_missing_all_reduce_across_replicas_breaks_parity():
    """Every recipe switch but compilation: shrinking a compiled failing draw compiled again
    at each step; the GPT check covers compiled steps."""
    report = _caught(
        Small, {"parity"}, setup=no_all_reduce_across_replicas, recipes=Axes(compiled=False)
    )
    assert report.smallest.replicate == 2, report.table()


# Planted so that each remaining law is shown failing: memory, checkpoint, determinism.
_REAL_GATHER = gather.gather
_REAL_LOAD = fs.checkpoint.load
_LEAKED: list = []
_CALLS = [0]


def _leaking_gather(*args, **kwargs):
    views = _REAL_GATHER(*args, **kwargs)
    _LEAKED.append(views)  # every gathered buffer stays alive: nothing is ever resharded
    return views


@contextlib.contextmanager
def gathered_buffers_leak():
    with mock.patch.object(gather, "gather", _leaking_gather):
        yield
    _LEAKED.clear()


def _nudged_load(*args, **kwargs):
    state, opt_state, step, extra = _REAL_LOAD(*args, **kwargs)
    shards = (state.shards[0] + 1e-3, *state.shards[1:])
    return state.replace(shards=shards), opt_state, step, extra


@contextlib.contextmanager
def load_off_by_a_little():
    with mock.patch.object(fs.checkpoint, "load", _nudged_load):
        yield


class CountsItsCalls(Small):
    """Its output depends on how often it ran in this process: not a function of its inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _CALLS[0] += 1
        return super().forward(x) + 1e-3 * (_CALLS[0] % 3)


def test_gathered_buffers_that_are_never_released_break_memory():
    report = _caught(Small, {"memory"}, setup=gathered_buffers_leak, laws=("memory",))
    assert "gathered" in report.failures[0].detail


def test_a_checkpoint_that_loads_other_values_breaks_checkpoint():
    _caught(Small, {"checkpoint"}, setup=load_off_by_a_little, laws=("checkpoint",))


def test_a_model_whose_output_depends_on_its_history_breaks_determinism():
    _caught(CountsItsCalls, {"determinism"}, laws=("determinism",))


def test_arguments_that_cannot_reach_the_ranks_are_refused_before_any_rank_starts():
    with pytest.raises(TypeError, match="module-level functions"):
        fs.testing.check(lambda: Small(), regression)
    with pytest.raises(ValueError, match="does not split evenly over world sizes \\[3\\]"):
        fs.testing.check(Small, regression, world_sizes=(1, 3))


def causal_lm() -> nn.Module:
    """A tiny transformers Llama (initialized by transformers, so built on the CPU)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def keyword_tokens(step: int) -> tuple[dict, torch.Tensor]:
    inputs, targets = tokens(step)
    return {"input_ids": inputs, "attention_mask": torch.ones_like(inputs)}, targets


def test_the_laws_hold_for_a_transformers_causal_lm_called_with_keywords():
    """Two configurations (seed 0): one rank with every switch off, then FSDP on 2 ranks with
    most recipe switches on, compiled (a transformers model traced by dynamo, called with
    keywords). A third drew another compiled step (DDP 2 with checkpointing and a frozen
    split), a third of the test's time: a compiled DDP step is
    tests/compiling/test_compile.py's `[ddp]` case, checkpointing and frozen weights the
    FSDP 2 configuration's too."""
    pytest.importorskip("transformers")
    check = {**QUICK, "examples": 2}
    report = fs.testing.check(causal_lm, keyword_tokens, **check)  # default_loss: .logits
    assert report.ok, report.table()
    assert any(c.world == 2 and c.compiled for c in report.configs), report.table()


def _command(*argv: str) -> int:
    import argparse

    from funcshard.cli import _check_command as check_command

    parser = argparse.ArgumentParser(prog="funcshard")
    check_command.add_parser(parser.add_subparsers(dest="command"))
    return check_command.run(parser.parse_args(["check", *argv]))


def test_the_check_command_prints_the_report_and_exits_by_the_verdict(capsys):
    started = time.monotonic()
    code = _command(
        "test_check:gpt",
        "--batch",
        "test_check:tokens",
        "--loss",
        "test_check:cross_entropy",
        "--quick",
        "--world-sizes",
        "1,2",
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "every law held" in out and "funcshard check took" in out
    with capsys.disabled():
        print(f"\nfuncshard check --quick on the GPT: {time.monotonic() - started:.1f} s")
    code = _command(
        "test_check:ParameterCreatedInForward",
        "--batch",
        "test_check:regression",
        "--laws",
        "purity",
        "--quick",
    )
    out = capsys.readouterr().out
    assert code == 1 and "gained parameter scale" in out, out
    assert _command("test_check:gpt", "--batch", "nowhere") == 2


def test_a_seed_replays_the_same_configurations_and_a_database_replays_the_failure(tmp_path):
    """Recipes off: what is replayed does not depend on them, and a compiled draw, shrunk,
    compiles again at each step of the shrinking, in each of the four checks."""
    options = {**QUICK, "raise_on_failure": False, "laws": ("parity",), "recipes": False}
    first = fs.testing.check(RankDependentBuffer, regression, seed=3, **options)
    again = fs.testing.check(RankDependentBuffer, regression, seed=3, **options)
    assert first.configs == again.configs and first.smallest == again.smallest
    saved = fs.testing.check(RankDependentBuffer, regression, database=tmp_path, **options)
    replayed = fs.testing.check(RankDependentBuffer, regression, database=tmp_path, **options)
    assert replayed.configs[0] == saved.smallest  # replayed first, before anything is drawn


def test_a_configuration_that_crashed_never_passes_even_when_its_law_was_not_asked_for():
    """A rank that raised in the collectives phase fails a check of parity alone."""
    from funcshard.testing.harness import Case, Config, PhaseFailed
    from funcshard.testing.judge import judge

    case = Case(make_model=None, make_batch=None, loss_fn=None, laws=("parity",))
    config = Config(1, 2, False, "blocks", True, None, 0, 1)
    (result,) = judge(case, config, PhaseFailed("collectives", "rank 1 died"), None)
    assert result.failed and "collectives failed first: rank 1 died" in result.detail


def test_mixed_precision_parity_judges_each_update_so_a_flipped_gradient_fails():
    from funcshard.testing.judge import MP_UPDATE_TOLERANCE, update_error

    first = torch.randn(64, generator=torch.Generator().manual_seed(0))
    update = 1e-2 * torch.randn(64, generator=torch.Generator().manual_seed(1))
    rounding = 1e-2 * update * torch.randn(64, generator=torch.Generator().manual_seed(2))
    assert update_error(first + update + rounding, first + update, first) < MP_UPDATE_TOLERANCE
    assert update_error(first - update, first + update, first) > MP_UPDATE_TOLERANCE


def test_a_batch_that_does_not_split_evenly_over_the_ranks_is_refused_by_name():
    """Before: 8 rows over 3 ranks went 3, 3, 2, and parity failed by 0.25 on a correct step
    (the ranks' mean losses weigh rows unequally); over 6 micro-batches, an IndexError."""
    rows = (torch.randn(8, 3), torch.randint(5, (8,)))
    assert [t.shape[0] for t in split(rows, 1, 4)] == [2, 2]
    for parts in (3, 6):
        with pytest.raises(ValueError, match=f"8 rows, which do not split into {parts} equal"):
            split(rows, 0, parts)
