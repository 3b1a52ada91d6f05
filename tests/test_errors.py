"""Bad input gets a clear error naming what is wrong and how to fix it, and the
module is left exactly as it was (XLA:CPU, world size 1)."""
import pytest
import torch
import torch.nn as nn

import xla_fsdp
from xla_fsdp import FSDP

pytest.importorskip("torch_xla")


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


def _untouched(module: nn.Module, cls: type, shapes: dict) -> None:
    assert type(module) is cls
    assert {n: tuple(p.shape) for n, p in module.named_parameters()} == shapes
    assert not hasattr(module, "_fsdp_state")


def test_unknown_keyword_names_it_and_suggests():
    with pytest.raises(TypeError, match=r"'reshard_after_forwrd' \(did you mean 'reshard_after_forward'\?\)"):
        FSDP(nn.Linear(2, 2), reshard_after_forwrd=False)


def test_wrapping_twice_is_refused():
    m = FSDP(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="already wrapped by XlaFullyShardedDataParallel"):
        FSDP(m)


def test_sharding_group_without_this_rank_leaves_module_alone():
    m = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    with pytest.raises(ValueError, match=r"do not contain this rank \(0\)"):
        FSDP(m, sharding_groups=[[1]], auto_wrap_policy=xla_fsdp.always_wrap_policy)
    _untouched(m, nn.Sequential, shapes)
    assert all(type(c) is nn.Linear for c in m)


def test_module_without_forward():
    with pytest.raises(ValueError, match=r"ModuleList has no forward\(\).*wrap its children"):
        FSDP(nn.ModuleList([nn.Linear(2, 2)]))


def test_tied_weights_split_across_units_names_both():
    m = Tied()
    m.head = FSDP(m.head)
    with pytest.raises(ValueError, match=r"'emb.weight' of Tied is tied to 'head.weight'.*wrap their common parent"):
        FSDP(m)


def test_auto_wrap_keeps_tied_weights_in_the_parent():
    m = Tied()
    m = FSDP(m, auto_wrap_policy=xla_fsdp.always_wrap_policy)
    assert isinstance(m.body, FSDP)  # an untied child becomes a unit
    assert not isinstance(m.head, FSDP) and not isinstance(m.emb, FSDP)
    assert m.head.weight is m.emb.weight  # still one (sharded) parameter
    out = m(torch.tensor([[1, 2, 3]]).to(m.head.weight.device))
    assert out.shape == (1, 3, 10)


@pytest.mark.parametrize("kwargs,message", [
    ({"all_gather_impl": "rings"}, r"all_gather_impl='rings' is not valid; use one of \('auto', 'all_gather', 'all_reduce', 'ring'\)"),
    ({"all_gather_impl": "ring"}, r"all_gather_impl='ring' needs the single-controller runtime"),
    ({"sharding_strategy": "HYBRID_SHARD"}, r"HYBRID_SHARD needs sharding_groups"),
    ({"sharding_strategy": "PARTIAL"}, r"sharding_strategy='PARTIAL' is not valid; use one of: FULL_SHARD"),
    ({"compute_dtype": torch.int8}, r"compute_dtype=torch.int8 is not supported"),
    ({"sharding_groups": [[0]], "sharding_rank": 1}, r"sharding_rank=1 but this rank \(0\) is position 0"),
    ({"engine": "gspmd"}, r"engine='gspmd' is not valid"),
    ({"mesh": object()}, r"mesh= needs the SPMD runtime"),
])
def test_bad_options_leave_module_untouched(kwargs, message):
    m = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=message):
        FSDP(m, **kwargs)
    _untouched(m, nn.Linear, {"weight": (3, 4), "bias": (3,)})


def test_spmd_engine_rejects_collective_options():
    with pytest.raises(ValueError, match=r"engine='spmd' does not use all_gather_impl"):
        FSDP(nn.Linear(2, 2), engine="spmd", all_gather_impl="all_reduce")
    with pytest.raises(ValueError, match=r"engine='spmd' has no checkpoint_all_but_last"):
        FSDP(nn.Linear(2, 2), engine="spmd", activation_checkpointing=True, checkpoint_all_but_last=1)


def test_positional_options_and_non_modules():
    with pytest.raises(TypeError, match="options as keywords"):
        FSDP(nn.Linear(2, 2), True)
    with pytest.raises(TypeError, match="expects an nn.Module, got Tensor"):
        FSDP(torch.zeros(2))


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))

    def forward(self, x):
        return x @ self.w


def test_meta_module_without_reset_parameters_is_named_and_left_alone():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(4, 4), NoReset())
    with pytest.raises(ValueError, match=r"no reset_parameters\(\) to initialize them: 1 \(NoReset\).*"
                                         r"deferred_init.*param_init_fn"):
        FSDP(m)
    assert type(m) is nn.Sequential and all(p.is_meta for p in m.parameters())


def test_clip_on_nested_unit_is_refused():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    m = FSDP(m, auto_wrap_policy=xla_fsdp.always_wrap_policy)
    m(torch.zeros(1, 3).to(m[0].weight.device)).sum().backward()
    with pytest.raises(ValueError, match="call clip_grad_norm_ on the root unit"):
        m[0].clip_grad_norm_(1.0)


def test_names_and_shards():
    m = nn.Sequential(nn.Linear(3, 5), nn.Sequential(nn.Linear(5, 2)))
    names = [n for n, _ in m.named_parameters()]
    m = FSDP(m, auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["Linear"]))
    assert [n for n, _ in m.named_parameters()] == names
    assert list(m.state_dict().keys()) == ["0.weight", "0.bias", "1.0.weight", "1.0.bias"]
    assert isinstance(m[0], FSDP) and isinstance(m[1][0], FSDP)


def test_unknown_instance_forward_is_refused_and_left_alone():
    m = nn.Linear(4, 4)
    m.forward = lambda x: x * 2  # nobody can tell what this reads, or when
    with pytest.raises(ValueError, match=r"Linear has an instance-level forward \(.*<lambda>\).*never gather"):
        FSDP(m)
    assert type(m) is nn.Linear and m.forward(torch.ones(1)).item() == 2.0


def test_forward_replaced_after_wrapping_is_refused_at_call():
    m = FSDP(nn.Linear(4, 4))
    m.forward = lambda x: x
    with pytest.raises(RuntimeError, match=r"Linear was given an instance-level forward .* after it was wrapped"):
        m(torch.ones(1, 4).to(m.weight.device))


def test_checkpointed_module_inside_a_unit_is_refused():
    from torch_xla.distributed.fsdp import checkpoint_module as txla_checkpoint

    m = nn.Sequential(nn.Linear(4, 4), txla_checkpoint(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match=r"1 \(Linear\) inside Sequential recompute\(s\) in backward.*unit of its own"):
        FSDP(m)
    assert type(m) is nn.Sequential and not hasattr(m, "_fsdp_state")
