"""Our auto-wrap policies against torch_xla's own (torch_xla.distributed.fsdp.wrap): the same
parameters in the same order, each taking its settings positionally or by keyword, and the same
decision for every module of a model, recursing or not."""
import inspect

import pytest
import torch.nn as nn

import xla_fsdp.wrap as ours

theirs = pytest.importorskip("torch_xla.distributed.fsdp.wrap")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)
        self.fc = nn.Linear(8, 64)


def _modules():
    model = nn.Sequential(nn.Embedding(50, 8), nn.ModuleList([Block(), Block()]), nn.Linear(8, 50))
    return [(m, sum(p.numel() for p in m.parameters())) for m in model.modules()]


SETTINGS = {
    "size_based_auto_wrap_policy": [(300,), (600, {nn.Linear}), (100, None, {nn.Sequential})],
    "transformer_auto_wrap_policy": [({Block},), ({nn.Linear, nn.Embedding},)],
    "lambda_auto_wrap_policy": [(lambda m: isinstance(m, nn.Linear),)],
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_policy_has_torch_xlas_parameters_in_its_order(name):
    mine, reference = inspect.signature(getattr(ours, name)), inspect.signature(getattr(theirs, name))
    assert list(mine.parameters) == list(reference.parameters)
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in mine.parameters.values()), mine


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_policy_decides_as_torch_xlas_with_its_settings_positional_or_by_keyword(name):
    names = list(inspect.signature(getattr(theirs, name)).parameters)[3:]
    for settings in SETTINGS[name]:
        keywords = dict(zip(names, settings))
        for module, numel in _modules():
            for recurse in (True, False):
                want = bool(getattr(theirs, name)(module, recurse, numel, *settings))
                assert bool(getattr(ours, name)(module, recurse, numel, *settings)) == want, (module, recurse)
                assert bool(getattr(ours, name)(module, recurse, numel, **keywords)) == want, (module, recurse)
