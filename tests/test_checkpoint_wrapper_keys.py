"""Units that are torch's CheckpointWrapper: every state dict and checkpoint has the
unwrapped model's keys and values, nothing dropped, and loads back (gloo world 2).

Before the fix full_state_dict built keys with `_checkpoint_wrapped_module.` in them
and then kept only those in model.state_dict() (whose keys CheckpointWrapper's hook
strips): the wrapped units' parameters and buffers silently vanished, and per-rank
consolidation passed their shards off as whole tensors.
"""
import os

import pytest
import torch

import checkpoint_wrapper_cases as cases
from parity_cases import run_distributed_fn


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt_wrapper"))
    run_distributed_fn(cases.run, 2, path)
    return path


def _load(out, name):
    value = torch.load(os.path.join(out, name), weights_only=False)
    assert not isinstance(value, str), f"{name}: the ranks raised {value}"
    return value


def _assert_plain(state, what, seed=0):
    plain = cases.build(seed).state_dict()
    assert list(state) == list(plain), what  # same keys, same order; no `_checkpoint_wrapped_module.`
    for key, value in plain.items():
        assert state[key].shape == value.shape, f"{what} {key}"
        assert torch.equal(state[key], value), f"{what} {key}"


def test_full_state_dict_has_the_plain_models_keys_and_values(out):
    full = _load(out, "full.pt")
    _assert_plain(full, "full_state_dict")
    plain = cases.build(5)
    plain.load_state_dict(full, strict=True)  # and it loads into the unwrapped model


@pytest.mark.parametrize("name", ["full_loaded.pt", "sharded_loaded.pt", "ckpt_loaded.pt",
                                  "ckpt_loaded_unwrapped.pt"])
def test_every_parameter_loads_back(out, name):
    # loaded into a differently seeded model, then gathered again: the saved model's values everywhere
    _assert_plain(_load(out, name), name)


def test_sharded_state_dict_uses_state_dict_keys(out):
    keys = _load(out, "sharded_keys.pt")
    assert keys == sorted(k for k in cases.build(0).state_dict() if k.endswith(("weight", "bias")))


def test_checkpoint_consolidates_under_state_dict_keys(out):
    from safetensors.torch import load_file

    state = load_file(os.path.join(out, "consolidated", "model.safetensors"))
    plain = cases.build(0).state_dict()
    # the sharded checkpoint keeps non-persistent buffers too (it resumes the run)
    assert set(state) == set(plain) | {"2.1.scratch"}
    for key, value in plain.items():
        assert torch.equal(state[key], value), key


def test_per_rank_consolidation_gives_whole_tensors(out):
    from xla_fsdp.checkpoint import consolidate_sharded_state_dicts

    ranks = [_load(out, f"rank{r}.pt") for r in range(2)]
    full = consolidate_sharded_state_dicts([c["model"] for c in ranks], ranks[0]["shard_metadata"])
    _assert_plain(full, "consolidate_sharded_state_dicts")


class _WithExtraState(torch.nn.Linear):
    """A state_dict() key that is neither a parameter nor a buffer."""

    def get_extra_state(self):
        return {"calls": 3}

    def set_extra_state(self, state):
        pass


def test_a_key_that_cannot_be_matched_is_an_error_naming_it():
    pytest.importorskip("torch_xla")
    from xla_fsdp import FSDP
    from xla_fsdp.checkpoint import full_state_dict, load_full_state_dict

    model = cases.build(0)
    model[3] = _WithExtraState(7, 3)
    model = FSDP(model)  # XLA world 1
    with pytest.raises(ValueError, match=r"model.state_dict\(\) has \['3._extra_state'\] which"):
        full_state_dict(model)
    with pytest.raises(ValueError, match=r"'3._extra_state'"):
        load_full_state_dict(model, cases.build(0).state_dict())
