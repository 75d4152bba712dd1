"""The unused parameters' words (see [Note: unused parameters] in funcshard/step/_usage.py):
packed per rank, ANDed across ranks, so a parameter is unused only where no rank used it."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import funcshard as fs
from funcshard.core._layout import layout_of
from funcshard.step import _usage as usage

# 65 linear layers: 130 parameters, three words, so bits cross word boundaries
_MODEL = nn.Sequential(*[nn.Linear(2, 2) for _ in range(65)])
_LAYOUT = layout_of(fs.plan(_MODEL, policy=fs.policy.size(12)), None, 2)
_NAMES = usage.tracked(_LAYOUT)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sets(st.sampled_from(_NAMES)), min_size=1, max_size=4))
def test_words_agree_to_what_no_rank_used(unused_per_rank):
    sets = [frozenset(s) for s in unused_per_rank]
    rows = [usage.words_of(_LAYOUT, s) for s in sets]
    assert all(0 <= w < 2**62 for row in rows for w in row) and len(rows[0]) == 3
    every = torch.tensor([w for row in rows for w in row], dtype=torch.int64)
    mine = usage.Usage(_LAYOUT, sets[0])
    mine.agree_by(every.tolist, len(rows[0]), 0)
    assert mine.unused() == frozenset.intersection(*sets)
    # micro-batches: unused only where unused in both halves
    other = usage.Usage(_LAYOUT, sets[-1])
    other.agree_by(every.tolist, len(rows[0]), 0)
    assert mine.merged(other).unused() == frozenset.intersection(*sets)


def test_unused_refuses_an_unknown_policy():
    try:
        fs.value_and_grad(lambda s: s, unused="none")
    except ValueError as e:
        assert "unused must be 'skip'" in str(e) and "'none'" in str(e)
    else:
        raise AssertionError("no error")
