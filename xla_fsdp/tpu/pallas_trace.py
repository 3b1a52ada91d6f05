"""Tracing torch_xla's Pallas kernels on a host without a TPU, for libtpu's deviceless compiler.

[Note: Pallas kernels in the ahead-of-time check]
torch_xla turns a Pallas kernel into a `tpu_custom_call` by lowering it with jax (`trace_pallas` in
torch_xla/experimental/custom_kernel.py), for jax's default backend: on the check's CPU host the CPU, where Pallas
refuses ("Only interpret mode is supported on CPU backend"). `trace_for_tpu` lowers for the TPU instead
(`jax.jit(kernel).trace(*args).lower(lowering_platforms=("tpu",))`, jax 0.7.1) and hands torch_xla the same
backend config, the Mosaic version capped as on a TPU ([Note: Mosaic IR version for libtpu 0.0.21] in mosaic.py).
`install()` swaps it in only while the check traces a job (the kernel's caller calls it when
`xla_fsdp.abstract.active()`), process-wide because torch_xla traces the backward kernels when autograd runs them,
outside any call of ours; the traced process ends after the check. On a TPU torch_xla's own `trace_pallas` runs.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, Optional, Tuple

_lock = threading.Lock()
_original: Optional[Callable] = None
_payloads: Dict[Tuple[Any, ...], str] = {}  # one lowering per kernel and shapes: 3 per layer otherwise


def trace_for_tpu(kernel: Callable, *args, static_argnums=None, static_argnames=None, use_cache=False,
                  **kwargs):
    """torch_xla's `trace_pallas` contract (payload, tensor arguments), lowered for the TPU platform."""
    import jax
    import torch
    from torch_xla.experimental import custom_kernel

    tensors = [arg for arg in args if torch.is_tensor(arg)]
    jax_args = [custom_kernel.to_jax_shape_dtype_struct(arg) if torch.is_tensor(arg) else arg for arg in args]
    key = (kernel, static_argnums, tuple(static_argnames or ()), tuple(map(repr, jax_args)),
           repr(sorted(kwargs.items())))
    if key not in _payloads:
        jitted = jax.jit(kernel, static_argnums=static_argnums, static_argnames=static_argnames)
        ir = jitted.trace(*jax_args, **kwargs).lower(lowering_platforms=("tpu",)).compiler_ir()
        payload = custom_kernel._extract_backend_config(ir)
        if payload is None:
            raise RuntimeError(f"lowering {getattr(kernel, '__name__', kernel)} for the TPU gave no "
                               "tpu_custom_call; torch_xla's Pallas glue and jax disagree (pins: torch_xla "
                               "2.9.0, jax 0.7.1)")
        _payloads[key] = payload
    return _payloads[key], tensors


def installed() -> bool:
    return _original is not None


def install() -> None:
    """Route torch_xla's Pallas tracing through `trace_for_tpu` in this process (idempotent)."""
    global _original
    with _lock:
        if _original is not None:
            return
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no TPU here: jax must not look for one
        from torch_xla.experimental import custom_kernel

        from xla_fsdp.tpu import mosaic

        mosaic.pin_ir_version()
        _original = custom_kernel.trace_pallas
        custom_kernel.trace_pallas = trace_for_tpu
