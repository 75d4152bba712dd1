"""placement="owned": each parameter whole on one rank of the shard axis, in the same flat
buffers, gathers and reductions as the even split; training equals one process."""

import functools

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
from funcshard.core._layout import layout_of, shard_pieces
from funcshard.testing.compare import assert_trees_close
from funcshard.testing.memory import LiveTensors
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

STEPS = 3
LR, EPS = 3e-3, 1e-3  # eps 1e-3: see DESIGN.md §10.4 (AdamW on exactly-zero gradients)
CASES = {  # mesh, placement, world size
    "fsdp2_all_owned": ((None, 2), "owned", 2),
    "fsdp3_blocks_owned": ((None, 3), {Block: "owned"}, 3),
    "hsdp_blocks_owned": ((2, 2), {Block: "owned"}, 4),
}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2))


def _loss(model, params, x, y):
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _batch(step: int):
    return random_tokens(GPTConfig(n_layer=2), 12, seed=100 + step)


def _mesh(shape):
    replicate, shard = shape
    if replicate is None:
        return fs.Mesh(shard=shard)
    # HSDP compares every collective across ranks: the uneven exchanges agree in their sizes
    return fs.Mesh(replicate=replicate, shard=shard, check_collectives=True)


def _train(case: str, rank: int) -> dict:
    """AdamW on an owned state, STEPS steps, each rank its slice of the batch; also what
    the layout says: every owned parameter lies whole in one rank's shard."""
    shape, placement, world = CASES[case]
    model = _model()
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}), placement=placement)
    state = fs.shard(model, plan, _mesh(shape))
    whole = all(
        [(p.start, p.stop) for r in range(flat.shard_size) for p in shard_pieces(flat, r)
         if p.index == i] == [(0, flat.numels[i])]
        for flat in state.layout.flats if flat.placement == "owned"
        for i in range(len(flat.fqns))
    )  # fmt: skip
    placements = {flat.unit: flat.placement for flat in state.layout.flats}
    opt = fs.optim.adamw(LR, eps=EPS)
    opt_state = opt.init(state)
    for step in range(STEPS):
        x, y = _batch(step)
        mine = x.chunk(world)[rank], y.chunk(world)[rank]
        _, grads = fs.value_and_grad(functools.partial(_loss, model))(state, *mine)
        state, opt_state = opt.step(grads, opt_state, state)
    refused = ""
    if world == 3:  # the bound, refused on every rank before any collective
        owned_root = fs.plan(model, policy=fs.policy.module_classes({Block}), placement="owned")
        try:
            fs.shard(model, owned_root, _mesh(shape))
        except ValueError as e:
            refused = str(e)
    return {"params": fs.unshard(state), "whole": whole, "placements": placements,
            "refused": refused}  # fmt: skip


def _one_process() -> dict:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    return {f: p.detach() for f, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_owned_training_equals_one_process(case):
    """AdamW on FSDP-2 (every unit owned), FSDP-3 and HSDP 2x2 (blocks owned, the root
    even: a state mixing both; HSDP with its collectives compared across ranks) equals
    torch.optim.AdamW on one process to 1e-5; every owned parameter lies whole in one
    rank's shard; at 3 ranks an owned root (whose embedding is over the bound) is refused
    on every rank, naming it."""
    expected = _one_process()
    results = testing.run(functools.partial(_train, case), world_size=CASES[case][2])
    for got in results:
        assert_trees_close(got["params"], expected, rtol=1e-5, atol=1e-6)
        assert got["whole"]
        owned = {u for u, p in got["placements"].items() if p == "owned"}
        assert owned == ({"blocks.0", "blocks.1"} | ({""} if "all" in case else set()))
        if CASES[case][2] == 3:
            assert "wte.weight" in got["refused"] and "placement='even'" in got["refused"]


def test_placement_is_recorded_per_unit_and_refuses_bad_input():
    """The plan records each unit's placement (fingerprint included); on a shard axis of one
    rank owned lays out as even; fs.estimate counts owned units' sends unpadded on cpu
    (gloo) and padded on cuda; an unknown name, a mapping naming no unit, a bad callable
    result are refused naming them."""
    model = _model()
    blocks = fs.policy.module_classes({Block})
    even = fs.plan(model, policy=blocks)
    owned = fs.plan(model, policy=blocks, placement={Block: "owned"})
    called = fs.plan(model, policy=blocks, placement=lambda u: "owned" if u.name else "even")
    assert [u.placement for u in owned.units] == ["owned", "owned", "even"]
    assert [u.placement for u in called.units] == ["owned", "owned", "even"]
    assert owned.fingerprint() != even.fingerprint() == fs.plan(model, policy=blocks).fingerprint()
    assert "owned" in owned.table()
    per_rank = {u.name: u.bytes_per_rank(2) for u in owned.units}  # padding included
    laid_out = layout_of(owned, None, 2)
    for name, nbytes in per_rank.items():
        flats = [f for f in laid_out.flats if f.unit == name]
        assert nbytes == sum(f.shard_numel * f.dtype.itemsize for f in flats)
    assert per_rank["blocks.0"] > even.units[0].bytes_per_rank(2)
    assert layout_of(owned, None, 1).flats == layout_of(even, None, 1).flats
    sent = {(p, d): fs.estimate(plan, 4, device=d).sent_per_step
            for p, plan in (("owned", owned), ("even", even)) for d in ("cpu", "cuda")}  # fmt: skip
    assert sent["owned", "cpu"] <= sent["even", "cpu"] == sent["even", "cuda"]  # gloo: unpadded
    assert sent["owned", "cuda"] > sent["even", "cuda"]  # NCCL: the padding is sent
    assert layout_of(owned, None, 2).flats != layout_of(even, None, 2).flats
    with pytest.raises(ValueError, match=r"must be one of \['even', 'owned'\], got 'rows'"):
        fs.plan(model, policy=blocks, placement="rows")
    with pytest.raises(ValueError, match=r"placement names 'blocks', which is not a unit"):
        fs.plan(model, policy=blocks, placement={"blocks": "owned"})
    with pytest.raises(ValueError, match=r"placement\['blocks.0'\] must be one of"):
        fs.plan(model, policy=blocks, placement=lambda u: "own")
    with pytest.raises(TypeError, match=r"placement must be 'even', 'owned', a mapping"):
        fs.plan(model, policy=blocks, placement=3)


class _CountingSends:
    """A gloo exchange's carrier group that adds the bytes of every send to `counted`: what
    this rank puts on the wire, whatever the records say."""

    def __init__(self, group, counted: list[int]) -> None:
        self._group, self._counted = group, counted

    def send(self, tensors, peer, tag):
        self._counted[0] += sum(t.numel() * t.element_size() for t in tensors)
        return self._group.send(tensors, peer, tag)

    def recv(self, tensors, peer, tag):
        return self._group.recv(tensors, peer, tag)


def _step_bytes(rank: int) -> dict:
    """One AdamW step on FSDP-4 per placement (blocks owned, or all even): the parameters
    after it, the bytes this rank's exchanges sent (counted at gloo's send) and what
    `collectives.record()` says they sent."""
    from funcshard.comm import _collectives as collectives
    from funcshard.comm import _exchange as exchange

    out, carrier = {}, exchange._carrier
    for name, placement in (("even", "even"), ("owned", {Block: "owned"})):
        model = _model()
        plan = fs.plan(model, policy=fs.policy.module_classes({Block}), placement=placement)
        state = fs.shard(model, plan, fs.Mesh(shard=4))
        opt = fs.optim.adamw(LR, eps=EPS)
        opt_state = opt.init(state)
        x, y = _batch(0)
        mine = x.chunk(4)[rank], y.chunk(4)[rank]
        counted = [0]
        exchange._carrier = lambda g, s, d, c=counted: _CountingSends(carrier(g, s, d), c)
        try:
            with collectives.record() as log:
                _, grads = fs.value_and_grad(functools.partial(_loss, model))(state, *mine)
                state, opt_state = opt.step(grads, opt_state, state)
        finally:
            exchange._carrier = carrier
        exchanged = [r for r in log if r.op in ("all_gather", "reduce_scatter")]
        padded = sum(f.padded_numel - f.numel for f in state.layout.flats)
        out[name] = {"params": fs.unshard(state), "sent": counted[0], "padded": padded,
                     "recorded": collectives.bytes_sent(exchanged)}  # fmt: skip
    return out


def test_owned_exchange_sends_no_padding():
    """On gloo an owned unit's all-gathers and reduce-scatters send no padding: over FSDP-4
    (blocks owned, whose padding is a few thousand elements) the ranks together send no more
    bytes per step than the even placement (with padding sent, they sent more), each rank
    what `collectives.record()` says it sent, and the step's result is the even one's."""
    results = testing.run(_step_bytes, world_size=4)
    for got in results:
        assert got["owned"]["padded"] > got["even"]["padded"]  # padding exists
        assert_trees_close(got["owned"]["params"], got["even"]["params"], rtol=1e-5, atol=1e-6)
        for name in ("even", "owned"):
            assert got[name]["sent"] == got[name]["recorded"], name
    owned, even = (sum(got[name]["sent"] for got in results) for name in ("owned", "even"))
    assert owned <= even, (owned, even)


def _uneven_collectives(rank: int) -> dict:
    """An uneven all-gather and reduce-scatter on 4 ranks where two ranks own nothing: loads
    (5, 0, 3, 0) of shards of 5 elements, padding filled with garbage the exchange must not
    send."""
    from funcshard.comm import _collectives as collectives

    loads, group = (5, 0, 3, 0), fs.Mesh(shard=4).shard_group
    torch.manual_seed(rank)
    shard = torch.randn(5)
    shard[loads[rank] :] = 1e9  # sent, it would show
    flat = torch.randn(20)
    for p, load in enumerate(loads):
        flat[p * 5 + load : (p + 1) * 5] = 1e9
    with collectives.record() as log:
        gathered = collectives.all_gather(shard, group, "u", loads).wait()
        reduced = collectives.reduce_scatter(flat, group, "avg", "u", loads=loads).wait()
    with LiveTensors() as meter:  # a reduce-scatter's memory, its input handed over
        collectives.reduce_scatter(torch.randn(20), group, "sum", "v", True, loads).wait()
    return {"shard": shard, "flat": flat, "gathered": gathered, "reduced": reduced,
            "sent": collectives.bytes_sent(log), "peak": meter.peak}  # fmt: skip


def test_an_uneven_exchange_sends_each_ranks_load_and_zeroes_the_rest():
    """Ranks owning nothing exchange no message; each chunk holds its owner's load, then
    zeros; the reduce-scatter averages the owner's load and leaves zeros after it; each rank
    records the elements it sent."""
    loads = (5, 0, 3, 0)
    results = testing.run(_uneven_collectives, world_size=4)
    for rank, got in enumerate(results):
        own = got["shard"][: loads[rank]]
        expected = torch.cat([torch.cat([r["shard"][:n], torch.zeros(5 - n)])
                              for r, n in zip(results, loads, strict=True)])  # fmt: skip
        expected[rank * 5 : rank * 5 + 5] = got["shard"]  # its own chunk: its whole shard
        torch.testing.assert_close(got["gathered"], expected, rtol=0, atol=0)
        mean = sum(r["flat"][rank * 5 : rank * 5 + loads[rank]] for r in results) / 4
        torch.testing.assert_close(got["reduced"][: loads[rank]], mean)
        assert got["reduced"][loads[rank] :].eq(0).all()
        assert got["sent"] == 4 * (3 * own.numel() + sum(loads) - loads[rank])
        # input, result and a receive buffer per peer past the first: the peers' parts are
        # summed into those, with no temporary of the load's size (2.25 MiB of the 10M GPT's
        # owned step at its peak on 4 ranks)
        assert got["peak"] == 4 * (20 + 5 + 2 * loads[rank]), got["peak"]
