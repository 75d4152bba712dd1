"""A checkpoint read in one process with no mesh: `read_meta` (step and extra, tensors in
extra included) and `export_state_dict` (a plain `torch.save` file of the full state dict),
and the CLI's `funcshard checkpoint export`."""

import functools
import json
import os

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.cli._main import main


class Tied(nn.Module):
    """A tiny model with a tied head, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(13, 6)
        self.body = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 6))
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("scale", torch.rand(3))
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.scale.copy_(torch.tensor([0.5, 1.5, 2.5]))
            self.cache.zero_()

    def forward(self, idx):
        return self.head(self.body(self.wte(idx)) * self.scale.sum())


def _save(path: str, rank: int) -> dict:
    world = 2
    with torch.device("meta"):
        model = Tied()
    plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
    state = fs.shard(model, plan, fs.Mesh(shard=world), seed=3)
    out: dict = {}
    with pytest.raises(TypeError) as bad:  # neither JSON nor a tensor: refused on every rank
        fs.checkpoint.save(path, state, step=1, extra={"cfg": {"d": 6}, "loader": object()})
    out["bad"] = str(bad.value)
    out["after_bad"] = sorted(os.listdir(path)) if os.path.exists(path) else []
    g = torch.Generator().manual_seed(100 + rank)
    extra = {
        "cfg": {"n_embd": 6, "vocab": 13},
        "rng": torch.randint(1 << 30, (5,), generator=g),  # differs across ranks: per rank
        "shared": [torch.arange(4.0) * 1.25, "kept"],  # the same on every rank: once
    }
    fs.checkpoint.save(path, state, step=7, extra=extra)
    fs.checkpoint.save(path + "-shared", state, step=7, extra={"model_args": {"n_embd": 6}})
    out["extra"] = extra
    out["full"] = fs.full_state_dict(state)
    _, _, step, loaded = fs.checkpoint.load(path, like=(state, None))
    out["loaded"] = (step, loaded)
    return out


def test_read_meta_and_export_in_one_process(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    ranks = testing.run(functools.partial(_save, path), world_size=2)
    first = ranks[0]
    assert "extra['loader']" in first["bad"] and "extra['loader']" in ranks[1]["bad"]
    assert first["after_bad"] == [] and ranks[1]["after_bad"] == []  # nothing written

    # load on the saving mesh: each rank its own tensors, bitwise
    for r in ranks:
        step, extra = r["loaded"]
        assert step == 7 and extra["cfg"] == {"n_embd": 6, "vocab": 13}
        assert torch.equal(extra["rng"], r["extra"]["rng"])
        assert torch.equal(extra["shared"][0], r["extra"]["shared"][0])
        assert extra["shared"][1] == "kept"

    # read_meta: no mesh, no model; a per-rank tensor needs its rank
    with pytest.raises(ValueError, match="rank="):
        fs.checkpoint.read_meta(path)
    for rank in (0, 1):
        step, extra = fs.checkpoint.read_meta(path, rank=rank)
        assert step == 7 and extra["cfg"]["vocab"] == 13
        assert torch.equal(extra["rng"], ranks[rank]["extra"]["rng"])
        assert torch.equal(extra["shared"][0], torch.arange(4.0) * 1.25)

    # export: the unsharded state dict, bitwise, tied weights sharing storage
    out = str(tmp_path / "ckpt.pt")
    fs.checkpoint.export_state_dict(path, out)
    exported = torch.load(out, weights_only=True)
    full = first["full"]
    assert list(exported) == list(full) == list(Tied().state_dict())
    for k, v in full.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    assert exported["head.weight"].data_ptr() == exported["wte.weight"].data_ptr()
    fresh = Tied()
    fresh.load_state_dict(exported, strict=True)
    assert fresh.head.weight is fresh.wte.weight and torch.equal(fresh.scale, full["scale"])

    # under=: nanoGPT's ckpt.pt layout, the save's extra beside the state dict
    nano = str(tmp_path / "nano.pt")
    fs.checkpoint.export_state_dict(path + "-shared", nano, under="model")
    wrapped = torch.load(nano, weights_only=True)
    assert list(wrapped) == ["model", "model_args"] and wrapped["model_args"] == {"n_embd": 6}
    assert all(torch.equal(wrapped["model"][k], v) for k, v in full.items())
    with pytest.raises(ValueError, match="holds a key 'model_args'"):
        fs.checkpoint.export_state_dict(path + "-shared", nano, under="model_args", overwrite=True)
    with pytest.raises(ValueError, match=r"under='model'.*rank="):  # extra differs per rank
        fs.checkpoint.export_state_dict(path, nano, under="model", overwrite=True)

    # bad input: an existing output, a directory that is no funcshard checkpoint
    with pytest.raises(FileExistsError, match="overwrite=True"):
        fs.checkpoint.export_state_dict(path, out)
    fs.checkpoint.export_state_dict(path, out, overwrite=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="safetensors"):
        fs.checkpoint.export_state_dict(str(plain), str(tmp_path / "x.pt"))
    with pytest.raises(ValueError, match="is a file"):
        fs.checkpoint.read_meta(out)
    # exists: a resume check; False where nothing was saved yet, a file raises as load would
    assert fs.checkpoint.exists(path) and not fs.checkpoint.exists(tmp_path / "never")
    assert not fs.checkpoint.exists(plain)
    with pytest.raises(ValueError, match="is a file"):
        fs.checkpoint.exists(out)
    assert not os.path.exists(tmp_path / "x.pt")

    # the CLI: funcshard checkpoint export PATH OUT [--overwrite]
    cli_out = str(tmp_path / "sample" / "ckpt.pt")
    assert main(["checkpoint", "export", path, cli_out]) == 0
    assert all(torch.equal(torch.load(cli_out, weights_only=True)[k], v) for k, v in full.items())
    assert main(["checkpoint", "export", path, cli_out]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["checkpoint", "export", path, cli_out, "--overwrite"]) == 0
    assert main(["checkpoint", "export", path + "-shared", cli_out, "--overwrite",
                 "--under", "model"]) == 0  # fmt: skip
    assert torch.load(cli_out, weights_only=True)["model_args"] == {"n_embd": 6}
    assert main(["checkpoint", "export", str(plain), str(tmp_path / "y.pt")]) == 2

    # a checkpoint saved before funcshard.json recorded shapes and ties: export with model=
    with open(os.path.join(path, "LATEST")) as f:
        meta_path = os.path.join(path, f.read().strip(), "funcshard.json")
    with open(meta_path) as f:
        meta = json.load(f)
    del meta["model"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    older = str(tmp_path / "older.pt")
    with pytest.raises(ValueError, match="model="):
        fs.checkpoint.export_state_dict(path, older, verify=False)
    with torch.device("meta"):
        like = Tied()
    fs.checkpoint.export_state_dict(path, older, model=like, verify=False)
    again = torch.load(older, weights_only=True)
    assert list(again) == list(full) and all(torch.equal(again[k], v) for k, v in full.items())
    assert again["head.weight"].data_ptr() == again["wte.weight"].data_ptr()
