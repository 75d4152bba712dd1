"""The `funcshard` command (also `python -m funcshard`): see what a model's sharding plan
needs per rank before launching it, check the sharding laws on your own model, try a
sharded training run, check a checkpoint.

  funcshard plan MODULE:FACTORY|CONFIG.json --world-size N [--mesh RxS | --replicate] [--mp bf16]
                 [--placement even|owned] [--tokens BxT [--loss MODULE:FN]] [--device cuda]
                 [--checkpointing]
  funcshard check MODULE:FACTORY --batch MODULE:FACTORY [--loss MODULE:FN] [--quick]
  funcshard demo [--nproc 2] [--steps 300] [--mode fsdp|hsdp|replicate]
  funcshard checkpoint verify PATH
  funcshard checkpoint export PATH OUT [--overwrite] [--under KEY] [--model MODULE:FACTORY]

Run `funcshard COMMAND --help` for a command's options.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import funcshard as fs
from funcshard.cli import _check_command as check_command
from funcshard.cli._demo import add_arguments as add_demo_arguments
from funcshard.cli._demo import from_arguments as demo_config
from funcshard.cli._demo import run as run_demo
from funcshard.cli._loading import add_loss_argument, load, loss_function, unit_classes
from funcshard.core import _placement as placement_of
from funcshard.core._plan import plan
from funcshard.core._policy import module_classes
from funcshard.core._precision import MixedPrecision
from funcshard.io import _checkpoint as checkpoint
from funcshard.planning._attention_kernels import KERNELS
from funcshard.planning._estimate import estimate
from funcshard.testing.check import output_logits

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
REDUCE = {**DTYPES, "fp32": torch.float32}
PLAN_EXAMPLES = """\
examples:
  funcshard plan funcshard.testing.models:GPT --world-size 8
  funcshard plan funcshard.testing.models:GPT --world-size 8 --replicate
  funcshard plan funcshard.testing.models:llama_7b --world-size 1024 --mp bf16
  funcshard plan mypkg.models:build --world-size 64 --mesh 8x8 --tokens 8x1024
  funcshard plan model:gpt --world-size 2 --tokens 12x1024 --loss model:loss
  funcshard plan examples/llama-3.1-8b/config.json --world-size 8 --mp bf16 \
      --tokens 2x8192 --device cuda --checkpointing

MODULE is imported as `python -m` imports it: from the current directory first, then the
installed packages. A transformers config.json (or a directory holding one) builds its
causal LM, read locally. Without --tokens the peak leaves out activations; with it, one
language-model step runs on the meta device to count them (the batch per rank is B
sequences of T token ids, the loss the cross-entropy of the output against the
tokens: the output itself, its .logits, its "logits" or its first element, as nanoGPT's
(logits, loss); --loss MODULE:FN, FN(outputs, tokens) -> mean loss, for other outputs).
The peak assumes README's training loop with AdamW (see funcshard.estimate).
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of `funcshard` and `python -m funcshard`."""
    parser = argparse.ArgumentParser(
        prog="funcshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    planner = commands.add_parser(
        "plan",
        help="peak memory and traffic per rank of a model's plan",
        description="Plan a model built on the meta device (nothing is allocated) and print\n"
        "per unit and in total the bytes each rank holds, gathers and sends per step,\n"
        "and the peak memory per rank of a training step.",
        epilog=PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    planner.add_argument(
        "factory",
        metavar="MODULE:FACTORY|CONFIG.json",
        help="a function returning the model, e.g. pkg.models:gpt (called under "
        "torch.device('meta')), or a transformers config.json",
    )
    planner.add_argument("--world-size", type=int, required=True, help="ranks in all")
    planner.add_argument("--mesh", help="RxS: replicate x shard (HSDP); default 1xWORLD (FSDP)")
    planner.add_argument(
        "--replicate",
        action="store_true",
        help="the state funcshard.replicate makes (DDP): every rank holds every parameter, "
        "its gradients in DDP's buckets; the mesh is WORLDx1",
    )
    planner.add_argument("--mp", choices=sorted(DTYPES), help="gather and compute in this dtype")
    planner.add_argument(
        "--placement",
        choices=placement_of.PLACEMENTS,
        default="even",
        help="every unit's placement: even (flat shards, the default) or owned (each "
        "parameter whole on one rank of the shard axis, for the units within owned's "
        "bound; the others stay even); shown per unit in the table",
    )
    planner.add_argument(
        "--reduce", choices=sorted(REDUCE), help="reduce gradients in this dtype (with --mp)"
    )
    planner.add_argument(
        "--units",
        help="comma-separated module class names to make units (default: the "
        "classes inside the model's first ModuleList, e.g. transformer blocks)",
    )
    planner.add_argument(
        "--tokens",
        metavar="BxT",
        help="count activations too: one step of B sequences of T token ids per rank",
    )
    add_loss_argument(
        planner,
        "with --tokens, cross entropy of the logits against the tokens; the targets are "
        "the B x T token ids",
    )
    planner.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="plan for this device's attention kernels, on any machine (default: cuda "
        "where available, else cpu)",
    )
    planner.add_argument(
        "--capability",
        default="9.0",
        metavar="MAJOR.MINOR",
        help="the GPU assumed for --device cuda (default 9.0: sm90, H100/H200; 8.0 A100)",
    )
    planner.add_argument(
        "--attention",
        choices=KERNELS,
        help="the attention kernel to assume instead of torch's choice for that GPU",
    )
    planner.add_argument(
        "--checkpointing",
        action="store_true",
        help="with --tokens: activation checkpointing of every layer (a transformers "
        "config.json's model: activation_checkpointing_enable())",
    )
    planner.add_argument(
        "--donate",
        action="store_true",
        help="the step updates in place with opt.step (default: opt.update and "
        "fs.apply_updates, which copy)",
    )
    demo = commands.add_parser(
        "demo",
        help="train a small GPT on local ranks and check it",
        description="Train a character-level GPT on the standard library's source, sharded "
        "over local gloo ranks; check its first steps against one unsharded process; report "
        "the loss, tokens/s, peak memory per rank and bytes sent per step.",
    )
    add_demo_arguments(demo)
    checkpoints = commands.add_parser("checkpoint", help="check or export a saved checkpoint")
    actions = checkpoints.add_subparsers(dest="action", required=True, metavar="ACTION")
    verifier = actions.add_parser(
        "verify",
        help="check every byte against its checksums",
        description="Check every byte of a checkpoint against the checksums saved with it, "
        "without torch.distributed. Exit status 0: verified; 1: problems or no checksums; "
        "2: no checkpoint there.",
    )
    verifier.add_argument("path", help="a checkpoint directory, or the root LATEST is in")
    exporter = actions.add_parser(
        "export",
        help="write the full state dict to a torch.save file",
        description="Write the model's full state dict that a checkpoint holds (state_dict() "
        "keys, tied weights under each name, no optimizer state) to a torch.save file, in "
        "this process alone. Exit status 0: written; 2: no checkpoint there, or OUT exists.",
    )
    exporter.add_argument("path", help="a checkpoint directory, or the root LATEST is in")
    exporter.add_argument("out", help="the file to write, e.g. ckpt.pt")
    exporter.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    exporter.add_argument(
        "--under",
        metavar="KEY",
        help="write {KEY: state_dict, **extra} (the save's extra beside it), e.g. --under model "
        "for nanoGPT's sample.py",
    )
    exporter.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="the model's builder (called on the meta device), for checkpoints saved before "
        "funcshard recorded parameter shapes and tied names",
    )
    check_command.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "check":
        return check_command.run(args)
    if args.command == "demo":
        return run_demo(demo_config(args))
    if args.command == "checkpoint" and args.action == "export":
        return _export_command(args)
    if args.command == "checkpoint":
        return _verify_command(args.path)
    return _plan_command(args)


def _verify_command(path: str) -> int:
    try:
        report = checkpoint.verify(path)
    except (FileNotFoundError, checkpoint.CheckpointCorrupted) as e:
        print(e, file=sys.stderr)
        return 2
    print(f"{report.directory}:")
    for line in report.lines:
        print(f"  {line}")
    for problem in report.problems:
        print(f"  {problem}")
    if not report.verified:
        print("not verified: saved without checksums")
        return 1
    print("verified: every byte matches" if report.ok else f"{len(report.problems)} problems")
    return 0 if report.ok else 1


def _export_command(args: argparse.Namespace) -> int:
    model = None
    if args.model:
        with torch.device("meta"):
            model = load(args.model, "checkpoint export")()
    try:
        out = checkpoint.export_state_dict(
            args.path, args.out, model=model, overwrite=args.overwrite, under=args.under
        )
    except FileExistsError as e:
        print(str(e).replace("overwrite=True (CLI: --overwrite)", "--overwrite"), file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # not a checkpoint, corrupted, unreadable
        print(e, file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _plan_command(args: argparse.Namespace) -> int:
    replicate, shard = _mesh(args.mesh, args.world_size, args.replicate)
    if args.replicate:
        _check_replicate(args)
    hf = args.factory.endswith(".json") or os.path.isdir(args.factory)
    factory = _config_model(args.factory) if hf else load(args.factory, "plan")
    with torch.device("meta"):
        model = factory()
    if args.checkpointing:
        _enable_checkpointing(model, args)
    if args.replicate:  # units are DDP's buckets, which estimate makes as replicate does
        planned, units = None, "DDP's gradient buckets"
    else:
        classes = unit_classes(model, args.units, "plan")
        planned = plan(model, policy=module_classes(classes), placement=_placement(args, shard))
        units = ", ".join(c.__name__ for c in classes)
    dtype = DTYPES.get(args.mp)
    reduce = REDUCE.get(args.reduce)
    mp = MixedPrecision(dtype, reduce) if dtype is not None or reduce is not None else None
    step: dict[str, Any] = {}
    if args.tokens:
        batch, length = _sizes(args.tokens, "--tokens")
        tokens = torch.zeros(batch, length, dtype=torch.long, device="meta")
        kwargs = {"use_cache": False} if hf else {}  # a training step keeps no cache
        loss = loss_function(args, "plan")
        step = {"loss_fn": functools.partial(_lm_loss, model, kwargs, loss), "args": (tokens,)}
    elif args.loss:
        raise SystemExit("funcshard plan --loss: add --tokens BxT, the step to run")
    result = estimate(
        planned, (replicate, shard), mp=mp, model=model, donate=args.donate,
        device=args.device, capability=_capability(args.capability),
        attention=args.attention, replicate=args.replicate, **step,
    )  # fmt: skip
    print(
        f"{args.factory}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"mesh {replicate}x{shard} (replicate x shard), units: {units}"
        + (f", placement {args.placement}" if args.placement != "even" else "")
        + (f", batch {args.tokens} tokens per rank" if args.tokens else "")
        + (", activation checkpointing" if args.checkpointing else "")
        + (f", on {_device_words(args)}" if args.tokens else "")
    )
    print(result.table())
    return 0


def _placement(args: argparse.Namespace, shard: int) -> Any:
    """--placement as `plan` takes it: "owned" for each unit within the owned bound over
    `shard` ranks, "even" for the rest (the table shows which), so that one large embedding
    does not refuse the whole plan."""
    if args.placement == "even":
        return "even"
    return lambda unit: "owned" if placement_of.fits(unit, shard) else "even"


def _config_model(path: str) -> Callable[[], nn.Module]:
    """A function building the causal language model a transformers config.json describes
    (a file, or a directory holding config.json), read locally: nothing is downloaded."""
    try:
        import transformers
    except ImportError:
        raise SystemExit(
            f"funcshard plan {path}: a config.json needs transformers (pip install transformers)"
        ) from None
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            fields = json.load(f)
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(
            f"funcshard plan {path}: expected a transformers config.json with a model_type, "
            f"got {type(e).__name__}: {e}"
        ) from None
    return functools.partial(transformers.AutoModelForCausalLM.from_config, config)


def _enable_checkpointing(model: nn.Module, args: argparse.Namespace) -> None:
    if not args.tokens:
        raise SystemExit("funcshard plan --checkpointing: add --tokens BxT, the step to run")
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:
        raise SystemExit(
            f"funcshard plan --checkpointing: {type(model).__name__} has no "
            f"activation_checkpointing_enable (a transformers model's method). Checkpoint "
            f"in your model's forward (torch.utils.checkpoint, use_reentrant=False) and "
            f"leave --checkpointing out, or use funcshard.estimate from Python."
        )
    model.train()
    enable()


def _capability(text: str) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in text.split("."))
    except ValueError:
        raise SystemExit(
            f"funcshard plan: --capability expects MAJOR.MINOR, e.g. 9.0, got {text!r}"
        ) from None
    return major, minor


def _device_words(args: argparse.Namespace) -> str:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return "cpu"
    return f"cuda sm{args.capability.replace('.', '')}" + (
        f" ({args.attention} attention)" if args.attention else ""
    )


def _lm_loss(
    model: nn.Module,
    kwargs: dict[str, Any],
    loss: Callable[[Any, torch.Tensor], torch.Tensor] | None,
    params: Any,
    tokens: torch.Tensor,
) -> torch.Tensor:
    """A language model's loss: `loss(outputs, tokens)` when --loss names one, else the
    cross-entropy of each position's logits against a token (on the meta device only the
    shapes matter)."""
    outputs = fs.call(model, params, tokens, **kwargs)
    if loss is not None:
        return loss(outputs, tokens)
    logits = output_logits(outputs)  # a tensor, .logits, ["logits"], or (logits, loss)[0]
    is_logits = isinstance(logits, torch.Tensor) and logits.dim() == 3
    if not is_logits or logits.shape[:2] != tokens.shape:
        raise SystemExit(
            f"funcshard plan --tokens: expected the model to return (batch, tokens, "
            f"vocabulary) logits, or a tuple or dict holding them (first, or as 'logits'), "
            f"got {_describe(outputs)}. Name your loss with --loss MODULE:FN, "
            f"FN(outputs, tokens) -> mean loss, as funcshard check takes it."
        )
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(_describe(v) for v in value)})"
    if isinstance(value, dict):
        return f"a dict of keys {sorted(map(str, value))}"
    return type(value).__name__


def _sizes(text: str, option: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(
            f"funcshard plan: {option} expects AxB, e.g. 8x1024, got {text!r}"
        ) from None
    if a < 1 or b < 1:
        raise SystemExit(f"funcshard plan: {option} {text}: both sizes must be positive")
    return a, b


def _check_replicate(args: argparse.Namespace) -> None:
    """Refuse the options that shape sharded units, which a replicate state has none of."""
    for given, option in ((args.units, "--units"), (args.placement != "even", "--placement")):
        if given:
            raise SystemExit(
                f"funcshard plan --replicate: {option} shapes sharded units; a replicate "
                f"state holds every parameter on every rank, in DDP's buckets. Leave "
                f"{option} out, or drop --replicate to plan a sharded state."
            )


def _mesh(text: str | None, world: int, replicas_only: bool = False) -> tuple[int, int]:
    if world < 1:
        raise SystemExit(f"funcshard plan: --world-size must be positive, got {world}")
    if text is None:
        return (world, 1) if replicas_only else (1, world)
    replicate, shard = _sizes(text, "--mesh")
    if replicas_only and shard != 1:
        raise SystemExit(
            f"funcshard plan --replicate: every rank holds every parameter, so the mesh is "
            f"{world}x1, not --mesh {text}. Leave --mesh out, or drop --replicate for HSDP."
        )
    if replicate * shard != world:
        raise SystemExit(
            f"funcshard plan: --mesh {text} has {replicate * shard} ranks, not {world}"
        )
    return replicate, shard


if __name__ == "__main__":
    sys.exit(main())
