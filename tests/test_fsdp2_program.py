"""The FSDP2 example's training step as a program: what it gathers and reduce-scatters.

examples/fsdp2_llama.py (tiny preset: two DecoderLayers sharded per layer, then the root
holding the embedding, the final norm and the head) at 8 devices:
- on XLA:CPU, read from XLA's dump right after SPMD partitioning: native all-gathers of
  the shards and reduce-scatters of the gradients (all_gather_impl="auto" is the native
  gather off a TPU: [Note: rings by default on a TPU]), no all-reduce of anything but scalars;
- through the TPU check (`python -m xla_fsdp.aot --tpu v5e-8`, `pytest -m slow`): libtpu
  compiles the step, and "auto" there means rings, so the gathers and reduce-scatters are rings
  of asynchronous collective-permutes.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import socket
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from common import aot_cases as ac  # noqa: E402
from common.hlo_graph import HloGraph  # noqa: E402

EXAMPLE = os.path.join(ac.ROOT, "examples", "fsdp2_llama.py")
DEVICES = 8
LAYERS = 2  # the tiny preset
ROOT_PARAMS = 3  # tok_embeddings, norm, output: the root's parameters, gathered one by one
# forward: every layer and the root's parameters; backward: the layers again (resharded after
# forward), the root never (FSDP2's root keeps its parameters after forward)
GATHERS = 2 * LAYERS + ROOT_PARAMS
REDUCE_SCATTERS = LAYERS + ROOT_PARAMS
# padded parameter elements (rows padded to a multiple of 8): per layer 46208 (all its
# parameters flat), the root 2 x 264 x 64 + 64
PADDED_ELEMENTS = LAYERS * 46208 + 2 * 264 * 64 + 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory):
    """The second step's per-device program after SPMD partitioning on XLA:CPU."""
    dump = tmp_path_factory.mktemp("fsdp2_program")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(DEVICES), MASTER_PORT=str(_free_port()),
               PYTHONPATH=ac.ROOT,
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_pass_re=spmd-partitioning"
               " --xla_dump_hlo_module_re=SyncTensorsGraph --xla_dump_hlo_pipeline_re=spmd-partitioner")
    for name in ("XLA_USE_SPMD", "XLA_FSDP_RUNTIME", "XLA_FSDP_ENGINE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, EXAMPLE, "--steps", "2"], cwd=ac.ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # module files are numbered in compile order; the step is the last one with reduce-scatters
    texts = [open(p).read() for p in sorted(glob.glob(str(dump / "*after_spmd-partitioning*.txt")))]
    steps = [t for t in texts if " reduce-scatter(" in t]
    assert steps, "no partitioned module holds a reduce-scatter"
    return HloGraph(steps[-1])


def test_the_step_gathers_and_reduce_scatters_the_shards_natively_on_cpu(partitioned):
    graph = partitioned
    kinds = [i.opcode for i in graph.instrs.values()]
    assert kinds.count("all-gather") == GATHERS, kinds.count("all-gather")
    assert kinds.count("reduce-scatter") == REDUCE_SCATTERS, kinds.count("reduce-scatter")
    assert "collective-permute" not in kinds and "all-to-all" not in kinds
    collectives = graph.collectives(("all-gather", "reduce-scatter", "all-reduce"))
    for ins in collectives:
        assert "replica_groups={{0,1,2,3,4,5,6,7}}" in ins.attrs, ins.attrs
        # one program for every device: nothing pinned ([Note: no pinning in one program])
        assert "constrain_layout=true" not in ins.attrs, ins.name
    scattered = 0
    for ins in collectives:
        operand = graph.instrs[ins.operands[0]].shape
        if ins.opcode == "all-gather":  # a shard in, the whole (padded) unit out
            assert ins.shape[0] == DEVICES * operand[0] and ins.shape[1:] == operand[1:], ins.name
        elif ins.opcode == "reduce-scatter":  # the whole gradient in, this device's shard out
            assert operand[0] == DEVICES * ins.shape[0] and ins.shape[1:] == operand[1:], ins.name
            scattered += DEVICES * ins.shape[0]
        else:  # the loss and the clipping norms: never a parameter or gradient
            assert ins.shape == [], f"{ins.name} all-reduces {ins.shape}"
    assert scattered == PADDED_ELEMENTS  # every parameter's gradient, once


# -m slow: in the default run an FSDP2 script's step compiles for TPU under the check in
# tests/test_fsdp2_port.py (v4-8, the single controller), and "auto" making every gather and
# reduce-scatter a ring of asynchronous collective-permutes on v5e-8 is compiled by
# tests/test_tpu_compile_matrix.py::test_default_configuration_runs_its_collectives_asynchronously_beside_compute
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="the TPU compiler comes with `pip install -e .[tpu-aot]` (make test installs it)")
def test_the_tiny_example_compiles_for_v5e_8_with_rings_of_async_permutes():
    """`python -m xla_fsdp.aot --tpu v5e-8 -- examples/fsdp2_llama.py --steps 2`: the example
    traced with placeholders (meta parameters given storage by to_empty, reset_parameters and
    the set-up sync skipped, the loss logged after the first step read as zeros) and compiled
    by libtpu. About 25 s here."""
    got = ac.check("v5e-8", [EXAMPLE, "--steps", "2"], timeout=600)
    report = got["report"]
    assert got["rc"] == 0 and report is not None, got["output"]
    assert report["runtime"] == "single_controller" and report["program"] == "spmd", report
    assert report["compiles"] and report["fits"], report.get("error")
    by_kind = report["collectives"]["by_kind"]
    # every gather and reduce-scatter a ring: one permute per hop (7 at 8 chips), all asynchronous
    assert set(by_kind) <= {"collective-permute", "all-reduce"}, by_kind
    permutes = by_kind["collective-permute"]
    assert permutes["async"] == (GATHERS + REDUCE_SCATTERS) * (DEVICES - 1) and permutes["sync"] == 0, permutes
    # what stays synchronous is scalars (the loss, the clipping norm), combined by libtpu
    assert by_kind.get("all-reduce", {}).get("bytes", 0) <= 64, by_kind
    assert permutes["async_bytes"] == permutes["bytes"] > 0, permutes


def test_the_traced_child_gets_a_free_rendezvous_port_unless_one_is_set(tmp_path, monkeypatch):
    """[Note: the traced child's rendezvous port]: another job holding 12355 must not fail the check."""
    from xla_fsdp.aot import trace

    job = trace.Job(EXAMPLE, [], trace.SINGLE_CONTROLLER, DEVICES)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    port = int(trace.child_env(job, str(tmp_path), 2)["MASTER_PORT"])
    assert 0 < port < 65536
    monkeypatch.setenv("MASTER_PORT", "29123")
    assert trace.child_env(job, str(tmp_path), 2)["MASTER_PORT"] == "29123"
