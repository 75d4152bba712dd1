"""examples/port_ddp: a plain DDP training script and its funcshard port (the walk of
docs/guides/porting.md) train alike on 2 gloo ranks, resume alike, and the port's checkpoint
samples through a plain `torch.load` script as the DDP one's does.

The scripts' `main(argv)` is called on the pool's ranks (which have their process group
already), so no torchrun is launched: examples/train_gpt.py's test covers that.
"""

import functools
import importlib
import re
import sys
from pathlib import Path

import torch

import funcshard as fs
from funcshard import testing

EXAMPLE = Path(__file__).parents[2] / "examples" / "port_ddp"


def _scripts():
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    return importlib.import_module("train_ddp"), importlib.import_module("train_funcshard")


def _runs(tmp: str, rank: int) -> dict:
    """50 steps straight through, and 25 steps then a resume to 50, with each script (the
    port sharded straight through, replicated, as DDP, in the resumed pair: both layouts
    against DDP, and the cheaper one twice)."""
    ddp, port = _scripts()
    runs = {"ddp": ddp.main([]), "funcshard": port.main([])}
    for name, script, mode in (("ddp", ddp, []), ("funcshard", port, ["--mode", "replicate"])):
        out = ["--out-dir", f"{tmp}/{name}", "--eval-interval", "25", *mode]  # saves at 25, 50
        script.main([*out, "--max-iters", "25"])
        runs[f"{name} resumed"] = script.main([*out, "--resume"])
    return runs


def _close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_the_funcshard_port_trains_resumes_and_samples_as_the_ddp_script(tmp_path):
    by_rank = testing.run(functools.partial(_runs, str(tmp_path)), world_size=2)
    for runs in by_rank:  # each rank's own losses: the same rows on the same rank in both
        ddp, port = runs["ddp"], runs["funcshard"]
        assert len(ddp["train"]) == 50
        assert _close(port["train"], ddp["train"]) < 5e-5, (port["train"], ddp["train"])
        assert _close(port["val"], ddp["val"]) < 5e-5, (port["val"], ddp["val"])
        assert ddp["train"][-1] < 0.7 * ddp["train"][0]  # it learns
        for name in ("ddp", "funcshard"):  # the resumed run ends as the uninterrupted one
            resumed, straight = runs[f"{name} resumed"], runs[name]
            assert _close(resumed["train"], straight["train"][25:]) < 5e-5, name
            assert abs(resumed["val"][-1] - straight["val"][-1]) < 5e-5, name

    _scripts()  # puts examples/port_ddp on this process's path too
    tinygpt = importlib.import_module("tinygpt")
    ddp_ckpt, port_ckpt = tmp_path / "ddp" / "ckpt.pt", tmp_path / "funcshard" / "ckpt.pt"
    port_sd, ddp_sd = torch.load(port_ckpt)["model"], torch.load(ddp_ckpt)["model"]
    assert port_sd.keys() == ddp_sd.keys()  # the DDP script's sampler loads either file
    # (not the values: the key bias's gradient is rounding noise, which Adam scales to lr)
    assert tinygpt.sample(str(port_ckpt), [3, 24]) == tinygpt.sample(str(ddp_ckpt), [3, 24])
    exported = tmp_path / "exported.pt"  # the offline route gives the live route's dict
    fs.checkpoint.export_state_dict(tmp_path / "funcshard", exported)
    offline = torch.load(exported)
    assert offline.keys() == port_sd.keys()
    assert all(torch.equal(port_sd[k], offline[k]) for k in port_sd)


GUIDE = Path(__file__).parents[2] / "docs" / "guides" / "porting.md"


def test_the_porting_guide_excerpts_are_the_examples_lines():
    """The guide's excerpts (```py blocks; its ```python block runs as it is, in
    tests/project/test_readme.py) are lines of examples/port_ddp, so they cannot drift from
    the code the test above runs."""
    snippets = re.findall(r"^```py\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)
    sources = [path.read_text() for path in sorted(EXAMPLE.glob("*.py"))]
    assert len(snippets) >= 20
    for snippet in snippets:
        code = [line.strip() for line in snippet.splitlines() if line.strip()]
        assert any(all(line in source for line in code) for source in sources), snippet
