"""`funcshard plan`: its estimates against a real 2-rank run, and the command itself."""

import re
import sys
import uuid

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
from funcshard.cli import _main as cli
from funcshard.comm import _collectives as collectives
from funcshard.planning._estimate import estimate
from funcshard.testing.models import GPT, Block, GPTConfig


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _measured(rank: int) -> dict:
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=3))
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    opt = fs.optim.adamw(1e-3)
    opt_state = opt.init(state)
    g = torch.Generator().manual_seed(rank)
    t = torch.randint(61, (2, 17), generator=g)
    step = fs.value_and_grad(
        lambda s: F.cross_entropy(fs.call(model, s, t[:, :-1]).flatten(0, 1), t[:, 1:].flatten())
    )
    step(state)  # a layout's first step sends one word more (funcshard/step/_zero_start.py)
    with collectives.record() as log:
        _, grads = step(state)
    sent = collectives.bytes_sent(log)
    return {
        "persistent": _bytes(state.shards)
        + _bytes(grads.shards)
        + _bytes(opt_state.exp_avg)
        + _bytes(opt_state.exp_avg_sq),
        "gathered": {f.unit: f.padded_numel * f.dtype.itemsize for f in state.layout.flats},
        "sent": sent,
        "planned": estimate(plan, 1, 2),
    }


@pytest.mark.quick
def test_plan_estimates_equal_a_real_two_rank_step():
    for r in testing.run(_measured, world_size=2):
        planned = r["planned"]
        assert planned.persistent == r["persistent"]
        assert {u.name: u.gathered for u in planned.units} == r["gathered"]
        assert planned.sent_per_step == r["sent"]


def _ddp_sent(rank: int) -> tuple[int, int]:
    """A DDP-2 step's bytes sent, measured and estimated (the verdict an all-reduce here)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=3))
    state = fs.replicate(model, fs.Mesh(replicate=2))
    t = torch.randint(61, (2, 17), generator=torch.Generator().manual_seed(rank))
    step = fs.value_and_grad(
        lambda s: F.cross_entropy(fs.call(model, s, t[:, :-1]).flatten(0, 1), t[:, 1:].flatten())
    )
    step(state)  # (the first step sends a word more)
    with collectives.record() as log:
        step(state)
    planned = fs.estimate(None, 2, replicate=True, model=model, device="cpu")
    return collectives.bytes_sent(log), planned.sent_per_step


def test_plan_estimates_a_ddp_steps_bytes_exactly():
    for sent, planned in testing.run(_ddp_sent, world_size=2):
        assert planned == sent, (planned, sent)


def _plan_command(capsys, *options: str) -> tuple[int, str, str]:
    """`funcshard plan funcshard.testing.models:GPT OPTIONS` in this process (the exit code,
    stdout and stderr a launch would give: a SystemExit's message goes to stderr, code 1).
    No interpreter is launched: `python -m funcshard` runs as a process in
    tests/recipes/test_recovery.py, and this command's work is all in `cli.main`."""
    capsys.readouterr()  # what earlier code printed is not this command's
    try:
        code = cli.main(["plan", "funcshard.testing.models:GPT", *options])
    except SystemExit as e:
        code, message = (1, e.code) if isinstance(e.code, str) else (e.code or 0, "")
        out, err = capsys.readouterr()
        return code, out, err + message
    out, err = capsys.readouterr()
    return code, out, err


def test_the_plan_command_prints_per_unit_and_total_bytes(capsys):
    code, out, err = _plan_command(capsys, "--world-size", "8", "--mesh", "2x4", "--mp", "bf16")
    assert code == 0, err
    assert "mesh 2x4 (replicate x shard), units: Block" in out
    assert "blocks.0" in out and "<root>" in out
    assert "KiB held (params + grads + optimizer state)" in out
    assert "peak: " in out and "activations not included" in out
    assert "placement" not in out  # all even: no placement column


def test_the_plan_command_owns_the_units_within_the_bound_and_shows_each_placement(capsys):
    # 4 ranks: the root's embedding is over owned's bound, so the root stays even
    code, out, err = _plan_command(capsys, "--world-size", "4", "--placement", "owned")
    assert code == 0, err
    assert "placement owned" in out
    rows = dict(re.findall(r"^(blocks\.\d|<root>) +(even|owned) ", out, re.M))
    assert rows == {"blocks.0": "owned", "blocks.1": "owned", "<root>": "even"}, out


def test_the_plan_command_plans_a_replicate_state_as_estimate_does(capsys):
    code, out, err = _plan_command(capsys, "--world-size", "4", "--replicate")
    assert code == 0, err
    assert "mesh 4x1 (replicate x shard), units: DDP's gradient buckets" in out
    with torch.device("meta"):
        model = GPT()
    assert estimate(None, 4, replicate=True, model=model).table() in out
    assert "<bucket 0>" in out and "blocks.0" not in out


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (("--mesh", "2x2"), "the mesh is 4x1, not --mesh 2x2"),
        (("--units", "Block"), "--units"),
        (("--placement", "owned"), "--placement"),
    ],
)
def test_the_plan_command_refuses_sharding_options_with_replicate(capsys, options, named):
    code, _, err = _plan_command(capsys, "--world-size", "4", "--replicate", *options)
    assert code != 0 and "funcshard plan --replicate: " in err and named in err


def test_the_plan_command_names_a_bad_mesh(capsys):
    code, _, err = _plan_command(capsys, "--world-size", "8", "--mesh", "3x3")
    assert code != 0 and "--mesh 3x3 has 9 ranks, not 8" in err


def _factory_module(directory) -> str:
    """A module in `directory` with a factory `tiny`, under a name no other test imports."""
    name = f"fs_cli_models_{uuid.uuid4().hex[:8]}"
    (directory / f"{name}.py").write_text(
        "from funcshard.testing.models import GPT, GPTConfig\n\n"
        "def tiny():\n    return GPT(GPTConfig(n_layer=3))\n"
    )
    return name


def _plan_in(directory, monkeypatch, *argv: str) -> int:
    """`funcshard plan` in-process, run from `directory` as the console script runs: with
    sys.path starting at the script's folder, not at the current directory."""
    monkeypatch.chdir(directory)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(directory))])
    return cli.main(["plan", *argv])


def test_plan_imports_the_factory_from_the_current_directory(tmp_path, monkeypatch, capsys):
    """The console script did not look in the current directory, as `python -m` does."""
    name = _factory_module(tmp_path)
    assert _plan_in(tmp_path, monkeypatch, f"{name}:tiny", "--world-size", "2") == 0
    out = capsys.readouterr().out
    assert f"{name}:tiny: " in out and "blocks.2" in out
    sys.modules.pop(name, None)


def test_a_missing_module_names_where_it_looked_and_how_to_fix_it(tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as e:
        _plan_in(tmp_path, monkeypatch, "no_such_models:gpt", "--world-size", "2")
    message = str(e.value.code)
    assert "funcshard plan: no module named 'no_such_models'" in message
    assert f"current directory {tmp_path}" in message and "PYTHONPATH" in message
    with pytest.raises(SystemExit, match=r"has no such name: 'nope'"):
        cli.main(["plan", "funcshard.testing.models:nope", "--world-size", "2"])


def test_plan_sizes_print_with_a_unit_never_as_zero(capsys):
    """Units of a few KiB printed as 0.0 MiB."""
    assert cli.main(["plan", "funcshard.testing.models:GPT", "--world-size", "8"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("blocks.")]
    assert rows and all("KiB" in row and " 0.0" not in row for row in rows)


def test_plan_with_tokens_counts_activations(capsys):
    argv = ["plan", "funcshard.testing.models:GPT", "--world-size", "2"]
    assert cli.main([*argv, "--tokens", "4x16"]) == 0
    out = capsys.readouterr().out
    assert "batch 4x16 tokens per rank" in out
    assert "activations included (a dry run of the step on the meta device)" in out
    with pytest.raises(SystemExit, match=r"--tokens expects AxB, e.g. 8x1024, got '4by16'"):
        cli.main([*argv, "--tokens", "4by16"])


TUPLE_MODELS = """
import torch
import torch.nn.functional as F
from torch import nn


class LM(nn.Module):
    \"\"\"nanoGPT's GPT in small: (logits, loss), the logits of the last position only
    without targets; or a dict holding them.\"\"\"

    def __init__(self, returns):
        super().__init__()
        self.returns = returns
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 11)

    def forward(self, idx, targets=None):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x).relu()
        if self.returns == "last":
            return self.head(x[:, [-1], :]), None
        logits = self.head(x)
        return (logits, None) if self.returns == "tuple" else {"logits": logits, "aux": x}


def tuple_lm():
    return LM("tuple")


def dict_lm():
    return LM("dict")


def last_lm():
    return LM("last")


def last_token_loss(outputs, tokens):
    logits, _ = outputs
    return F.cross_entropy(logits[:, -1].float(), tokens[:, -1])
"""


def test_plan_with_tokens_takes_a_tuple_or_dict_output_or_a_loss(tmp_path, monkeypatch, capsys):
    """`--tokens` refused nanoGPT's `(logits, loss)` ("got tuple"); now it takes the logits
    of a tuple or dict, and `--loss MODULE:FN` (as `funcshard check` takes it) for others."""
    name = f"fs_cli_tuple_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(TUPLE_MODELS)
    tokens = ("--world-size", "2", "--tokens", "2x6")
    for factory in ("tuple_lm", "dict_lm"):
        assert _plan_in(tmp_path, monkeypatch, f"{name}:{factory}", *tokens) == 0
        assert "activations included" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"got a tuple of \(a tensor of shape \(2, 1, 11\), "
                       r"NoneType\)\. Name your loss with --loss MODULE:FN"):  # fmt: skip
        _plan_in(tmp_path, monkeypatch, f"{name}:last_lm", *tokens)
    loss = ("--loss", f"{name}:last_token_loss")
    assert _plan_in(tmp_path, monkeypatch, f"{name}:last_lm", *tokens, *loss) == 0
    assert "activations included" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"plan --loss: add --tokens BxT"):
        _plan_in(tmp_path, monkeypatch, f"{name}:last_lm", "--world-size", "2", *loss)
    sys.modules.pop(name, None)


def test_help_is_whole(capsys):
    """The description was the docstring's first line, cut mid-sentence."""
    for argv in (["--help"], ["plan", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    for usage in ("funcshard plan MODULE:FACTORY", "funcshard demo", "checkpoint verify PATH"):
        assert usage in out
    assert "Run `funcshard COMMAND --help` for a command's options." in out
    assert "examples:" in out and "--tokens 8x1024" in out and "the current directory" in out
