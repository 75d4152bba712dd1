"""Fine-tune a Hugging Face causal LM with funcshard FSDP on 2 local ranks, from a
safetensors checkpoint straight into shards and back out to `from_pretrained`.

    python examples/finetune_hf.py [--steps 300] [--quick] [--workdir DIR]

With no hub access, the "pretrained" model is a small byte-level Llama built here and saved
with `save_pretrained` first. Then each rank builds the model on the meta device, loads only
its own slices of the checkpoint (`fs.checkpoint.load_hf`), trains on the Python standard
library's source, and the ranks export the result (`fs.checkpoint.save_hf`). One plain
process reloads it with `from_pretrained`, checks its loss equals the sharded model's, and
samples from it.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import tempfile

import torch
import transformers
from tqdm import tqdm

import funcshard as fs

SEQ = 64


def stdlib_bytes(limit: int = 1_000_000) -> torch.Tensor:
    """The standard library's Python sources as a 1-D tensor of byte values (the vocabulary)."""
    paths = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    text = b"".join(open(p, "rb").read() for p in paths)[:limit]  # noqa: SIM115
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def make_pretrained(path: str) -> None:
    """Stand-in for a hub download: a small byte-level Llama, saved as transformers saves."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def batch(data: torch.Tensor, step: int, rows: int) -> torch.Tensor:
    """`rows` windows of SEQ bytes, drawn by step: the same on every rank that asks."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(len(data) - SEQ, (rows,), generator=g).tolist()
    return torch.stack([data[s : s + SEQ] for s in starts])


def blocks(model: torch.nn.Module) -> set[type]:
    """The model's block classes: transformers lists them in `_no_split_modules`."""
    names = set(model._no_split_modules or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def finetune(base: str, out: str, steps: int, rank: int) -> dict:
    mesh = fs.Mesh(shard=2)
    config = transformers.AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    plan = fs.plan(model, policy=fs.policy.module_classes(blocks(model)))
    # zeros where the checkpoint writes, rotary frequencies computed, no random draws
    state = fs.shard(model, plan, mesh, init=fs.skip(model._init_weights))
    state = fs.checkpoint.load_hf(base, like=state)  # this rank's rows of each tensor only

    def loss_fn(state: fs.ShardedState, ids: torch.Tensor) -> torch.Tensor:
        return fs.call(model, state, input_ids=ids, labels=ids).loss

    grad_fn = fs.value_and_grad(loss_fn)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(2e-3))
    opt_state = opt.init(state)
    data = stdlib_bytes()
    losses = []
    for step in tqdm(range(steps), desc="fine-tuning", disable=rank != 0):
        ids = batch(data, step, rows=16).chunk(2)[rank]  # each rank its half of the batch
        loss, grads = grad_fn(state, ids)
        state, opt_state = opt.step(grads, opt_state, state)
        losses.append(fs.pmean(loss.detach(), mesh).item())
    held_out = batch(data, -1, rows=8)
    with torch.no_grad():
        eval_loss = loss_fn(state, held_out).item()
    fs.checkpoint.save_hf(out, state, config=config)
    return {"losses": losses, "eval_loss": eval_loss}


def run(workdir: str, steps: int, quick: bool = False) -> dict:
    """Make the pretrained checkpoint, fine-tune it on 2 ranks, reload it in this process."""
    base, out = os.path.join(workdir, "pretrained"), os.path.join(workdir, "finetuned")
    make_pretrained(base)
    result = fs.testing.run(functools.partial(finetune, base, out, steps), world_size=2)[0]
    losses = result["losses"]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps")

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    held_out = batch(stdlib_bytes(), -1, rows=8)
    with torch.no_grad():
        plain = reloaded(input_ids=held_out, labels=held_out).loss.item()
    print(f"held-out loss: sharded {result['eval_loss']:.6f}, from_pretrained {plain:.6f}")
    assert abs(plain - result["eval_loss"]) <= 1e-5 * abs(plain), "export changed the model"

    torch.manual_seed(0)
    prompt = torch.tensor([list(b"def ")])
    sample = reloaded.generate(
        prompt,
        max_new_tokens=20 if quick else 120,
        do_sample=True,
        temperature=0.8,
        top_k=0,
        pad_token_id=0,
    )
    text = bytes(sample[0].tolist()).decode("utf-8", "replace")
    print("sample:", repr(text))
    print(f"checkpoints in {workdir}")
    return {**result, "plain_loss": plain, "sample": text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="10 steps, a short sample")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (a temp dir)")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="finetune_hf-")
    run(workdir, 10 if args.quick else args.steps, args.quick)


if __name__ == "__main__":
    main()
