"""The attention function transformers calls under `attn_implementation="pallas"`.

Model-agnostic: any transformers model that dispatches through `ALL_ATTENTION_FUNCTIONS` (GPT-2, Llama, ...) hands
it [batch, heads, seq, head_dim] queries, keys and values and gets [batch, seq, heads, head_dim] back, as from its
eager attention. The name holds no "flash": transformers takes such names for kernels to download from the hub.

[Note: the kernel's sharding]
- One process per chip: the kernel sees this chip's batch; no partition spec.
- Single controller, collective engine: the model's forward runs inside the engine's manual-sharding region
  (collective_engine/manual_region.py), where every tensor is already the device's own piece, and so does its
  recompute in backward (outside `in_manual_region()`, but on the same per-device tensors). The kernel is a
  per-device op there and must get no partition spec: torch_xla would open a second manual region and read the
  per-device batch as a shard of a larger one. run_clm gives no mesh (`use_mesh(None)`) then.
- Single controller with global tensors (the GSPMD engine, or no --fsdp): the batch is sharded on dim 0 over every
  mesh axis (runtime/mesh.py `batch_spec`), and torch_xla's `flash_attention(partition_spec=..., mesh=...)` runs
  the kernel per device under that spec; without one the partitioner would have to replicate a custom call it
  cannot split.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from xla_fsdp import abstract
from xla_fsdp.attention.rules import KernelInputError, check_shapes

NAME = "pallas"
_NO_PADDING = ("the Pallas attention kernel applies the causal mask itself and takes no attention_mask "
               "(padding): pack sequences into full blocks, as run_clm does, and pass none")

_state = threading.local()
_mesh = None  # the single controller's mesh, when the model sees global tensors


def use_mesh(mesh) -> None:
    """The batch's mesh where the model sees global tensors, None where per-device ([Note: the kernel's sharding])."""
    global _mesh
    _mesh = mesh


def register() -> None:
    """Make `attn_implementation="pallas"` mean this function in transformers (idempotent), with a mask hook:
    transformers hands an attention function it has no mask hook for no mask at all, which would drop a padding
    mask silently; `padding_mask_refused` refuses it instead."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, pallas_attention)
    AttentionMaskInterface.register(NAME, padding_mask_refused)


def padding_mask_refused(attention_mask=None, **kwargs):
    """transformers' mask hook for "pallas": no mask (the kernel masks causally); a padding mask is an error."""
    if attention_mask is not None:
        raise KernelInputError(_NO_PADDING)
    return None


@contextmanager
def interpret_on_cpu():
    """Run the kernel in Pallas interpret mode on CPU tensors (tests: numerics, never speed)."""
    previous = getattr(_state, "interpret", False)
    _state.interpret = True
    try:
        yield
    finally:
        _state.interpret = previous


def refuse_unsupported(dropout, attention_mask) -> None:
    """What reaches the kernel at call time that it cannot do: attention dropout, a padding mask."""
    if dropout and dropout > 0:
        raise KernelInputError(f"attention dropout {dropout:g} reached the Pallas attention kernel, which has "
                               "none; set the config's attn_pdrop (GPT-2) / attention_dropout (Llama) to 0")
    if attention_mask is not None:
        raise KernelInputError(_NO_PADDING)


def pallas_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None,
                     **kwargs):
    """transformers' attention-function contract: (output [b, s, h, d], no attention weights)."""
    refuse_unsupported(dropout, attention_mask)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    key, value = per_query_head(query, key, value)
    check_shapes(tuple(query.shape), tuple(key.shape))
    scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    out = head_major_attention(query, key, value, causal, scale)
    return out.transpose(1, 2).contiguous(), None


def per_query_head(query, key, value):
    """Grouped-query attention's key/value heads repeated for their query heads: the kernel wants one per query head."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    return key, value


def head_major_attention(query, key, value, causal: bool, scale: float) -> torch.Tensor:
    """The kernel on [batch, heads, seq, head_dim], output alike: on (or traced for) a TPU, or `interpret_on_cpu()`."""
    if getattr(_state, "interpret", False):
        from xla_fsdp.attention.interpret import flash_attention_interpreted

        return flash_attention_interpreted(query, key, value, causal, scale)
    import torch_xla.runtime as xr

    if not abstract.active() and (query.device.type != "xla" or xr.device_type() != "TPU"):
        where = query.device.type if query.device.type != "xla" else f"XLA:{xr.device_type()}"
        raise KernelInputError(f"--attn_implementation {NAME} runs torch_xla's Pallas kernel, which needs a TPU; "
                               f"this runs on {where}. Use --attn_implementation eager here (make train does), "
                               f"and check the TPU job with python -m xla_fsdp.aot --tpu v5e-8 -- launch/run_clm.py ...")
    if abstract.active():
        from xla_fsdp.tpu import pallas_trace

        pallas_trace.install()  # [Note: Pallas kernels in the ahead-of-time check]
    else:
        from xla_fsdp.tpu import mosaic

        mosaic.pin_ir_version()  # [Note: Mosaic IR version for libtpu 0.0.21]
    from torch_xla.experimental.custom_kernel import flash_attention

    spec, mesh = _partition(query)
    return flash_attention(query, key, value, causal=causal, sm_scale=scale, partition_spec=spec, mesh=mesh)


def mix_head_major(model: torch.nn.Module, attention: type, mixin: type, takes=lambda module: True) -> int:
    """Mix `mixin` (a head-major forward) into each `attention` module of `model` that `takes` accepts and that does
    not have it yet (only its class changes); how many."""
    from xla_fsdp.class_swap import mix_into

    chosen = [m for m in model.modules() if isinstance(m, attention) and takes(m) and not isinstance(m, mixin)]
    for module in chosen:
        mix_into(module, mixin, "")
    return len(chosen)


def _partition(query):
    """([Note: the kernel's sharding]) the partition spec and mesh for torch_xla, or (None, None)."""
    from xla_fsdp.collective_engine.manual_region import in_manual_region

    if _mesh is None or in_manual_region():
        return None, None
    from xla_fsdp.runtime.mesh import batch_spec

    return batch_spec(query, _mesh), _mesh
