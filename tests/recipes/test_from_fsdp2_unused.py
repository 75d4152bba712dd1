"""torch.optim's "no gradient" on funcshard (issue 51 item 2): parameters no rank used in a
step keep their values, moments and step counts, as torch.optim skips a parameter whose
`.grad` is None. Scenarios of FSDP2's test_fully_shard_training.py and
test_fully_shard_autograd.py, each against torch.optim on one process.
"""

import functools
import os
import tempfile

import torch
from torch import nn

import funcshard as fs
from funcshard import testing

WORLD = 2


class _Mlps(nn.Module):
    """FSDP2's three MLPs in a row; `first` runs the first alone (`model[0](x)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlps = nn.Sequential(
            *[nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(3)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlps(x)

    def first(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlps[0](x)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def _groups() -> fs.optim.Optimizer:
    """Clipping, then AdamW on matrices and no decay elsewhere, as two param groups."""
    decay = {"decay": fs.optim.adamw(1e-2, weight_decay=0.1), "plain": fs.optim.adam(1e-2)}
    labels = lambda fqn, p: "decay" if p.ndim >= 2 else "plain"  # noqa: E731
    return fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.partition(decay, labels))


def _reference_groups(model: nn.Module) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0}]
    return torch.optim.AdamW(groups, lr=1e-2)


def _optimizers() -> dict:
    """name -> (funcshard's, torch.optim's on a model, clip norm of the reference)."""
    return {
        "adam": (lambda: fs.optim.adam(1e-2), lambda m: torch.optim.Adam(m.parameters(), 1e-2), 0),
        "adamw": (
            lambda: fs.optim.adamw(1e-2, weight_decay=0.1),
            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
            0,
        ),
        "sgd": (
            lambda: fs.optim.sgd(1e-2, momentum=0.9, weight_decay=0.1),
            lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.1),
            0,
        ),
        "clip, groups": (_groups, _reference_groups, 0.5),
    }


STEPS = 10  # alternating: through the root, then through model[0] alone


def _non_root(kind: str, rank: int) -> dict:
    torch.manual_seed(42)
    model = _Mlps()
    units = {"mlps.0", "mlps.1", "mlps.2"}
    plan = fs.plan(model, policy=lambda module, name, numel: name in units)
    mesh = fs.Mesh(shard=WORLD) if kind == "fsdp" else fs.Mesh(replicate=WORLD)
    out: dict = {}
    for name, (make, _, _) in _optimizers().items():
        for unused in ("skip", "zeros"):
            # DDP: buckets of parameters (one here), so a bucket holds used and unused ones
            state = fs.shard(model, plan, mesh) if kind == "fsdp" else fs.replicate(model, mesh)
            opt = make()
            opt_state = opt.init(state)
            seen = []
            for step in range(STEPS):
                method = "forward" if step % 2 == 0 else "first"
                loss = lambda s, x, m=method: fs.call(model, s, x, method=m).sum()  # noqa: E731
                _, grads = fs.value_and_grad(loss, unused=unused)(state, _batch(rank, step))
                seen.append(sorted(grads.unused))
                state, opt_state = opt.step(grads, opt_state, state)
            skipped = getattr(opt_state, "skipped_steps", {})
            out[name, unused] = fs.unshard(state), seen, {f: int(n) for f, n in skipped.items()}
    return out


def _reference(name: str, zeros: bool) -> dict:
    """torch.optim on one process, the ranks' batches as one (the loss their mean), its
    grads cleared to None (FSDP2's `zero_grad()`), or zeroed with `zeros`."""
    torch.manual_seed(42)
    model = _Mlps()
    _, make, clip = _optimizers()[name]
    opt = make(model)
    for step in range(STEPS):
        run = model if step % 2 == 0 else model.first
        batches = [_batch(rank, step) for rank in range(WORLD)]
        (sum(run(x).sum() for x in batches) / WORLD).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=not zeros)
    return {k: v.detach() for k, v in model.named_parameters()}


def _check_non_root(kind: str) -> None:
    results = testing.run(functools.partial(_non_root, kind), world_size=WORLD)
    later = sorted(f"mlps.{i}.{j}.{w}" for i in (1, 2) for j in (0, 2) for w in ("bias", "weight"))
    for name in _optimizers():
        for unused in ("skip", "zeros"):
            expected = _reference(name, zeros=unused == "zeros")
            for out in results:
                params, seen, skipped = out[name, unused]
                for fqn, p in params.items():
                    torch.testing.assert_close(p, expected[fqn], rtol=1e-5, atol=1e-6, msg=fqn)
                if unused == "skip":
                    assert seen == [[], later] * (STEPS // 2), seen
                    if name in ("adam", "adamw"):
                        assert {f: n for f, n in skipped.items() if n} == dict.fromkeys(
                            later, STEPS // 2
                        )
                else:
                    assert seen == [[]] * STEPS


def test_non_root_forward_backward():
    """test_fully_shard_training.py::test_non_root_forward_backward: a step through the root,
    then one through `model[0]` alone, 10 steps of Adam, AdamW, SGD with momentum and
    weight decay, and clipping then two param groups (`chain`, `partition`), each equal to
    torch.optim with `zero_grad(set_to_none=True)`; and with
    `unused="zeros"` equal to torch.optim with `set_to_none=False` (the old behaviour)."""
    _check_non_root("fsdp")


def test_non_root_forward_backward_ddp():
    """The same rule on a replicated (DDP) state: one engine, other mesh axes."""
    _check_non_root("ddp")


class _DoubleLinear(nn.Module):
    """FSDP2's DoubleLinear with a second output the loss may leave out, and a parameter of
    the root's unit that every step uses, beside `lin2` that most do not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.lin1(x)) * self.scale, torch.relu(self.lin2(x))


def _uses_second(rank: int, step: int) -> bool:
    return step == 2 and rank == 0  # one rank, one step: used, so every rank updates it


def _loss(model: nn.Module, rank: int, step: int, out: tuple) -> torch.Tensor:
    return out[0].sum() + (out[1].sum() if _uses_second(rank, step) else 0)


def _unused_output(directory: str, rank: int) -> dict:
    torch.manual_seed(42)
    model = _DoubleLinear()
    plan = fs.plan(model, policy=lambda module, name, numel: name == "lin1")
    out: dict = {}
    for reshard in (True, False):
        state = fs.shard(model, plan, fs.Mesh(shard=WORLD), reshard_after_forward=reshard)
        opt = fs.optim.adam(1e-2)
        opt_state, seen = opt.init(state), []
        for step in range(4):
            f = lambda s, x, step=step: _loss(model, rank, step, fs.call(model, s, x))  # noqa: E731
            _, grads = fs.value_and_grad(f)(state, _batch(rank, step))
            seen.append(sorted(grads.unused))
            state, opt_state = opt.step(grads, opt_state, state)
        out[reshard] = fs.unshard(state), seen
    # micro-batches: used in any is used (accumulate, then reduce agrees it over the ranks)
    local = [
        fs.value_and_grad(
            lambda s, x, step=step: _loss(model, rank, step, fs.call(model, s, x)), reduce=False
        )(state, _batch(rank, step))[1]
        for step in (1, 2, 3)
    ]
    out["local"] = sorted(local[0].unused), sorted(local[1].unused)
    out["reduced"] = [
        sorted(fs.reduce(state, functools.reduce(fs.accumulate, local[a:b])).unused)
        for a, b in ((0, 1), (0, 2), (2, 3))
    ]
    # a unit kept local (keep_local): the usage travels to the reduce that finishes it
    kept = fs.value_and_grad(
        lambda s, x: _loss(model, rank, 1, fs.call(model, s, x)), keep_local=("lin1",)
    )(state, _batch(rank, 1))[1]
    out["kept local"] = sorted(fs.reduce(state, fs.accumulate(kept, kept)).unused)
    # the counts checkpoint by name; a checkpoint written before they existed loads as zeros
    fs.checkpoint.save(os.path.join(directory, "now"), state, opt_state, step=4)
    old_format = opt_state.__class__(opt_state.step, opt_state.exp_avg, opt_state.exp_avg_sq, {})
    fs.checkpoint.save(os.path.join(directory, "before"), state, old_format, step=4)
    like = (state, opt.init(state))
    for name in ("now", "before"):
        loaded = fs.checkpoint.load(os.path.join(directory, name), like)[1]
        out[name] = {f: int(n) for f, n in loaded.skipped_steps.items()}
    out["saved"] = {f: int(n) for f, n in opt_state.skipped_steps.items()}
    return out


def _reference_unused_output() -> dict:
    torch.manual_seed(42)
    model = _DoubleLinear()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(4):
        losses = [_loss(model, r, step, model(_batch(r, step))) for r in range(WORLD)]
        (sum(losses) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.named_parameters()}


def test_unused_forward_output():
    """test_fully_shard_autograd.py::test_unused_forward_output: an output the loss leaves
    out, its parameters in the root's unit beside one every step uses (so a unit's buffer
    is partly skipped), resharded after forward or not; on one step one rank uses it (then
    every rank updates it, with the mean gradient). Equal to torch.optim.Adam; the usage
    combines over micro-batches (also with units kept local) and the counts survive
    checkpoints, old ones loading."""
    expected = _reference_unused_output()
    lin2 = ["lin2.bias", "lin2.weight"]
    with tempfile.TemporaryDirectory() as directory:
        results = testing.run(functools.partial(_unused_output, directory), world_size=WORLD)
    for out in results:
        for reshard in (True, False):
            params, seen = out[reshard]
            assert seen == [lin2, lin2, [], lin2], seen
            for fqn, p in params.items():
                torch.testing.assert_close(p, expected[fqn], rtol=1e-5, atol=1e-6, msg=fqn)
        assert out["reduced"] == [lin2, [], lin2], out["reduced"]
        assert out["kept local"] == lin2, out["kept local"]
        assert out["saved"] == {"lin1.weight": 0, "lin1.bias": 0, "lin2.weight": 3,
                                "lin2.bias": 3, "scale": 0}  # fmt: skip
        assert out["now"] == out["saved"]
        assert out["before"] == dict.fromkeys(out["saved"], 0)
    assert results[0]["local"] == (lin2, []) and results[1]["local"] == (lin2, lin2)
