"""Prefetch: the next unit's gather starts while this unit computes (traced at world 8, GPT-2
d256, 4 blocks, one flat gather per unit, every unit resharded), and training is unchanged.

Forward: without prefetch each block's gather waits for the previous block's output, so no
matmul can run beside it; with it, block k+1's gather is tied to block k's *input* and has
block k's forward matmuls to overlap with. The root's gather and block 0's wait for the same
input (the step's first), so they are one collective ([Note: the first gather of a step]);
block 1's, prefetched beside block 0 whose input is an embedding lookup, also precedes every
matmul: two hoistable gathers. Backward: each re-gather and reduce-scatter has matmul work
beside it, the root's reduce-scatter too (block 0's weight gradients): it does not wait for
block 0's ([Note: the last reduce-scatter]). Liveness: when a block's forward
gather runs, every use of the gather two blocks earlier is done, so at most two blocks' full
parameters are alive (the root's stay gathered until the LM head at the end).
"""
import pytest

from common.hlo_graph import HloGraph
from common.hlo_trace import read, trace

WORLD = 8
D, TOKENS = 256, 2 * 16  # gpt2_small's width; the trace's per-rank batch
BLOCK_FORWARD_FLOPS = 2 * TOKENS * 12 * D * D  # qkv, attention projection, MLP up and down
FLAT_ALL_RESHARDED = {"flatten_parameters": True, "disable_reshard_on_root": False}


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("overlap"))
    configs = [{"name": "on", "model": "gpt2_small", "kwargs": FLAT_ALL_RESHARDED},
               {"name": "off", "model": "gpt2_small",
                "kwargs": dict(FLAT_ALL_RESHARDED, forward_prefetch=False, backward_prefetch=None)},
               {"name": "default", "model": "gpt2_small", "kwargs": {"disable_reshard_on_root": False}},
               {"name": "replicated", "model": "gpt2_small",
                "kwargs": dict(FLAT_ALL_RESHARDED, root_sharding_strategy="NO_SHARD")},
               {"name": "ckpt", "model": "gpt2_small",
                "kwargs": {"flatten_parameters": True, "activation_checkpointing": True}},
               {"name": "gathers", "model": "gpt2_small", "kwargs": dict(FLAT_ALL_RESHARDED, token_chain="gathers")},
               {"name": "chain_off", "model": "gpt2_small", "kwargs": dict(FLAT_ALL_RESHARDED, token_chain="off")}]
    trace(configs, out, world=WORLD)
    return {c["name"]: HloGraph(read(out, c["name"], WORLD)[0]) for c in configs}


def _phases(g, forward_gathers):
    """(forward gathers in unit order, backward gathers, reduce-scatters): a forward gather
    depends on fewer matmuls than any backward one (those need the whole forward)."""
    gathers = sorted(g.collectives(("all-gather",)),
                     key=lambda c: sum(g.instrs[a].opcode == "dot" for a in g.ancestors(c.name)))
    return gathers[:forward_gathers], gathers[forward_gathers:], g.collectives(("reduce-scatter",))


ON_FORWARD = 4  # root and block 0 together, then blocks 1-3
OFF_FORWARD = 5  # the root, then blocks 0-3


def test_forward_gathers_overlap_the_previous_block(graphs):
    forward, _, _ = _phases(graphs["on"], ON_FORWARD)
    for c in forward[1:]:  # every gather but the first: blocks 1..3
        assert graphs["on"].independent_flops(c.name) >= 0.5 * BLOCK_FORWARD_FLOPS, c.name
    off, _, _ = _phases(graphs["off"], OFF_FORWARD)
    exposed = [graphs["off"].independent_flops(c.name) for c in off[2:]]
    assert max(exposed) < 0.5 * BLOCK_FORWARD_FLOPS, exposed  # the test can tell the difference


def test_backward_collectives_have_work_beside_them(graphs):
    g = graphs["on"]
    _, backward, scatters = _phases(g, ON_FORWARD)
    assert len(backward) == 5 and len(scatters) == 5
    for c in backward + scatters:
        assert g.independent_flops(c.name) > 0, c.name


def test_hoistable_gathers_and_two_blocks_alive(graphs):
    g = graphs["on"]
    forward, _, _ = _phases(g, ON_FORWARD)
    assert sum(g.hoistable(c.name) for c in g.collectives(("all-gather",))) == 2
    assert sum(graphs["off"].hoistable(c.name) for c in graphs["off"].collectives(("all-gather",))) == 2
    first, blocks = forward[0], forward[1:]
    root_bytes = _phases(graphs["off"], OFF_FORWARD)[0][0].bytes  # the root's gather alone
    # when block 2's gather runs, block 0's half of the first gather is no longer used
    assert 0 < g.bytes_in_use_at(first.name, blocks[1].name) <= root_bytes
    for earlier, later in zip(blocks, blocks[2:]):  # block 1 -> block 3
        assert g.uses_done_before(earlier.name, later.name), (earlier.name, later.name)
        assert g.bytes_in_use_at(earlier.name, later.name) == 0


def test_checkpointed_units_use_the_prefetched_regather(graphs):
    """Per-layer checkpointing: a block's recomputation in backward takes the re-gather the
    previous block's backward started (BACKWARD_PRE), so it has work beside it and nothing is
    gathered twice: one gather per unit in forward (the root's and block 0's in one collective; the root keeps its parameters) and one per
    block for the recomputation, as without prefetch (found by bench/project_tpu.py's trace:
    an unused gather per block before), and the forward prefetches although a checkpointed
    forward runs without autograd."""
    g = graphs["ckpt"]
    gathers = g.collectives(("all-gather",))
    assert len(gathers) == ON_FORWARD + 4, [c.name for c in gathers]
    forward, backward, scatters = _phases(g, ON_FORWARD)
    assert len(backward) == 4 and len(scatters) == 5
    for c in backward + scatters:
        assert g.independent_flops(c.name) > 0, c.name
    # the checkpointed forward runs under no_grad and still prefetches (blocks 1-3)
    for c in forward[1:]:
        assert g.independent_flops(c.name) >= 0.5 * BLOCK_FORWARD_FLOPS, c.name


def _unhidable(g):
    """Gathers and reduce-scatters with no matmul beside them that some schedule could have
    given one: neither independent work nor needed by every matmul (the step's first gathers)."""
    return [c.name for c in g.collectives(("all-gather", "reduce-scatter"))
            if g.independent_flops(c.name) == 0 and not g.before_every_matmul(c.name)]


def test_prefetch_reaches_the_overlap_ceiling(graphs):
    """With prefetch, what stays exposed is only what every matmul of the step waits for, in
    the default buckets as in one flat gather per unit; without it, each block's gather is too."""
    for name in ("on", "default"):
        assert _unhidable(graphs[name]) == [], name
        first = [c for c in graphs[name].collectives(("all-gather",)) if graphs[name].before_every_matmul(c.name)]
        assert first and all(graphs[name].hoistable(c.name) for c in first), name
    assert len(_unhidable(graphs["off"])) >= 3  # blocks 1-3 at least: the test can tell


def test_replicated_embeddings_overlap_nine_tenths(graphs):
    """The root (embeddings, final norm) NO_SHARD, the blocks FULL_SHARD: the step's first gather
    is block 0's alone, and the root's gradient all-reduce, the step's last collective, runs
    beside block 0's weight-gradient matmuls ([Note: the last reduce-scatter]). At least 0.9 of
    the collective bytes have work beside them, two gathers are hoistable."""
    g = graphs["replicated"]
    big = [c for c in g.collectives() if c.opcode != "all-reduce" or c.bytes > 64]  # not the loss scalars
    reduce = max((c for c in big if c.opcode == "all-reduce"), key=lambda c: c.bytes)
    assert g.independent_flops(reduce.name) > 0
    total = sum(g.comm_bytes(c, WORLD) for c in big)
    overlappable = sum(g.comm_bytes(c, WORLD) for c in big if g.independent_flops(c.name) > 0)
    assert overlappable / total >= 0.9, overlappable / total
    assert sum(g.hoistable(c.name) for c in g.collectives(("all-gather",))) == 2


def _token_added(g, c) -> bool:
    """A collective whose input is its data plus the chain's token: an add whose smaller operand
    (the broadcast token) comes from another collective's result. A fresh token is a constant zero,
    which XLA folds away."""
    kinds = ("all-gather", "reduce-scatter", "all-reduce")
    for o in c.operands:
        if g.instrs[o].opcode == "add":
            token = min(g.instrs[o].operands, key=lambda x: len(g.ancestors(x)))
            if any(g.instrs[a].opcode in kinds for a in g.ancestors(token)):
                return True
    return False


def _waits(g):
    """Per backward re-gather: whether it waits for some reduce-scatter."""
    return [any(s.name in g.ancestors(c.name) for s in g.collectives(("reduce-scatter",)))
            for c in _phases(g, ON_FORWARD)[1]]


def test_reduce_scatters_off_the_chain_take_the_gradient_itself(graphs):
    """[Note: collectives off the chain]: with token_chain="gathers" no reduce-scatter's input is
    gradient + token (with the chain every one is, but the last: [Note: the last reduce-scatter]);
    each still publishes a token, so the backward re-gathers wait for reduce-scatters as with the
    chain. With "off" no gather's input carries a token either and no re-gather waits for one."""
    on, gathers, off = graphs["on"], graphs["gathers"], graphs["chain_off"]
    chained = [_token_added(on, c) for c in on.collectives(("reduce-scatter",))]
    assert len(chained) == 5 and sum(chained) == 4, chained  # the test can tell the difference
    assert sum(_token_added(on, c) for c in on.collectives(("all-gather",))) >= 4
    for g in (gathers, off):
        scatters = g.collectives(("reduce-scatter",))
        assert len(scatters) == 5 and not any(_token_added(g, c) for c in scatters)
        assert len(g.collectives(("all-gather",))) == len(on.collectives(("all-gather",)))
    assert _waits(gathers) == _waits(on) and any(_waits(on)), (_waits(gathers), _waits(on))
    assert not any(_token_added(off, c) for c in off.collectives(("all-gather",)))
    assert not any(_waits(off)), _waits(off)


def test_large_parameters_travel_in_their_own_shape(graphs):
    """[Note: gathering rows]: with the default buckets each block weight has a collective of its
    own, gathered along dim 0 as [rows, cols] (no flat buffer to relayout on a TPU); one flat
    gather per unit stays one 1-D collective."""
    g = graphs["default"]
    weights = [c for c in g.collectives(("all-gather",)) if len(c.shape) == 2 and c.shape[1] >= D]
    # 4 blocks x (qkv, attention projection, MLP up, MLP down), forward and backward re-gathers
    assert len(weights) >= 16, [c.shape for c in g.collectives(("all-gather",))]
    for c in weights:
        assert g.instrs[c.operands[0]].shape == [c.shape[0] // WORLD, c.shape[1]], (c.name, c.shape)
    # gradients keep their flat reduce-scatters, as [rows, 128] where they split into whole rows
    # ([Note: 2-D reduce-scatter]): in the weight's own shape libtpu kept them synchronous on v4-512
    assert all(len(c.shape) == 1 or c.shape[1] == 128 for c in g.collectives(("reduce-scatter",)))
    assert all(len(c.shape) == 1 for c in graphs["on"].collectives(("all-gather",)))
