"""Models built on the meta device need no param_init_fn: each unit is given storage and its
modules' own reset_parameters() right before it is sharded (FSDPv1's and FSDP2's default).
The result trains, keeps tied weights tied, and has the statistics of eager construction
(per tensor, mean and std within 4 standard errors of two independent draws; constant
tensors such as LayerNorm's are equal). XLA world 1 and gloo worlds 2 and 4 here;
the single-controller runtime (4 and 8 devices) and the GSPMD engine in tests/test_single_controller.py."""
import os

import pytest
import torch

import meta_cases
from parity_cases import run_distributed_fn

torch_xla = pytest.importorskip("torch_xla")


def test_meta_model_at_xla_world_1():
    meta_cases.check(meta_cases.run(device=torch_xla.device(), sync=torch_xla.sync))


def _worker(rank, world, tmp):
    result = meta_cases.run(world=world, rank=rank)
    if rank == 0:
        torch.save(result, os.path.join(tmp, "meta.pt"))


@pytest.mark.parametrize("world", [2, 4])
def test_meta_model_at_gloo(tmp_path, world):
    run_distributed_fn(_worker, world, str(tmp_path))
    meta_cases.check(torch.load(tmp_path / "meta.pt", weights_only=False))
