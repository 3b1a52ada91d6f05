"""The collectives of one training step at world size 8, traced on XLA:CPU and never executed.

Model "mlp_nested": a root unit (layers 0 and 3: 67x32+67 and 5x67+5 params,
365 elements per rank after dim-0 padding to 9 and 1 rows) and a nested unit
(67x67+67: 612 per rank). Per step: the root gathers once (it is not resharded
before its own backward), the nested unit gathers in forward and again in
backward when `reshard_after_forward=True` (its forward copy is not kept
alive), and each unit reduce-scatters its gradients once. With prefetch (the
default; the trace worker's first forward teaches the order) the nested unit's
forward gather travels in the root's, which waits for the same input ([Note:
the first gather of a step]): one collective of 365 + 612 elements per rank
(one flat bucket per unit; not with a collective per parameter). These configs set
`flatten_parameters=True` (one collective per unit); `False` (torch_xla's
default) issues one per parameter with the same bytes ("nested_per_param"); the
default groups small parameters and gathers large ones alone (tests/test_buckets.py).
"""
import pytest

from common.hlo_trace import normalized, ops, result_elements, trace, read

WORLD = 8
ROOT, INNER = 365, 612  # flat shard elements per rank

FLAT = {"flatten_parameters": True}
CONFIGS = [
    {"name": "nested_ag", "model": "mlp_nested", "kwargs": FLAT},
    {"name": "nested_ar", "model": "mlp_nested", "kwargs": {**FLAT, "all_gather_impl": "all_reduce"}},
    {"name": "nested_keep", "model": "mlp_nested", "kwargs": {**FLAT, "reshard_after_forward": False}},
    {"name": "nested_unpinned", "model": "mlp_nested", "kwargs": {**FLAT, "pin_layout_in_collective_ops": False}},
    {"name": "nested_bf16", "model": "mlp_nested", "kwargs": {**FLAT, "compute_dtype": "bfloat16"}},
    {"name": "nested_per_param", "model": "mlp_nested", "kwargs": {"flatten_parameters": False}},
    {"name": "gpt2", "model": "gpt2", "kwargs": FLAT},
    {"name": "gpt2_logged_loss", "model": "gpt2", "kwargs": {**FLAT, "logged_loss": True}},
]


@pytest.fixture(scope="module")
def hlo(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hlo"))
    trace(CONFIGS, out, world=WORLD)
    return {c["name"]: read(out, c["name"], WORLD) for c in CONFIGS}


@pytest.mark.parametrize("name", [c["name"] for c in CONFIGS])
def test_same_program_on_every_rank(hlo, name):
    texts = {r: normalized(t) for r, t in hlo[name].items()}
    assert all(texts[r] == texts[0] for r in texts), f"{name}: HLO differs between ranks"


def test_native_gather_counts_sizes_and_pinned_layout(hlo):
    text = hlo["nested_ag"][0]
    gathers = ops(text, "all-gather")
    # the root's gather with the nested unit's (forward), the nested unit's again (backward)
    assert sorted(result_elements(g) for g in gathers) == sorted([WORLD * (ROOT + INNER), WORLD * INNER])
    scatters = ops(text, "reduce-scatter")
    assert sorted(result_elements(s) for s in scatters) == [ROOT, INNER]
    assert ops(text, "all-reduce") == []
    for line in gathers + scatters:
        assert "constrain_layout=true" in line, line
        assert "replica_groups={{0,1,2,3,4,5,6,7}}" in line, line


def test_default_gathers_each_parameter_with_the_same_bytes(hlo):
    text = hlo["nested_per_param"][0]
    gathers = ops(text, "all-gather")
    # root: 2 weights + 2 biases, once; nested unit: weight + bias, in forward and backward
    # (each parameter is gathered in place, so the first gather is not joined: that would copy)
    assert len(gathers) == 4 + 2 * 2
    assert sum(result_elements(g) for g in gathers) == WORLD * (ROOT + 2 * INNER)
    scatters = ops(text, "reduce-scatter")
    assert len(scatters) == 4 + 2 and sum(result_elements(s) for s in scatters) == ROOT + INNER
    for line in gathers + scatters:
        assert "constrain_layout=true" in line, line


def test_all_reduce_emulation(hlo):
    text = hlo["nested_ar"][0]
    assert ops(text, "all-gather") == []
    reduces = ops(text, "all-reduce")
    assert sorted(result_elements(r) for r in reduces) == sorted([WORLD * (ROOT + INNER), WORLD * INNER])
    assert all("constrain_layout=true" in r for r in reduces)


def test_no_gathered_parameter_kept_between_forward_and_backward(hlo):
    # reshard: the nested unit gathers twice (forward, in the root's collective, then again
    # for backward) and an optimization barrier keeps XLA from merging the two gathers
    assert len(ops(hlo["nested_ag"][0], "all-gather")) == 2
    assert len(ops(hlo["nested_ag"][0], "opt-barrier")) >= 2
    # keeping the forward copy instead: the forward gather only
    assert len(ops(hlo["nested_keep"][0], "all-gather")) == 1


def test_unpinned_layout(hlo):
    text = hlo["nested_unpinned"][0]
    lines = ops(text, "all-gather") + ops(text, "reduce-scatter")
    assert lines and not any("constrain_layout=true" in line for line in lines)


def test_bf16_gathers_in_compute_dtype_and_reduces_in_it(hlo):
    text = hlo["nested_bf16"][0]
    assert all(" bf16[" in g.split("all-gather(")[0] for g in ops(text, "all-gather"))
    assert all(" bf16[" in s.split("reduce-scatter(")[0] for s in ops(text, "reduce-scatter"))


def test_gpt2_one_gather_per_unit_and_backward_regather(hlo):
    text = hlo["gpt2"][0]
    # forward: root (embeddings, final norm, tied head) with block 0, then block 1;
    # backward: both blocks regathered
    assert len(ops(text, "all-gather")) == 2 + 2
    assert len(ops(text, "reduce-scatter")) == 3


def test_logged_loss_is_the_mean_over_replicas(hlo):
    # The job logs (and evaluates) the global loss, not rank 0's micro-batch
    # loss: one all-reduce of the scalar over all 8 ranks, scaled by 1/8.
    text = hlo["gpt2_logged_loss"][0]
    reduces = ops(text, "all-reduce")
    assert len(reduces) == 1, reduces
    # Operands: the scalar loss and torch_xla's ordering token; an empty
    # replica_groups means every replica.
    assert "all-reduce(f32[]" in reduces[0], reduces[0]
    assert "replica_groups={}" in reduces[0] or "replica_groups={{0,1,2,3,4,5,6,7}}" in reduces[0], reduces[0]
    assert "0.125" in text, "the sum is not scaled by 1/world"
    # (The forward's gathers are in this graph too: nothing was executed.)
    assert not ops(text, "reduce-scatter"), "no backward was traced"
