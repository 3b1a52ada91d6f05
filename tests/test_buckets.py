"""Which parameters of a unit share a collective ([Note: buckets] in param_group.py)."""
from xla_fsdp.collective_engine.param_group import gather_buckets
from xla_fsdp.options import CollectiveOptions

# a GPT-2 block at d=256: ln_1 (w, b), c_attn (w, b), c_proj (w, b), ln_2 (w, b), c_fc (w, b), mlp c_proj (w, b)
BLOCK = [256, 256, 196608, 768, 65536, 256, 256, 256, 262144, 1024, 262144, 256]


def test_default_groups_small_parameters_and_gathers_large_ones_alone():
    buckets = gather_buckets(BLOCK, CollectiveOptions())
    small = [i for i, n in enumerate(BLOCK) if n <= 2**14]
    assert buckets[0] == small
    assert buckets[1:] == [[2], [4], [8], [10]]
    assert sorted(i for b in buckets for i in b) == list(range(len(BLOCK)))


def test_threshold_is_inclusive_and_configurable():
    assert gather_buckets([16384, 16385], CollectiveOptions()) == [[0], [1]]
    assert gather_buckets([16384, 16385], CollectiveOptions(small_param_numel=10**6)) == [[0, 1]]
    assert gather_buckets([5, 7], CollectiveOptions(small_param_numel=0)) == [[0], [1]]


def test_torch_xla_meanings_of_flatten_parameters():
    assert gather_buckets(BLOCK, CollectiveOptions(flatten_parameters=True)) == [list(range(len(BLOCK)))]
    assert gather_buckets(BLOCK, CollectiveOptions(flatten_parameters=False)) == [[i] for i in range(len(BLOCK))]
    assert gather_buckets([], CollectiveOptions()) == []
