"""Deferred initialization: record on meta, replay on the host."""

import math
import re

import pytest
import torch
from torch import nn

from xla_fsdp.deferred_init import (
    DeferredInitError,
    deferred_init,
    is_deferred,
    materialize_module,
    materialize_tensor,
)


class Toy(nn.Module):
    """Library init plus the custom init patterns constructors use."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.emb = nn.Embedding(10, 8, padding_idx=0)
        self.ln = nn.LayerNorm(8)
        self.w = nn.Parameter(torch.empty(4, 5))
        nn.init.normal_(self.w, std=0.02)
        with torch.no_grad():
            self.w[0].fill_(3.0)
            self.w[:, :2].mul_(2.0)
            self.w.data[2:, 3:].normal_(mean=5.0, std=0.1)
        self.b = nn.Parameter(torch.empty(6))
        self.b.data.copy_(torch.arange(6, dtype=torch.float32) * 0.5)
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
        self.register_buffer("pos", torch.arange(12).float().view(3, 4).sin() + torch.tensor(1.0))
        with torch.no_grad():
            self.lin.weight[:, :4].copy_(self.w[:, :4].repeat(2, 1)[:6])
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # tied


def _vmrss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


def test_toy_records_without_storage_and_replays_exactly():
    torch.manual_seed(0)
    eager = Toy()
    torch.manual_seed(0)
    model = deferred_init(Toy)

    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    for name, t in tensors.items():
        assert t.is_meta and is_deferred(t), name
    assert is_deferred(model)
    assert isinstance(model.w, nn.Parameter) and model.w.requires_grad
    assert not model.frozen.requires_grad
    assert model.head.weight is model.emb.weight

    materialize_module(model)

    assert not is_deferred(model)
    assert all(not t.is_meta for t in model.state_dict().values())
    _assert_same_state(eager, model)
    assert model.head.weight is model.emb.weight
    assert isinstance(model.w, nn.Parameter) and model.w.requires_grad
    assert not model.frozen.requires_grad
    assert model.w[0].eq(6.0).all().item() is False  # fill then mul on a slice
    assert torch.equal(model.w[0, :2], torch.full((2,), 6.0))


def test_materialize_module_is_a_noop_for_real_tensors():
    real = nn.Linear(3, 3)
    before = real.weight
    values = real.weight.detach().clone()
    materialize_module(real)
    assert real.weight is before and torch.equal(real.weight, values)
    assert materialize_tensor(before) is before
    assert not is_deferred(real)


def test_check_fn_leaves_unchecked_modules_deferred_and_ties_survive_split_calls():
    model = deferred_init(Toy)
    # torchdistx semantics: children are always visited, check_fn gates a
    # module's own tensors.
    materialize_module(model, check_fn=lambda m: m is model.emb)
    assert not model.emb.weight.is_meta
    assert model.head.weight.is_meta and is_deferred(model.head.weight)
    assert is_deferred(model.lin) and is_deferred(model)

    materialize_module(model)
    assert model.head.weight is model.emb.weight
    assert not is_deferred(model)


class Orphaned(nn.Module):
    """b's own weight is drawn, then dropped for a's: an orphan random op."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.c = nn.Linear(4, 4)


def test_whole_model_call_replays_orphan_draws_to_stay_equal_to_eager():
    torch.manual_seed(0)
    eager = Orphaned()
    torch.manual_seed(0)
    model = deferred_init(Orphaned)
    materialize_module(model)
    _assert_same_state(eager, model)

    # Partial calls skip orphans (they would cost memory and cannot match
    # eager anyway), so c's draws come earlier in the stream than eagerly.
    torch.manual_seed(0)
    model = deferred_init(Orphaned)
    materialize_module(model.c)
    assert not torch.equal(model.c.weight, eager.c.weight)


def test_explicit_generator_is_drawn_from_at_replay():
    def build():
        gen = torch.Generator().manual_seed(5)
        lin = nn.Linear(3, 3)
        nn.init.normal_(lin.weight, generator=gen)
        return lin

    eager = build()
    model = deferred_init(build)
    materialize_module(model)
    assert torch.equal(model.weight, eager.weight)


TORCH_INITS = {
    "orthogonal_": nn.init.orthogonal_,
    "trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.02),
    "xavier_uniform_": nn.init.xavier_uniform_,
    "kaiming_normal_": nn.init.kaiming_normal_,
    "sparse_": lambda t: nn.init.sparse_(t, 0.5),  # randperm + index_put_
    "eye_": nn.init.eye_,
    "dirac_": lambda t: nn.init.dirac_(t.view(4, 6, 1)),  # on a view
}


@pytest.mark.parametrize("name", sorted(TORCH_INITS))
def test_torch_init_functions_replay_exactly(name):
    def build():
        lin = nn.Linear(6, 4)
        TORCH_INITS[name](lin.weight.data)
        return lin

    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    model = deferred_init(build)
    materialize_module(model)
    _assert_same_state(eager, model)


def test_tensors_created_on_a_deferred_tensors_device_replay_on_the_host():
    class FollowsDevice(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(5))
            with torch.no_grad():
                self.w.add_(torch.arange(5, device=self.w.device))
                self.w[torch.tensor([1, 3])] = 7.0

    model = deferred_init(FollowsDevice)
    materialize_module(model)
    assert model.w.device.type == "cpu"
    assert torch.equal(model.w, torch.tensor([0.0, 7.0, 2.0, 7.0, 4.0]))


def test_buffers_only():
    model = deferred_init(Toy)
    materialize_module(model, buffers_only=True)
    assert not model.pos.is_meta and model.w.is_meta


def test_cross_module_dependency_replays_correctly_when_materialized_alone():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Linear(4, 4, bias=False)
            with torch.no_grad():
                self.a.weight.copy_(torch.arange(16.0).view(4, 4))
                self.b.weight.copy_(self.a.weight.t() * 2)
                self.a.weight.zero_()  # b must see a's value *before* this

    model = deferred_init(Pair)
    materialize_module(model.b)
    assert torch.equal(model.b.weight, torch.arange(16.0).view(4, 4).t() * 2)
    assert model.a.weight.is_meta
    materialize_module(model.a)
    assert torch.equal(model.a.weight, torch.zeros(4, 4))


def test_default_dtype_at_construction_is_pinned():
    def build():
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return nn.Linear(2, 2)
        finally:
            torch.set_default_dtype(old)

    model = deferred_init(build)
    assert model.weight.dtype == torch.float64
    materialize_module(model)
    assert model.weight.dtype == torch.float64 and not model.weight.is_meta


def test_external_tensor_is_read_at_replay_and_mutation_is_detected():
    ext = torch.randn(3, 3)

    class Copy(nn.Module):
        def __init__(self, src):
            super().__init__()
            self.p = nn.Parameter(torch.empty(3, 3))
            with torch.no_grad():
                self.p.copy_(src)  # read by reference, not copied
                self.p.mul_(2)

    model = deferred_init(Copy, ext)
    materialize_module(model)
    assert torch.equal(model.p, ext * 2)

    model = deferred_init(Copy, ext)
    ext.add_(1.0)
    with pytest.raises(DeferredInitError, match="modified in place after deferred_init") as info:
        materialize_module(model)
    assert "Copy.__init__" in str(info.value)  # where the tensor was read
    assert "while materializing 'p'" in info.value.__notes__[0]


def test_item_in_constructor_is_a_clear_error():
    class ReadsBack(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))
            self.scale = self.w.abs().max().item()

    with pytest.raises(DeferredInitError) as info:
        deferred_init(ReadsBack)
    message = str(info.value)
    assert "read a tensor's value back into Python" in message
    assert "ReadsBack.__init__" in message and "test_deferred_init.py" in message


def test_data_dependent_shape_is_a_clear_error():
    class Nonzero(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("idx", torch.arange(5).remainder(2).nonzero())

    with pytest.raises(DeferredInitError, match="Nonzero.__init__.*cannot be deferred"):
        deferred_init(Nonzero)


def test_conversion_after_deferred_init_is_rejected_with_the_name():
    model = deferred_init(Toy)
    model.lin.double()
    with pytest.raises(DeferredInitError, match="'lin.weight' was replaced"):
        materialize_module(model)


def test_bad_arguments():
    with pytest.raises(TypeError, match="expects a function that returns an nn.Module"):
        deferred_init(lambda: torch.zeros(2))
    with pytest.raises(TypeError, match="is_deferred expects a torch.Tensor or nn.Module"):
        is_deferred("weight")


def test_deferred_build_allocates_far_less_than_the_model():
    width, depth = 2048, 12  # 12 x 4 MiB x 4 = ~200 MB of fp32 weights
    model_bytes = depth * width * width * 4

    before = _vmrss_bytes()
    model = deferred_init(lambda: nn.Sequential(*(nn.Linear(width, width) for _ in range(depth))))
    grown = _vmrss_bytes() - before
    assert grown < model_bytes / 20, f"deferred build grew RSS by {grown} bytes"

    materialize_module(model[0])
    assert not model[0].weight.is_meta and model[1].weight.is_meta
    assert model[0].weight.std().item() == pytest.approx(1 / math.sqrt(3 * width), rel=0.05)


# -- Hugging Face GPT-2 -----------------------------------------------------

transformers = pytest.importorskip("transformers")
N_LAYER = 2


def _gpt2_config():
    return transformers.GPT2Config(
        n_embd=64, n_layer=N_LAYER, n_head=2, vocab_size=128, n_positions=32,
        bos_token_id=0, eos_token_id=0,
    )


def _deferred_gpt2(seed):
    torch.manual_seed(seed)
    return deferred_init(transformers.GPT2LMHeadModel, _gpt2_config())


def test_gpt2_whole_model_materialization_equals_eager():
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel(_gpt2_config())
    model = _deferred_gpt2(0)
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight

    materialize_module(model)

    assert model.lm_head.weight is model.transformer.wte.weight
    _assert_same_state(eager, model)


def _per_block(model):
    """Materialize like FSDP: each block as a unit, then the rest."""
    blocks = list(model.transformer.h)
    inside = {id(m) for b in blocks for m in b.modules()}
    for block in blocks:
        materialize_module(block)
    materialize_module(model, check_fn=lambda m: id(m) not in inside)


def test_gpt2_per_unit_materialization_statistics_and_reproducibility():
    first = _deferred_gpt2(1)
    block_ids = {id(m) for m in first.transformer.h[1].modules()}
    materialize_module(first, check_fn=lambda m: id(m) not in block_ids)
    assert first.transformer.h[1].attn.c_attn.weight.is_meta
    assert not first.transformer.h[0].attn.c_attn.weight.is_meta
    assert not first.transformer.wte.weight.is_meta
    materialize_module(first.transformer.h[1])
    assert not is_deferred(first)

    runs = []
    for _ in range(2):
        model = _deferred_gpt2(1)
        _per_block(model)
        assert model.lm_head.weight is model.transformer.wte.weight
        runs.append(model)
    _assert_same_state(runs[0], runs[1])

    scaled = 0.02 / math.sqrt(2 * N_LAYER)
    for name, p in runs[0].named_parameters():
        if name.endswith("c_proj.weight"):
            assert p.std().item() == pytest.approx(scaled, rel=0.15), name
        elif "ln" in name and name.endswith("weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert p.std().item() == pytest.approx(0.02, rel=0.15), name
            assert abs(p.mean().item()) < 0.005, name


def test_recipe_call_shape_from_config_with_dtype_equals_eager():
    """The recipe's `deferred_init(AutoModelForCausalLM.from_config, config)`;
    `dtype=` makes Hugging Face switch the default dtype during construction."""
    auto = transformers.AutoModelForCausalLM
    torch.manual_seed(3)
    eager = auto.from_config(_gpt2_config(), dtype=torch.bfloat16)
    torch.manual_seed(3)
    model = deferred_init(auto.from_config, _gpt2_config(), dtype=torch.bfloat16)
    assert model.transformer.wte.weight.dtype == torch.bfloat16 and is_deferred(model)
    materialize_module(model, check_fn=lambda m: True)
    _assert_same_state(eager, model)


def test_recipe_spelling_through_the_package_export():
    from xla_fsdp import deferred_init as recipe_module  # torchdistx's module name

    model = recipe_module.deferred_init(nn.Linear, 2, 2)
    assert recipe_module.is_deferred(model)
    recipe_module.materialize_module(model, check_fn=lambda k: True)
    assert not model.weight.is_meta


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_fsdp_materializes_a_deferred_model_unit_by_unit():
    """The engine materializes inner units first, then the root; for a model
    built in that order the values equal eager construction (world size 1)."""
    pytest.importorskip("torch_xla")
    import functools

    import xla_fsdp

    torch.manual_seed(0)
    eager = _Stack()
    torch.manual_seed(0)
    model = deferred_init(_Stack)
    policy = functools.partial(xla_fsdp.transformer_auto_wrap_policy, transformer_layer_cls={_Layer})
    wrapped = xla_fsdp.XlaFullyShardedDataParallel(model, auto_wrap_policy=policy)

    assert not is_deferred(wrapped)
    reference = dict(eager.named_parameters())
    for name, p in wrapped.named_parameters():
        assert p.device.type == "xla", name
        assert torch.equal(p.cpu(), reference[name]), name
