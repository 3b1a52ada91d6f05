"""The step-time model charges Pallas kernels: torch_xla's flash attention, forward and backward,
traced on this host for the TPU and compiled by libtpu (deviceless), then projected. A kernel
charged nothing (0 FLOPs, 0 s) fails here."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("libtpu") is None or importlib.util.find_spec("jax") is None:
    pytest.skip("libtpu's TPU compiler and jax are not installed: `pip install -e .[tpu-aot]`",
                allow_module_level=True)

from xla_fsdp.tpu import kernel_cost, step_time  # noqa: E402

B, H, S, D = 1, 2, 1024, 128
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_TRACE_AND_COMPILE = """
import sys
import torch, torch_xla
from torch_xla.experimental.custom_kernel import flash_attention
from xla_fsdp.tpu import compile_options as co, pallas_trace, pjrt, topology
B, H, S, D, causal, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6]
pallas_trace.install()
dev = torch_xla.device()
q, k, v = (torch.randn(B, H, S, D, dtype=torch.bfloat16).to(dev).requires_grad_() for _ in range(3))
o = flash_attention(q, k, v, causal=causal, sm_scale=D ** -0.5)
o.float().sum().backward()
hlo = torch_xla._XLAC._get_xla_tensors_hlo([o, q.grad, k.grad, v.grad])
compiler = pjrt.get_compiler()
spec = topology.parse_accelerator_type("v5e-8")
with compiler.topology(spec.topology_name, spec.options) as slice_:
    text = compiler.compile(slice_, co.hlo_text_to_proto(hlo), co.per_process_options(slice_.device_ids)).optimized_hlo
open(out, "w").write(text)
"""


def _flash_program(causal: bool, tmp_path) -> str:
    """libtpu's optimized program of one flash attention, forward and backward, on v5e: traced and
    compiled in a process of its own (the check's patches stay out of the test process)."""
    out = tmp_path / f"flash_{int(causal)}.hlo.txt"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_USE_SPMD", None)
    proc = subprocess.run([sys.executable, "-c", _TRACE_AND_COMPILE, str(B), str(H), str(S), str(D),
                           "1" if causal else "0", str(out)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out.read_text()


@pytest.fixture(scope="module")
def causal_program(tmp_path_factory):
    return _flash_program(True, tmp_path_factory.mktemp("flash"))


def test_every_flash_kernel_is_charged_its_flops_and_bytes(causal_program):
    found = kernel_cost.kernels(causal_program)
    assert sorted(k.kind for k in found) == ["flash_dkv", "flash_dq", "flash_forward"]
    assert all(k.causal and k.flops_known and k.flops > 0 and k.hbm_bytes > 0 for k in found), found
    per_matmul = 2.0 * B * H * S * S * D
    # causal at 512 x 512 blocks: 3 of 4 run; dq's 1024-row query block spans the whole sequence
    assert kernel_cost.flops_of(found, "flash_forward") == 2 * per_matmul * 0.75
    assert kernel_cost.flops_of(found, "flash_dq") == 3 * per_matmul
    assert kernel_cost.flops_of(found, "flash_dkv") == 4 * per_matmul * 0.75


def test_the_step_time_model_never_charges_a_kernel_nothing(causal_program):
    half = step_time.estimate(causal_program, step_time_chip(), devices=1, kernel_mxu_share=0.5)
    full = step_time.estimate(causal_program, step_time_chip(), devices=1, kernel_mxu_share=1.0)
    assert half.kernel_calls == 3 and half.kernels_without_flops == 0
    assert half.kernel_flops > 0 and half.kernel_seconds > 0, "a Pallas kernel was charged nothing"
    assert half.flops >= half.kernel_flops and half.compute_seconds >= half.kernel_seconds
    # at least the roofline of the kernels' FLOPs at the share asked for
    assert half.kernel_seconds >= half.kernel_flops / (0.5 * step_time_chip().peak_bf16_flops)
    assert full.kernel_seconds >= full.kernel_flops / step_time_chip().peak_bf16_flops
    assert half.kernel_seconds > full.kernel_seconds
    assert half.seconds > full.seconds
    with pytest.raises(ValueError, match="kernel_mxu_share"):
        step_time.estimate(causal_program, step_time_chip(), devices=1, kernel_mxu_share=0)


def test_a_non_causal_kernel_runs_its_whole_grid(tmp_path):
    found = kernel_cost.kernels(_flash_program(False, tmp_path))
    assert not any(k.causal for k in found)
    assert kernel_cost.flops_of(found) == 9 * 2.0 * B * H * S * S * D


def test_causal_block_share_follows_jaxs_below_or_on_diag():
    assert kernel_cost.run_fraction(1024, 1024, 512, 512, True) == 0.75
    assert kernel_cost.run_fraction(1024, 1024, 1024, 512, True) == 1.0
    assert kernel_cost.run_fraction(2048, 2048, 512, 512, True) == 10 / 16
    assert kernel_cost.run_fraction(2048, 2048, 512, 512, False) == 1.0


def step_time_chip():
    from xla_fsdp.tpu import topology

    return topology.parse_accelerator_type("v5e-8").chip
