"""Meta parameters as torch_xla placeholders, for the anchors' jobs under the TPU check
(bench/anchor_job.py, bench/llama_engine_job.py): torch_xla's engines place what they are
given, so the model's tensors become placeholders (xla_fsdp.abstract) before they wrap it."""
from __future__ import annotations

import torch.nn as nn

from xla_fsdp.abstract import placeholder


def to_placeholders(module: nn.Module, spmd: bool) -> None:
    """Every meta parameter / buffer of `module` becomes a placeholder on the XLA device (tied
    parameters stay tied). Under SPMD `* 1` makes it an IR value that mark_sharding can annotate
    (a placeholder itself is refused)."""
    memo = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in memo:
                    t = placeholder(p.shape, p.dtype)
                    memo[id(p)] = nn.Parameter(t * 1 if spmd else t, requires_grad=p.requires_grad)
                m._parameters[name] = memo[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                t = placeholder(b.shape, b.dtype)
                m._buffers[name] = t * 1 if spmd else t
