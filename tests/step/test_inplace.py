"""In-place writes to gathered parameters inside a sharded call are refused by name (see
[Note: in-place writes to gathered parameters] in funcshard/step/_inplace.py)."""

import torch
from torch import nn

import funcshard as fs
from funcshard import testing


class Bumps(nn.Module):
    """Writes its child's weight in place in forward: fine in a plain module, not in a call
    on a sharded state, whose parameters are gathered for that call only."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.write:
            self.lin.weight.add_(1)
        return self.lin(x)


class Net(nn.Module):
    def __init__(self, write: bool) -> None:
        super().__init__()
        self.body = Bumps(write)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _state(model: nn.Module, kind: str) -> fs.ShardedState:
    if kind == "ddp":
        return fs.replicate(model, fs.Mesh(replicate=2))
    plan = fs.plan(model, policy=fs.policy.module_classes({Bumps}))
    return fs.shard(model, plan, fs.Mesh(shard=2))


def _write_in_forward(rank: int) -> dict:
    out = {}
    for kind in ("fsdp", "ddp"):
        torch.manual_seed(0)
        model = Net(write=True)
        state = _state(model, kind)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
        step = fs.value_and_grad(lambda s, x, model=model: fs.call(model, s, x).sum())
        try:
            step(state, x)
            out[kind] = None
        except ValueError as e:
            out[kind] = str(e)
        model.body.write = False  # the same state and model work once the write is gone
        out[kind + " then"] = step(state, x)[0].item()
    return out


def test_an_in_place_write_to_a_gathered_parameter_is_refused_naming_module_and_parameter():
    """`self.lin.weight.add_(1)` in a forward surfaced as torch's "Output 0 of
    _GatherBackward is a view and is being modified inplace ... cloning the output of the
    custom Function", naming neither module nor parameter (FSDP and DDP states alike)."""
    for r in testing.run(_write_in_forward, world_size=2):
        for kind in ("fsdp", "ddp"):
            message = r[kind]
            assert message is not None, kind
            assert message.startswith(
                "funcshard.call: parameters unchanged inside a sharded call, got module 'body' "
                "(Bumps) wrote 'body.lin.weight' in place."
            ), message
            assert "register_buffer" in message, message
            assert isinstance(r[kind + " then"], float)
