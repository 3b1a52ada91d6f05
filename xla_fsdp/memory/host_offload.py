"""Saved activations that wait in the host's memory: the "offloaded" recomputation policies.

[Note: host offload]
A policy ending in "_offloaded" ([Note: recomputation policies] in remat_policy.py) moves what a checkpointed block
saves for its backward (its input, and the matmul outputs the policy saves) to the host after the forward made it,
and back before the backward reads it. The moves are `annotate_device_placement` custom calls (as torch_xla's
`xla::place_to_host` / `place_to_device`) that libtpu's host-offload passes turn into asynchronous copies over
PCIe, scheduled beside the compute (JAX's `offload_dst="pinned_host"` lowers to the same annotations). Under scan
the forward loop's saved stack is written to a host buffer one layer per trip and the backward loop reads it back a
trip ahead. They are emitted only for a TPU (on one, or traced by the check for one): XLA:CPU has no host memory
space, so there the tensors stay where they are and the step computes the same values. The check counts the bytes
that cross and what a VM's host holds ([Note: host transfers in libtpu's program] in tpu/host_transfers.py).
"""
from __future__ import annotations

import functools

import torch

from xla_fsdp.abstract import tpu_target as _active


def _placed(t: torch.Tensor, where: str) -> torch.Tensor:
    """torch_xla's place_to_host / place_to_device, with api_version 1 (ORIGINAL): torch_xla's own say 0,
    UNSPECIFIED, which XLA's HLO text parser refuses (the check hands libtpu HLO text)."""
    import torch_xla

    return torch_xla._XLAC._xla_custom_call([t], "annotate_device_placement", [list(t.shape)], [t.dtype], True,
                                            "", 1, {"_xla_buffer_placement": where})[0]


@functools.lru_cache(maxsize=None)  # registered once
def _ops():
    @torch.library.custom_op("xla_fsdp::to_host", mutates_args=())
    def to_host_op(t: torch.Tensor) -> torch.Tensor:
        return _placed(t, "pinned_host")

    @torch.library.custom_op("xla_fsdp::to_device", mutates_args=())
    def to_device_op(t: torch.Tensor) -> torch.Tensor:
        return _placed(t, "device")

    for op in (to_host_op, to_device_op):
        op.register_fake(lambda t: torch.empty_like(t))
        op.register_autograd(lambda ctx, grad: grad)
    return torch.ops.xla_fsdp.to_host.default, torch.ops.xla_fsdp.to_device.default


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t`, annotated to live in host memory from here on (a TPU target; else `t` itself)."""
    return _placed(t, "pinned_host") if _active() and t.device.type == "xla" else t


def to_device(t: torch.Tensor) -> torch.Tensor:
    """`t`, brought back to device memory (the inverse of `to_host`)."""
    return _placed(t, "device") if _active() and t.device.type == "xla" else t


def graph_ops():
    """(to host, to device) as ops an AOTAutograd graph (the GSPMD scan) can call; None where moves are not emitted."""
    return _ops() if _active() else None
