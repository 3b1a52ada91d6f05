"""The check (`python -m xla_fsdp.aot`) on jobs with recomputation policies: libtpu 0.0.21 compiles
the offloaded policies' host moves ([Note: host offload]) on both engines, scanned and not, and the
report names the policy each block got and the moves ([Note: host transfers in libtpu's program]).
Real traces and real libtpu compiles of the tiny Llama (configs/models/llama-tiny.json)."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from common import aot_cases as ac  # noqa: E402

pytest.importorskip("libtpu", reason="the TPU compiler comes with `pip install -e .[tpu-aot]` (make test installs it)")

MODEL = os.path.join(ac.ROOT, "configs", "models", "llama-tiny.json")
BATCH, SEQ = 4, 128


def _check(tmp_path, base: str, policy: str) -> dict:
    with open(os.path.join(ac.ROOT, "configs", "fsdp", base)) as f:
        cfg = json.load(f)
    cfg.setdefault("xla_fsdp_settings", {})["remat_policy"] = policy
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(cfg))
    cmd = [ac.RUN_CLM, "--config_name", MODEL, "--fsdp", "full_shard", "--fsdp_config", str(path),
           "--per_device_train_batch_size", str(BATCH), "--block_size", str(SEQ), "--output_dir",
           str(tmp_path / "out"), "--do_train"]
    got = ac.check("v4-8", cmd, runtime="auto", timeout=900)
    r = got["report"]
    assert got["rc"] == 0 and r and r["compiles"] and r["fits"], got["output"]
    return r


def _per_layer_bytes(widths, itemsize: int = 2) -> int:
    """Bytes one layer saves per chip: BATCH x SEQ tokens of values of these widths (bf16 default)."""
    return BATCH * SEQ * sum(widths) * itemsize


@pytest.mark.parametrize("base", ["llama_xla_fsdp_scan.json", "llama_xla_fsdp_v2_scan.json"],
                         ids=["collectives", "gspmd"])
def test_scanned_offload_compiles_and_is_reported(tmp_path, base):
    """Both engines' loops: the collectives engine's saved stack, and the GSPMD engine's partitioner
    moving the marked values ([Note: saved outputs under AOTAutograd])."""
    cfg = json.load(open(MODEL))
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = hidden * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    r = _check(tmp_path, base, "minimal_offloaded")
    assert r["recompute"] == [{"block": "LlamaDecoderLayer", "where": "scanned", "policy": "minimal_offloaded",
                               "count": layers, "saves": r["recompute"][0]["saves"]}], r["recompute"]
    h = r["host_transfers"]
    # the layer's input and q, k, v, o, gate, up of each layer go to the host and come back
    want = layers * _per_layer_bytes([hidden, hidden, kv, kv, hidden, inter, inter])
    assert h["to_host_bytes"] == want and h["to_device_bytes"] == want, h
    assert h["host_buffer_bytes"] == want and h["moves"] == 2 * 7 * layers, h
    assert h["with_matmul"] > 0 and h["pcie_seconds"] > 0, h
    # the step charged with the moves: never shorter than the core's step or the busier direction's PCIe time
    assert h["exposed_seconds"] >= 0, h
    assert h["projected_seconds"] == pytest.approx(max(r["projection"]["projected_seconds"] + h["exposed_seconds"],
                                                       h["pcie_seconds"])), h


# -m slow: the GSPMD engine's unscanned offload (copies to the host) through libtpu; both engines' scanned
# offload above stays
@pytest.mark.slow
def test_unscanned_offload_on_the_gspmd_engine_is_reported(tmp_path):
    cfg = json.load(open(MODEL))
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = hidden * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    r = _check(tmp_path, "llama_xla_fsdp_v2.json", "qkv_proj_offloaded")
    assert [(b["where"], b["policy"], b["count"]) for b in r["recompute"]] == \
        [("checkpointed", "qkv_proj_offloaded", layers)], r["recompute"]
    h = r["host_transfers"]
    # the layer's input, q, k and v, in bf16 (the shipped llama_xla_fsdp_v2.json's compute_dtype)
    want = layers * _per_layer_bytes([hidden, hidden, kv, kv])
    assert h["to_host_bytes"] == want and h["to_device_bytes"] == want, h
