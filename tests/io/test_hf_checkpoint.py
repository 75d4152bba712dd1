"""Hugging Face safetensors checkpoints into shards (`fs.checkpoint.load_hf`) and out of them
(`fs.checkpoint.save_hf`), with transformers' Llama (GQA, rotary buffers) and GPT-2 (tied
embeddings) built from tiny configs, their values perturbed so that no tensor is all ones or
zeros.

Run: `.venv/bin/python -m pytest tests/io/test_hf_checkpoint.py -q`.
"""

import functools
import json
import os
import re
import time

import pytest
import torch

import funcshard as fs
from funcshard import testing

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _config(name: str, layers: int = 2, hidden: int = 32):
    if name == "gpt2":
        return transformers.GPT2Config(
            vocab_size=64, n_embd=hidden, n_layer=layers, n_head=4, n_positions=16,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip


def _model(name: str, seed: int = 0, **sizes) -> torch.nn.Module:
    """The "pretrained" model: built on the CPU under `seed`, every parameter perturbed."""
    cls = transformers.GPT2LMHeadModel if name == "gpt2" else transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(_config(name, **sizes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _plan(model: torch.nn.Module) -> fs.Plan:
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return fs.plan(model, policy=fs.policy.module_classes({type(blocks[0])}))


def _skipped(name: str, mesh: fs.Mesh, **sizes) -> fs.ShardedState:
    """A meta-built state of zeros (rotary frequencies computed), for `load_hf` to fill."""
    cls = transformers.GPT2LMHeadModel if name == "gpt2" else transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = cls(_config(name, **sizes))
    return fs.shard(model, _plan(model), mesh, init=fs.skip(model._init_weights))


def _full(state: fs.ShardedState) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in fs.unshard(state).items()}


def _assert_params_equal(got: dict, model: torch.nn.Module) -> None:
    expected = dict(model.named_parameters())
    assert list(got) == list(expected)
    for fqn, value in expected.items():
        assert torch.equal(got[fqn], value), fqn


def _load(directories: list[str], name: str, world: int, rank: int) -> list[dict]:
    out = []
    for directory in directories:
        state = fs.checkpoint.load_hf(directory, like=_skipped(name, fs.Mesh(shard=world)))
        out.append({"params": _full(state), "buffers": dict(state.buffers)})
    return out


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_load_hf_at_2_and_3_ranks_unshards_to_the_saved_model_bitwise(name, tmp_path):
    """save_pretrained, one file and sharded with its index -> meta build -> load_hf."""
    model = _model(name)
    single, sharded = str(tmp_path / "single"), str(tmp_path / "sharded")
    model.save_pretrained(single, safe_serialization=True)
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="20KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    for world in (2, 3):
        load = functools.partial(_load, [single, sharded], name, world)
        for rank, results in enumerate(testing.run(load, world_size=world)):
            for result in results:
                _assert_params_equal(result["params"], model)
                for fqn, buffer in model.named_buffers():  # rotary frequencies, computed
                    assert torch.equal(result["buffers"][fqn], buffer), (world, rank, fqn)


def test_load_hf_takes_either_name_of_a_tied_pair(tmp_path):
    """GPT-2's files store transformer.wte.weight only; others store lm_head.weight, or both."""
    model = _model("gpt2")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    head = weights.pop("lm_head.weight")
    only_head = {k: v for k, v in weights.items() if k != "transformer.wte.weight"}
    layouts = {
        "head": {**only_head, "lm_head.weight": head},
        "both": {**weights, "lm_head.weight": head},
    }
    directories = []
    for label, tensors in layouts.items():
        os.makedirs(tmp_path / label)
        safetensors_torch.save_file(tensors, str(tmp_path / label / "model.safetensors"))
        directories.append(str(tmp_path / label))
    for results in testing.run(functools.partial(_load, directories, "gpt2", 2), world_size=2):
        for result in results:
            _assert_params_equal(result["params"], model)


def _hub_style_key(key: str) -> str:
    """GPT-2's keys as the original hub checkpoint has them: no `transformer.` prefix."""
    return key.removeprefix("transformer.")


def _rename_from_hub(key: str) -> str | None:
    if re.fullmatch(r"h\.\d+\.attn\.bias", key):  # the old causal-mask buffer: drop it
        return None
    return key if key == "lm_head.weight" else f"transformer.{key}"


def _without_embedding(key: str) -> str | None:
    return None if key == "wte.weight" else _rename_from_hub(key)


def _load_renamed(directory: str, rank: int) -> dict:
    like = _skipped("gpt2", fs.Mesh(shard=2))
    errors = []
    for rename in (None, _without_embedding):
        try:
            fs.checkpoint.load_hf(directory, like=like, rename=rename)
        except ValueError as e:
            errors.append(str(e))
    state = fs.checkpoint.load_hf(directory, like=like, rename=_rename_from_hub)
    return {"params": _full(state), "errors": errors}


def test_rename_maps_checkpoint_keys_to_fqns_and_drops_others(tmp_path):
    """A checkpoint keyed as the original GPT-2 on the hub (no `transformer.` prefix, the old
    attention-mask buffers): its keys are named in the error, and rename= fixes it."""
    model = _model("gpt2")
    tensors = {_hub_style_key(k): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tensors.update({f"h.{i}.attn.bias": torch.randn(1, 1, 16, 16) for i in range(2)})
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    for result in testing.run(functools.partial(_load_renamed, str(tmp_path)), world_size=2):
        _assert_params_equal(result["params"], model)
        without, dropped = result["errors"]
        assert "missing 'transformer.h.0.ln_1.weight'" in without
        assert "unexpected 'h.0.attn.bias', 'h.0.attn.c_attn.bias'" in without
        assert "rename=(key -> FQN or None)" in without
        assert (
            "missing 'transformer.wte.weight (or its tied name lm_head.weight)'; unexpected "
            "none; shape differs for none." in dropped
        )


def _load_cast(directory: str, rank: int) -> dict:
    state = fs.checkpoint.load_hf(directory, like=_skipped("llama", fs.Mesh(shard=2)))
    return {"params": _full(state), "dtypes": {s.dtype for s in state.shards}}


def test_a_bf16_checkpoint_is_cast_into_an_fp32_state(tmp_path):
    model = _model("llama")
    low = _model("llama").to(torch.bfloat16)
    low.save_pretrained(str(tmp_path), safe_serialization=True)
    expected = {k: v.to(torch.float32) for k, v in low.named_parameters()}
    for result in testing.run(functools.partial(_load_cast, str(tmp_path)), world_size=2):
        assert result["dtypes"] == {torch.float32}
        assert all(torch.equal(result["params"][k], v) for k, v in expected.items())
        assert not torch.equal(result["params"]["lm_head.weight"], model.lm_head.weight)


def _write_bad(tmp_path, model: torch.nn.Module) -> dict[str, str]:
    """One directory per bad input, each a copy of the model's checkpoint with one fault."""
    good = {k: v.clone() for k, v in model.state_dict().items()}
    cases = {
        "missing": {k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"},
        "extra": {**good, "model.layers.0.mlp.extra.weight": torch.randn(3, 4)},
        "shape": {**good, "model.norm.weight": torch.randn(31)},
        "header": good,
        "truncated": good,
    }
    directories = {}
    for case, tensors in cases.items():
        file = tmp_path / case / "model.safetensors"
        os.makedirs(file.parent)
        safetensors_torch.save_file(tensors, str(file), metadata={"format": "pt"})
        data = bytearray(file.read_bytes())
        if case == "header":
            data[12:24] = b"#" * 12  # inside the JSON header
        if case == "truncated":
            data = data[: len(data) - 1000]  # the last tensors' bytes are gone
        file.write_bytes(bytes(data))
        directories[case] = str(file.parent)
    return directories


def _load_each_bad(directories: dict[str, str], good: str, rank: int) -> dict:
    like = _skipped("llama", fs.Mesh(shard=2))
    errors = {}
    for case, directory in directories.items():
        try:
            fs.checkpoint.load_hf(directory, like=like)
            errors[case] = None
        except Exception as e:
            errors[case] = (type(e).__name__, str(e))
    try:  # a fault on one rank only: the other must raise too, not return and hang later
        fs.checkpoint.load_hf(good if rank == 0 else directories["truncated"], like=like)
        errors["one rank"] = None
    except Exception as e:
        errors["one rank"] = (type(e).__name__, str(e))
    return errors


def test_each_bad_input_raises_a_clear_error_on_every_rank(tmp_path):
    model = _model("llama")
    directories = _write_bad(tmp_path, model)
    good = str(tmp_path / "good")
    model.save_pretrained(good, safe_serialization=True)
    results = testing.run(functools.partial(_load_each_bad, directories, good), world_size=2)
    expected = {
        "missing": ("ValueError", "missing 'model.layers.1.mlp.up_proj.weight'"),
        "extra": ("ValueError", "unexpected 'model.layers.0.mlp.extra.weight'"),
        "shape": ("ValueError", "model.norm.weight: checkpoint (31,), model (32,)"),
        "header": ("CheckpointCorrupted", f"{directories['header']}/model.safetensors is "),
        "truncated": ("CheckpointCorrupted", f"{directories['truncated']}/model.safetensors is "),
        "one rank": ("CheckpointCorrupted", "funcshard.checkpoint.load_hf: on rank 1: "),
    }
    for rank, errors in enumerate(results):
        for case, (kind, words) in expected.items():
            assert errors[case] is not None, (rank, case)
            assert errors[case][0] == kind, (rank, case, errors[case])
            assert words in errors[case][1], (rank, case, errors[case][1])
        assert errors["missing"][1].startswith("funcshard.checkpoint.load_hf: ")
        assert "deserializing header" in errors["header"][1]  # safetensors' own words
        assert "not fully covered" in errors["truncated"][1]
        assert errors["one rank"][1].endswith(errors["truncated"][1].split(": ", 1)[1])
    assert results[0] == results[1]  # the same words on every rank


def _export(name: str, shape: tuple[int, int], out: str, max_shard_size: str, rank: int) -> list:
    model = _model(name)
    mesh = fs.Mesh(replicate=shape[0], shard=shape[1])
    if mesh.shard_size == 1:
        state = fs.replicate(model, mesh)
    else:
        state = fs.shard(model, _plan(model), mesh)
    fs.checkpoint.save_hf(out, state, config=model.config, max_shard_size=max_shard_size)
    return sorted(os.listdir(out))


def _assert_reloads_bitwise(name: str, out: str) -> None:
    model = _model(name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(model)
    _assert_params_equal(dict(reloaded.named_parameters()), model)
    tokens = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    loaded = {}
    for f in files:
        loaded.update(safetensors_torch.load_file(os.path.join(out, f)))
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if name == "llama":
        expected["lm_head.weight"] = model.lm_head.weight
    assert sorted(loaded) == sorted(expected)  # a tied weight once, under its first name
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_save_hf_from_3_ranks_reloads_with_from_pretrained_bitwise(name, tmp_path):
    out = str(tmp_path / "export")
    (listed, *_) = testing.run(functools.partial(_export, name, (1, 3), out, "5GB"), world_size=3)
    assert listed == ["config.json", "model.safetensors"]
    _assert_reloads_bitwise(name, out)
    if name == "gpt2":
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert reloaded.lm_head.weight is reloaded.transformer.wte.weight  # tied again


def test_save_hf_from_hsdp_and_ddp_split_into_files_with_an_index(tmp_path):
    """HSDP 2x2 writes sharded files and their index; a DDP export into the same directory,
    one file, leaves none of them behind; an export round-trips through load_hf."""
    out = str(tmp_path / "export")
    (listed, *_) = testing.run(
        functools.partial(_export, "llama", (2, 2), out, "20KB"),
        world_size=4,
    )
    shards = [f for f in listed if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)]
    assert len(shards) > 2 and "model.safetensors.index.json" in listed
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert sorted(set(index["weight_map"].values())) == shards
    assert not [f for f in listed if f.endswith(".tmp")]
    _assert_reloads_bitwise("llama", out)
    for results in testing.run(functools.partial(_load, [out], "llama", 2), world_size=2):
        _assert_params_equal(results[0]["params"], _model("llama"))

    (listed, *_) = testing.run(
        functools.partial(_export, "llama", (2, 1), out, "5GB"), world_size=2
    )
    assert listed == ["config.json", "model.safetensors"]
    _assert_reloads_bitwise("llama", out)


def _export_fails(out: str, rank: int) -> str:
    model = _model("gpt2")
    state = fs.shard(model, _plan(model), fs.Mesh(shard=2))
    try:
        fs.checkpoint.save_hf(out, state, config={"model_type": "gpt2"})
    except OSError as e:
        return str(e)
    return "no error"


def test_a_failed_export_raises_on_every_rank(tmp_path):
    """The first rank cannot create the directory (a file is in the way): every rank raises."""
    out = tmp_path / "export"
    out.write_text("not a directory")
    for message in testing.run(functools.partial(_export_fails, str(out)), world_size=2):
        assert message.startswith("funcshard.checkpoint.save_hf: on rank 0: writing"), message
        assert "failed: FileExistsError" in message


def _recorded_reads(directory: str, rank: int) -> dict:
    """Every slice load_hf asks safetensors for, on this rank."""
    import safetensors

    real, log = safetensors.safe_open, []

    class Slice:
        def __init__(self, view, key):
            self.view, self.key = view, key

        def get_shape(self):
            return self.view.get_shape()

        def get_dtype(self):
            return self.view.get_dtype()

        def __getitem__(self, index):
            log.append((self.key, index.start, index.stop))
            return self.view[index]

    class Handle:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_slice(self, key):
            return Slice(self.handle.get_slice(key), key)

        def get_tensor(self, key):
            log.append((key, None, None))
            return self.handle.get_tensor(key)

    like = _skipped("llama", fs.Mesh(shard=3))
    safetensors.safe_open = Handle
    try:
        state = fs.checkpoint.load_hf(directory, like=like)
    finally:
        safetensors.safe_open = real
    return {"reads": log, "shard_numel": sum(s.numel() for s in state.shards)}


def test_each_rank_reads_only_the_rows_that_cover_its_shards(tmp_path):
    model = _model("llama")
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    results = testing.run(functools.partial(_recorded_reads, str(tmp_path)), world_size=3)
    total = sum(v.numel() for v in model.state_dict().values())
    for result in results:
        assert all(start is not None for _, start, _ in result["reads"])  # nothing read whole
        row = {k: (s[1] if len(s) > 1 else 1) for k, s in shapes.items()}
        read = sum((stop - start) * row[k] for k, start, stop in result["reads"])
        slack = sum(2 * row[k] for k, _, _ in result["reads"])  # a partial row at each end
        assert read <= result["shard_numel"] + slack < total / 2, (read, result["shard_numel"])


def _peak_while_loading(directory: str, rank: int) -> dict:
    from funcshard.testing.memory import LiveTensors

    like = _skipped("llama", fs.Mesh(shard=2), layers=6, hidden=64)
    with LiveTensors() as meter:
        state = fs.checkpoint.load_hf(directory, like=like)
    return {
        "peak": meter.peak,
        "shards": sum(s.numel() * s.element_size() for s in state.shards),
        "unit": max(f.numel * f.dtype.itemsize for f in state.layout.flats),
        "model": sum(f.numel * f.dtype.itemsize for f in state.layout.flats),
    }


def test_loading_holds_the_shards_plus_at_most_one_unit(tmp_path):
    """Llama with 6 blocks at 2 ranks. The meter counts a mapped tensor's whole storage while
    a slice of it is alive (safetensors' slices view the mapped file), so it measures the new
    shards plus at most the largest tensor. Measured: 476,800 B = the shards' 460,416 + the
    16,384 of the embedding's mapping; the largest unit is 147,968 B, the model 920,832 B."""
    _model("llama", layers=6, hidden=64).save_pretrained(str(tmp_path), safe_serialization=True)
    for result in testing.run(functools.partial(_peak_while_loading, str(tmp_path)), 2):
        assert result["peak"] <= result["shards"] + 1.1 * result["unit"], result
        assert result["peak"] < result["model"], result


def _export_while_the_writer_is_slow(out: str, rank: int) -> list[str]:
    from datetime import timedelta
    from unittest import mock

    from funcshard.io import _hf_save as hf_save

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    state = fs.shard(model, fs.plan(model), fs.Mesh(shard=2, timeout=timedelta(seconds=1)))
    write = hf_save._Writer._write

    def slow(self, name, tensors):  # a slow file system: longer than the mesh's timeout
        time.sleep(2)
        write(self, name, tensors)

    with mock.patch.object(hf_save._Writer, "_write", slow):
        fs.checkpoint.save_hf(out, state)
    return sorted(os.listdir(out))


def test_the_other_ranks_wait_for_the_first_rank_writing_beyond_the_mesh_timeout(tmp_path):
    """The ranks that do not write waited for the writer in a collective, which the mesh's
    timeout (now 10 minutes by default) cut: a file that took longer to write failed the
    export with a CollectiveError. They now wait through the store, up to WRITE_TIMEOUT."""
    out = str(tmp_path / "export")
    listed = testing.run(functools.partial(_export_while_the_writer_is_slow, out), world_size=2)
    assert listed[0] == ["model.safetensors"]
    loaded = safetensors_torch.load_file(os.path.join(out, "model.safetensors"))
    assert sorted(loaded) == ["0.bias", "0.weight", "1.bias", "1.weight"]
