"""Run by tests/comm/test_mesh.py as plain `python`, no launcher variable set:
Mesh.from_env() makes a world of one process; one sharded SGD step equals plain PyTorch's."""

import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


mesh = fs.Mesh.from_env()
assert (mesh.size, dist.get_world_size(), dist.get_rank()) == (1, 1, 0), mesh
x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
model = _model()
state = fs.shard(model, fs.plan(model, policy=lambda m, name, n: name in {"0", "2"}), mesh)
opt = fs.optim.sgd(0.1)
loss, grads = fs.value_and_grad(lambda s, x: fs.call(model, s, x).square().mean())(state, x)
state, _ = opt.step(grads, opt.init(state), state)

reference = _model()
reference(x).square().mean().backward()
torch.optim.SGD(reference.parameters(), lr=0.1).step()
for name, p in fs.unshard(state).items():
    torch.testing.assert_close(p, dict(reference.named_parameters())[name].detach())
fs.shutdown()
print("OK", flush=True)
