"""What a Pallas kernel (`tpu_custom_call` in libtpu's optimized program) costs the step-time model.

[Note: charging Pallas kernels]
A `tpu_custom_call` holds no HLO dots (its work is inside the serialized Mosaic module), so a model that counts
dots would charge it nothing. It is charged here:
- Which kernel: the module's body (base64 in the backend config) names the Python functions that built it (Mosaic
  debug locations): jax's `flash_attention_kernel`, `flash_attention_dq_kernel`, `flash_attention_dkv_kernel` (the
  kernels torch_xla 2.9 calls), and `below_or_on_diag` only when built causal (docs/attention.md).
- FLOPs: 2 x B x H x Sq x Sk x D per matmul (forward 2: QK^T and PV; dq 3: QK^T recomputed, dO V^T, dS K; dkv 4:
  QK^T, P^T dO, dO V^T, dS^T Q), times the share of its grid blocks that run: causal, a block (r, c) of block_q x
  block_k_major runs when (r + 1) * block_q - 1 > c * block_k_major (jax's `below_or_on_diag`), at torch_xla's
  block sizes (`xla_fsdp.attention.rules.SEQUENCE_BLOCKS`).
- HBM bytes: each operand read and each result written once, except the operands streamed against the other
  sequence axis (forward and dq: K and V, once per query block that runs; dkv: all but K and V, once per key block).
- Time: max(FLOPs / (share x MXU peak), bytes / HBM bandwidth). No published MXU share of these kernels on v4/v5e
  is known, so projections are given at 50% and at 100%.
- Another Pallas kernel: the FLOPs of jax's `cost_estimate` in its backend config when it has one, else its bytes
  only; `KernelCost.flops_known` says which.
"""
from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Dict, List, Optional

from xla_fsdp.tpu import optimized_hlo as oh

TARGET = 'custom_call_target="tpu_custom_call"'
DEFAULT_MXU_SHARE = 0.5
# kernel -> (matmuls, (query block, key block) it skips by, operands streamed against the other axis)
FLASH = {
    "flash_dq": (3, ("block_q_dq", "block_k_major_dq"), "kv"),
    "flash_dkv": (4, ("block_q_major_dkv", "block_k_major_dkv"), "q"),
    "flash_forward": (2, ("block_q", "block_k_major"), "kv"),
}
_MARKERS = (("flash_dq", b"flash_attention_dq_kernel"), ("flash_dkv", b"flash_attention_dkv_kernel"),
            ("flash_forward", b"flash_attention_kernel"))  # dq / dkv bodies also name the forward's
_BODY = re.compile(r'"body":\s*"([A-Za-z0-9+/=]+)"')
_ESTIMATE = re.compile(r'"cost_estimate":\s*(\{[^}]*\})')


@dataclass
class KernelCost:
    """One Pallas kernel call, as the step-time model charges it."""

    kind: str          # "flash_forward" | "flash_dq" | "flash_dkv" | "pallas" (another kernel)
    causal: bool
    flops: float
    hbm_bytes: float
    flops_known: bool  # False: bytes only (no shapes or estimate to count FLOPs from)

    def seconds(self, chip, mxu_share: float = DEFAULT_MXU_SHARE) -> float:
        return max(self.flops / (mxu_share * chip.peak_bf16_flops), self.hbm_bytes / chip.hbm_bytes_per_s)


def is_pallas(ins: oh.Instruction) -> bool:
    return ins.opcode == "custom-call" and TARGET in ins.rest


def _body(rest: str) -> bytes:
    m = _BODY.search(rest)
    try:
        return base64.b64decode(m.group(1)) if m else b""
    except ValueError:
        return b""


def kind_of(rest: str) -> tuple:
    """(kernel kind, causal) from the custom call's backend config."""
    body = _body(rest)
    for kind, marker in _MARKERS:
        if marker in body:
            return kind, b"below_or_on_diag" in body
    return "pallas", False


def run_fraction(q_len: int, k_len: int, block_q: int, block_k: int, causal: bool) -> float:
    """The share of a kernel's (query block, key block) grid that runs."""
    if not causal:
        return 1.0
    rows, cols = max(q_len // block_q, 1), max(k_len // block_k, 1)
    ran = sum(1 for r in range(rows) for c in range(cols) if (r + 1) * block_q - 1 > c * block_k)
    return ran / (rows * cols)


def cost(ins: oh.Instruction, shapes: Dict[str, str]) -> KernelCost:
    """What one `tpu_custom_call` of the entry computation costs ([Note: charging Pallas kernels])."""
    from xla_fsdp.attention.rules import SEQUENCE_BLOCKS

    kind, causal = kind_of(ins.rest)
    operands = [shapes.get(o, "") for o in oh.operand_names(ins.rest)]
    sizes = [sum(oh.shape_bytes(s)) for s in operands]
    result = sum(oh.shape_bytes(ins.shape))
    if kind in FLASH and len(operands) >= 3 and len(oh.dims(operands[0])) == 4:
        matmuls, (bq_name, bk_name), streamed = FLASH[kind]
        b, h, q_len, d = oh.dims(operands[0])
        k_len = oh.dims(operands[1])[2]
        bq, bk = min(SEQUENCE_BLOCKS[bq_name], q_len), min(SEQUENCE_BLOCKS[bk_name], k_len)
        share = run_fraction(q_len, k_len, bq, bk, causal)
        flops = matmuls * 2.0 * b * h * q_len * k_len * d * share
        if streamed == "kv":  # K, V once per query block that runs
            reads = sum(sizes) + (sizes[1] + sizes[2]) * (q_len // bq * share - 1)
        else:  # dkv: all but K, V once per key block that runs
            others = sum(sizes) - sizes[1] - sizes[2]
            reads = sum(sizes) + others * (k_len // bk * share - 1)
        return KernelCost(kind, causal, flops, max(reads, sum(sizes)) + result, True)
    estimate = _ESTIMATE.search(ins.rest)
    flops = float(json.loads(estimate.group(1)).get("flops", 0)) if estimate else 0.0
    return KernelCost("pallas", causal, flops, sum(sizes) + result, estimate is not None)


def kernels(text: str) -> List[KernelCost]:
    """Every Pallas kernel call in the entry computation of an optimized program, charged."""
    comps = oh.computations(text)
    entry = comps.get("ENTRY", [])
    shapes = {i.name: i.shape for i in entry}
    return [cost(i, shapes) for i in entry if is_pallas(i)]


def flops_of(found: List[KernelCost], kind: Optional[str] = None) -> float:
    return sum(k.flops for k in found if kind is None or k.kind == kind)
