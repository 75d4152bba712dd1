"""Real transformers models train sharded as they train in one plain process.

Each model is built from a tiny config (hidden 32, 2 layers, vocab 64) on every rank under the
same seed, and trained 2 steps with `fs.optim.adamw` on its rank's part of a global batch; a
plain PyTorch copy trains on the whole batch with `torch.optim.AdamW`. Losses and final
parameters agree to a relative 1e-5 (fp32).

| model (transformers class)            | what it brings               | FSDP 2 | DDP 2 | HSDP 2x2 |
|---------------------------------------|------------------------------|--------|-------|----------|
| GPT-2 (GPT2LMHeadModel)               | tied embeddings, dropout 0   | yes    | yes   |          |
| Llama (LlamaForCausalLM)              | GQA (2 KV heads of 4), RoPE  | yes    | yes   | yes      |
| T5 (T5ForConditionalGeneration)       | encoder-decoder, tied 4 ways | yes    | yes   |          |
| ResNet (ResNetForImageClassification) | BatchNorm                    | yes    | yes   | yes      |

BatchNorm normalizes by each rank's own micro-batch, so its reference runs each rank's
micro-batch on its own and averages the gradients (data parallelism without SyncBatchNorm);
each rank's `state.buffers` are its own running statistics, never synchronized, and
`fs.full_state_dict` and `fs.checkpoint.save` keep the first rank's.

Also, on FSDP-2: transformers' own gradient checkpointing gives the same gradients through
`fs.value_and_grad` (GPT-2, Llama, T5); `fs.call(model, state, ..., method="generate")` equals
the plain model's greedy `generate` (GPT-2, Llama, T5), also when ranks stop at different
steps (eos at different steps, different `max_new_tokens`: funcshard passes transformers'
`synced_gpus=True`, see [Note: generate across ranks] in funcshard/step/_sharded_call.py); and a
hand-made LoRA on Llama's q_proj/v_proj (frozen base, trainable adapters in one module) trains
with parity, three ways: adapters as units of their own (frozen units take no gradient
memory), `plan(frozen="split")` (one unit per block, its frozen members in flat buffers of
their own: no gradient memory either) and `plan(frozen="warn")` (its frozen members get
zeroed gradient memory); with activation checkpointing on (transformers' own), "split" and
peft's LoRA (`get_peft_model`, `frozen="split"`) train with parity too.

Run: `.venv/bin/python -m pytest tests/recipes/test_hf_models.py -q`.
"""

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.core._layout import frozen_ranges

transformers = pytest.importorskip("transformers")

STEPS = 2
PER_RANK = 2  # examples per data-parallel rank and step
LR, EPS, WD = 1e-2, 1e-3, 0.01
MODELS = ("gpt2", "llama", "t5", "resnet")


def _build(name: str) -> tuple[nn.Module, type[nn.Module]]:
    """The model, built on the CPU under seed 0 (every rank alike), and its block class."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.resnet.modeling_resnet import ResNetStage
    from transformers.models.t5.modeling_t5 import T5Block

    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config), GPT2Block
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config), LlamaDecoderLayer
    if name == "t5":
        config = transformers.T5Config(
            vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
        return transformers.T5ForConditionalGeneration(config), T5Block
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
        layer_type="basic", num_labels=5,
    )  # fmt: skip
    return transformers.ResNetForImageClassification(config), ResNetStage


def _batch(name: str, step: int, n: int) -> dict[str, torch.Tensor]:
    """The global batch of a step: `n` examples as the model's keyword arguments."""
    g = torch.Generator().manual_seed(100 + step)
    if name == "resnet":
        images = torch.randn(n, 3, 16, 16, generator=g)
        return {"pixel_values": images, "labels": torch.randint(5, (n,), generator=g)}
    tokens = torch.randint(64, (n, 8), generator=g)
    if name == "t5":
        return {"input_ids": tokens, "labels": torch.randint(64, (n, 5), generator=g)}
    return {"input_ids": tokens, "labels": tokens}  # causal LMs shift the labels themselves


def _part(batch: dict[str, torch.Tensor], i: int, parts: int) -> dict[str, torch.Tensor]:
    return {k: v.chunk(parts)[i] for k, v in batch.items()}


def _loss(model: nn.Module, state, batch: dict[str, torch.Tensor]):
    out, buffers = fs.call(model, state, mutable=True, **batch)
    return out.loss, buffers


def _state(model: nn.Module, block: type[nn.Module], mesh: fs.Mesh):
    """DDP on a mesh without a shard axis, else one unit per block."""
    if mesh.shard_size == 1:
        return fs.replicate(model, mesh)
    plan = fs.plan(model, policy=fs.policy.module_classes({block}))
    return fs.shard(model, plan, mesh)


def _train(model: nn.Module, state, name: str, rank: int):
    """STEPS AdamW steps on this rank's part of each global batch, buffers threaded through:
    the state after them, the loss over all ranks per step, and the last step's gradients."""
    mesh = state.layout.mesh
    opt = fs.optim.adamw(LR, eps=EPS, weight_decay=WD)
    opt_state = opt.init(state)
    step_fn = fs.value_and_grad(functools.partial(_loss, model), has_aux=True)
    losses = []
    for step in range(STEPS):
        batch = _part(_batch(name, step, PER_RANK * mesh.size), rank, mesh.size)
        (loss, buffers), grads = step_fn(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state.replace(buffers=buffers))
        state = fs.apply_updates(state.replace(buffers=buffers), updates)
        losses.append(fs.pmean(loss.detach(), mesh).item())
    return state, losses, grads


def _reference(model: nn.Module, name: str, ranks: int, parts: int) -> dict:
    """Plain PyTorch training on the whole batch, as `parts` micro-batches whose gradients
    are averaged, each with its own copy of the buffers (the ranks' running statistics)."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS, weight_decay=WD
    )
    buffers = [{k: b.clone() for k, b in model.named_buffers()} for _ in range(parts)]
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        batch = _batch(name, step, PER_RANK * ranks)
        for i in range(parts):
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(buffers[i][k])
            loss = model(**_part(batch, i, parts)).loss / parts
            loss.backward()
            total += loss.item()
            buffers[i] = {k: b.clone() for k, b in model.named_buffers()}
        opt.step()
        losses.append(total)
    params = {k: p.detach() for k, p in model.named_parameters()}
    return {"losses": losses, "params": params, "buffers": buffers}


def _errors(full: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: the largest difference relative to the largest reference value."""
    assert full.keys() == ref.keys(), (sorted(full), sorted(ref))
    return {k: ((full[k] - p).abs().max() / p.abs().max()).item() for k, p in ref.items()}


def _parity(name: str, meshes: tuple[dict, ...], rank: int) -> list[dict]:
    """Train on each mesh (all of this pool's ranks); compare with the plain reference."""
    results = []
    for mesh_options in meshes:
        model, block = _build(name)
        mesh = fs.Mesh(**mesh_options)
        state, losses, _ = _train(model, _state(model, block, mesh), name, rank)
        batch_stats = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        ref = _reference(model, name, mesh.size, mesh.size if batch_stats else 1)
        result = {
            "mesh": " ".join(f"{k}={v}" for k, v in mesh_options.items()),
            "losses": losses,
            "ref_losses": ref["losses"],
            "errors": _errors(fs.unshard(state), ref["params"]),
        }
        if batch_stats:  # this rank's running statistics: its own micro-batches'
            mine = ref["buffers"][rank]
            result["buffer_errors"] = {
                k: (v.double() - mine[k].double()).abs().max().item()
                for k, v in state.buffers.items()
            }
            result["buffers"] = state.buffers
            result["full_state_dict"] = fs.full_state_dict(state)
        results.append(result)
    return results


def _check_parity(results: list[list[dict]]) -> None:
    for rank, per_mesh in enumerate(results):
        for r in per_mesh:
            worst = max(r["errors"], key=r["errors"].get)
            where = f"{r['mesh']}, rank {rank}"
            assert r["errors"][worst] < 1e-5, f"{where}: {worst} off by {r['errors'][worst]:.2e}"
            for ours, ref in zip(r["losses"], r["ref_losses"], strict=True):
                assert ours == pytest.approx(ref, rel=1e-5), where
            if "buffers" in r:
                worst = max(r["buffer_errors"], key=r["buffer_errors"].get)
                assert r["buffer_errors"][worst] < 1e-5, f"{where}: buffer {worst}"
    for i, first in enumerate(results[0]):
        if "buffers" not in first:
            continue
        key = "resnet.embedder.embedder.normalization.running_mean"
        own = [per_mesh[i]["buffers"][key] for per_mesh in results]
        assert not torch.equal(own[0], own[1]), "the ranks' statistics should differ"
        assert torch.equal(first["full_state_dict"][key], own[0])  # the first rank's
        assert all(per_mesh[i]["full_state_dict"] is None for per_mesh in results[1:])


@pytest.mark.parametrize("name", MODELS)
def test_fsdp_and_ddp_training_match_one_plain_process(name):
    meshes = ({"shard": 2}, {"replicate": 2})
    _check_parity(testing.run(functools.partial(_parity, name, meshes), world_size=2))


@pytest.mark.parametrize("name", ["llama", "resnet"])
def test_hsdp_training_matches_one_plain_process(name):
    meshes = ({"replicate": 2, "shard": 2},)
    _check_parity(testing.run(functools.partial(_parity, name, meshes), world_size=4))


def _checkpointed_grads(name: str, rank: int) -> dict:
    """FSDP-2 gradients of one step with and without transformers' gradient checkpointing,
    and how often the first block's first leaf module ran forward in each (transformers 5
    checkpoints the block's `forward`, not its `__call__`, so the block's own hooks do not
    run again; its children's do)."""
    model, block = _build(name)
    state = _state(model, block, fs.Mesh(shard=2))
    with torch.no_grad():  # the model's own tensors are not the state's, as after training:
        for p in model.parameters():  # a recomputation that read them would be caught
            p.normal_()
    batch = _part(_batch(name, 0, 4), rank, 2)
    calls = []
    first = next(m for m in model.modules() if isinstance(m, block))
    leaf = next(m for m in first.modules() if list(m.parameters(recurse=False)))
    leaf.register_forward_pre_hook(lambda module, args: calls.append(1))
    step_fn = fs.value_and_grad(functools.partial(_loss, model), has_aux=True)
    (plain_loss, _), plain = step_fn(state, batch)
    plain_calls = len(calls)
    enable = getattr(model, "activation_checkpointing_enable", None)  # the 5.x name
    (enable or model.gradient_checkpointing_enable)()
    (loss, _), checkpointed = step_fn(state, batch)
    return {
        "calls": (plain_calls, len(calls) - plain_calls),
        "losses": (plain_loss.item(), loss.item()),
        "relative_diff": max(
            ((a - b).abs().max() / a.abs().max()).item()
            for a, b in zip(plain.shards, checkpointed.shards, strict=True)
        ),
    }


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_transformers_gradient_checkpointing_gives_the_same_gradients(name):
    for r in testing.run(functools.partial(_checkpointed_grads, name), world_size=2):
        assert r["calls"] == (1, 2), r  # recomputed in backward: really checkpointed
        # equal up to rounding: T5's plain model too differs in the last bit with it on
        assert r["losses"][0] == pytest.approx(r["losses"][1], rel=1e-6)
        assert r["relative_diff"] < 1e-5, r


def _prompt(name: str, rank: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + rank)
    return torch.randint(2, 64, (2, length), generator=g)


def _generate(name: str, rank: int) -> dict:
    """Greedy generation on an FSDP-2 state and on the plain model; each rank its prompts
    (and for causal LMs its prompt length)."""
    model, block = _build(name)
    state = _state(model, block, fs.Mesh(shard=2))
    prompt = _prompt(name, rank, 4 + rank)
    options = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    ours = fs.call(model, state, prompt, method="generate", **options)
    return {"ours": ours, "plain": model.generate(prompt, **options)}


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_generate_on_a_state_equals_the_plain_models(name):
    for r in testing.run(functools.partial(_generate, name), world_size=2, timeout=60):
        assert torch.equal(r["ours"], r["plain"]), r


def _stopping_at_different_steps(rank: int) -> dict:
    """Rank 0 stops early (its eos after one token, or max_new_tokens=2), rank 1 runs 6
    tokens: the ranks' generate loops would run different numbers of forwards."""
    model, block = _build("llama")
    state = _state(model, block, fs.Mesh(shard=2))
    prompt = _prompt("llama", rank, 5)[:1]  # (1, 5)
    greedy = {"do_sample": False, "pad_token_id": 0}
    free = model.generate(prompt, max_new_tokens=6, **greedy)[:, 5:]  # (1, 6)
    eos = free[0, 0].item() if rank == 0 else min(set(range(64)) - set(free.flatten().tolist()))
    cases = {
        "eos": {"max_new_tokens": 6, "eos_token_id": eos},
        "max_new_tokens": {"max_new_tokens": 2 if rank == 0 else 6, "eos_token_id": None},
    }
    out = {}
    for case, options in cases.items():
        ours = fs.call(model, state, prompt, method="generate", **options, **greedy)
        out[case] = (ours, model.generate(prompt, **options, **greedy))
    return out


def test_generate_with_ranks_stopping_at_different_steps_finishes_and_equals_plain():
    """Broke: rank 0's generate returned while rank 1's still ran forwards, whose all-gathers
    met whatever rank 0 issued next (gloo aborted on mismatched shapes) or nothing (a hang)."""
    results = testing.run(_stopping_at_different_steps, world_size=2, timeout=30)
    for rank, r in enumerate(results):
        for case, (ours, plain) in r.items():
            assert torch.equal(ours, plain), (rank, case, ours, plain)
    assert results[0]["eos"][0].shape[1] == 5 + 1 and results[1]["eos"][0].shape[1] == 5 + 6
    assert results[0]["max_new_tokens"][0].shape[1] == 5 + 2
    assert results[1]["max_new_tokens"][0].shape[1] == 5 + 6


class LoRA(nn.Module):
    """A low-rank update `scale * B(A(x))` (Hu et al., 2021)."""

    def __init__(self, features_in: int, features_out: int, r: int = 4, alpha: float = 8.0):
        super().__init__()
        self.A = nn.Linear(features_in, r, bias=False)
        self.B = nn.Linear(r, features_out, bias=False)
        nn.init.normal_(self.B.weight, std=0.02)  # (LoRA starts B at zero; random here, so
        self.scale = alpha / r  # that A's gradient is not zero in the first step)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.B(self.A(x))


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable LoRA: both in one module."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.lora = LoRA(base.in_features, base.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora(x)


def _lora_llama() -> tuple[nn.Module, type[nn.Module]]:
    model, block = _build("llama")
    model.requires_grad_(False)
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.q_proj = LoRALinear(attention.q_proj)
        attention.v_proj = LoRALinear(attention.v_proj)
    return model, block


def _peft_llama() -> tuple[nn.Module, type[nn.Module]]:
    """peft's LoRA on Llama's q_proj and v_proj (B drawn, not zero, so every adapter moves)."""
    peft = pytest.importorskip("peft")
    model, block = _build("llama")
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    return peft.get_peft_model(model, config), block


def _lora(how: str, rank: int) -> dict:
    how, _, checkpointing = how.partition(" + ")
    model, block = _peft_llama() if how == "peft" else _lora_llama()
    if checkpointing:  # before the reference copies the model: it recomputes the same way
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    how = "frozen=split" if how == "peft" else how
    frozen = [k for k, p in model.named_parameters() if not p.requires_grad]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "adapter units":  # each LoRA its own unit: the block's rest is all frozen
            policy = fs.policy.module_classes({LoRA, block})
            plan = fs.plan(model, policy=policy)
        else:  # one unit per block mixing frozen and trainable members
            frozen_option = how.removeprefix("frozen=")
            plan = fs.plan(model, policy=fs.policy.module_classes({block}), frozen=frozen_option)
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    before = fs.unshard(state)
    state, losses, grads = _train(model, state, "llama", rank)
    ref = _reference(model, "llama", 2, 1)
    after = fs.unshard(state)
    flats = state.layout.flats
    return {
        "warned": [str(w.message) for w in caught],
        "losses": losses,
        "ref_losses": ref["losses"],
        "errors": _errors(after, ref["params"]),
        "frozen_moved": [k for k in frozen if not torch.equal(before[k], after[k])],
        "trainable_moved": all(
            not torch.equal(before[k], after[k]) for k in after if k not in frozen
        ),
        # gradient memory: elements of this rank's ShardedGrads, and those of frozen members
        "grad_numel": sum(g.numel() for g in grads.shards if g is not None),
        "trainable_numel": sum(
            n
            for flat in flats
            for f, n in zip(flat.fqns, flat.numels, strict=True)
            if f not in frozen
        ),
        "frozen_flats_without_grads": all(
            g is None for g, flat in zip(grads.shards, flats, strict=True) if flat.frozen
        ),
        "frozen_in_frozen_flats": sorted(f for flat in flats if flat.frozen for f in flat.fqns)
        == sorted(frozen),
        "frozen_members_grads": [
            g[s].abs().max().item()
            for g, flat in zip(grads.shards, flats, strict=True)
            if g is not None and flat.frozen_fqns
            for s in frozen_ranges(flat, rank * flat.shard_numel, (rank + 1) * flat.shard_numel)
        ],
    }


@pytest.mark.parametrize(
    "how",
    [
        "adapter units",
        "frozen=split",
        "frozen=warn",
        "frozen=split + checkpointing",
        "peft + checkpointing",
    ],
)
def test_lora_adapters_beside_frozen_weights_train_like_one_plain_process(how):
    """With checkpointing, "frozen=split" raised torch's CheckpointError on the first backward:
    a recomputed block's frozen base weights required grad, so autograd saved other tensors
    than in the first forward."""
    results = testing.run(functools.partial(_lora, how), world_size=2)
    for rank, r in enumerate(results):
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] < 1e-5, f"rank {rank}: {worst} off by {r['errors'][worst]:.2e}"
        for ours, ref in zip(r["losses"], r["ref_losses"], strict=True):
            assert ours == pytest.approx(ref, rel=1e-5)
        assert r["frozen_moved"] == [] and r["trainable_moved"], r
        if not how.startswith("frozen=warn"):
            # no gradient memory for the frozen weights: their flat buffers get None, and this
            # rank's gradients are about half the adapters' (the shards plus padding); with
            # "split" the frozen members are flat buffers of their own inside each block's unit
            assert r["warned"] == [] and r["frozen_flats_without_grads"], r
            assert r["frozen_in_frozen_flats"]
            assert r["grad_numel"] < r["trainable_numel"] // 2 + 64, r
        else:
            # one unit per block: the frozen members' gradients are held (as zeros) and
            # reduced with the adapters', so the gradients are about half the model's
            assert any("mixes parameters" in w for w in r["warned"]), r["warned"]
            assert r["frozen_members_grads"] and max(r["frozen_members_grads"]) == 0.0, r
            assert r["grad_numel"] > 2 * r["trainable_numel"], r


def _checkpointed_statistics(path: str, rank: int) -> dict:
    model, block = _build("resnet")
    state, _, _ = _train(model, _state(model, block, fs.Mesh(shard=2)), "resnet", rank)
    fs.checkpoint.save(path, state, step=STEPS)
    loaded, _, _, _ = fs.checkpoint.load(path, like=(state, None))
    return {"own": state.buffers, "loaded": loaded.buffers}


def test_a_checkpoint_keeps_the_first_ranks_batchnorm_statistics(tmp_path):
    """Each rank's running statistics are its own; a checkpoint, like `full_state_dict`, keeps
    the first rank's. Broke: DCP saved each replicated tensor from the rank whose share of
    the writing was smallest so far (its load balancing), so this checkpoint held rank 1's
    statistics, and a larger model's could mix ranks from one tensor to the next."""
    results = testing.run(functools.partial(_checkpointed_statistics, str(tmp_path)))
    first = results[0]["own"]
    for rank, r in enumerate(results):
        for fqn, value in r["loaded"].items():
            assert torch.equal(value, first[fqn]), (rank, fqn)
    key = "resnet.embedder.embedder.normalization.running_mean"
    assert not torch.equal(results[1]["own"][key], first[key])
