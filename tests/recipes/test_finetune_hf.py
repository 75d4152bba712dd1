"""examples/finetune_hf.py: a save_pretrained checkpoint loaded straight into FSDP shards on 2
ranks, fine-tuned, exported, and reloaded by from_pretrained with the same loss."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import finetune_hf


def test_the_finetune_example_round_trips_through_from_pretrained(tmp_path):
    result = finetune_hf.run(str(tmp_path), steps=10, quick=True)
    assert result["losses"][-1] < result["losses"][0]  # it trained
    assert abs(result["eval_loss"] - result["plain_loss"]) <= 1e-5 * result["plain_loss"]
    assert result["sample"].startswith("def ")
    assert (tmp_path / "finetuned" / "config.json").exists()
