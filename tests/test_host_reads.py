"""collective_engine/host_reads.py in this process: the guard is installed only while a region
runs, refuses only XLA tensors of the thread inside a region, and puts torch.Tensor back.
At 4 devices with real models: tests/test_hf_trainer.py (hf_host_reads.py)."""
import pytest
import torch

from xla_fsdp.collective_engine import host_reads, manual_region


def test_guard_comes_and_goes_and_spares_cpu_tensors():
    before = {name: torch.Tensor.__dict__.get(name) for name in host_reads.READS}
    with host_reads.refuse_host_reads(manual_region.in_manual_region):
        assert torch.Tensor.__bool__ is not before["__bool__"]
        manual_region._local.depth = 1
        try:
            assert bool(torch.ones(())) and torch.tensor(3).item() == 3 and f"{torch.tensor(1.5)}" == "1.5"
        finally:
            manual_region._local.depth = 0
    assert {name: torch.Tensor.__dict__.get(name) for name in host_reads.READS} == before


def test_xla_tensor_read_in_a_region_is_refused_by_line():
    xla = pytest.importorskip("torch_xla")
    t = torch.ones(2).to(xla.device())
    with host_reads.refuse_host_reads(manual_region.in_manual_region):
        manual_region._local.depth = 1
        try:
            with pytest.raises(host_reads.HostReadInManualRegion, match=r"test_host_reads.py:\d+ in test_xla"):
                t.sum().item()
            with pytest.raises(host_reads.HostReadInManualRegion, match=r"to\(\) of an XLA tensor"):
                t.to("cpu")
            with pytest.raises(host_reads.HostReadInManualRegion, match=r"to\(\) of an XLA tensor"):
                t.to(device=torch.device("cpu"), dtype=torch.float64)
            assert t.to(torch.float64).dtype == torch.float64 and t.to(t).device == t.device  # not reads
        finally:
            manual_region._local.depth = 0
        assert t.sum().item() == 2.0  # outside a region: read as usual
