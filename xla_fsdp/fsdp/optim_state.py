"""Optimizer state of `fully_shard` parameters: sharded like its parameter after a load.

[Note: loaded optimizer state keeps the sharding] torch's `Optimizer.load_state_dict`
moves every state tensor to its parameter's device (`value.to(param.device)`). For a
`ShardedParameter` that device is `xla:0`, and what arrives is an XLA tensor without
sharding: a replicated copy on every device, and an optimizer step that is no longer
the one the model was compiled with. That happens on every resume that goes through
`set_state_dict` (full state dicts, `cpu_offload=True`, DCP's loads into CPU tensors)
or a plain `optimizer.load_state_dict(torch.load(...))`. So each optimizer holding a
`ShardedParameter` gets a load post-hook that marks every state tensor shaped like its
parameter (the global, possibly padded shape) with that parameter's sharding. Padded
parameters' state is padded and placed first by the engine's pre-hook
([Note: optimizer state of the single controller]); it arrives sharded and is left alone.

No hook reaches an optimizer at its construction, so torch's global optimizer-step
pre-hook attaches ours at the first step (`set_state_dict` makes one to create the
state before it loads), and re-shards any state loaded before that step.
"""
from __future__ import annotations

import weakref

import torch

from .param import ShardedParameter

_ATTACHED: "weakref.WeakSet" = weakref.WeakSet()
_STEP_HOOK = []


def install() -> None:
    """The global optimizer-step pre-hook (once per process)."""
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_HOOK.append(register_optimizer_step_pre_hook(_before_step))


def _before_step(optimizer, args, kwargs) -> None:
    if optimizer in _ATTACHED:
        return
    _ATTACHED.add(optimizer)
    if any(isinstance(p, ShardedParameter) for g in optimizer.param_groups for p in g["params"]):
        optimizer.register_load_state_dict_post_hook(shard_like_params)
        shard_like_params(optimizer)


def shard_like_params(optimizer) -> None:
    """Place each state tensor shaped like its (sharded) parameter but not sharded like it
    (a CPU tensor, an XLA tensor without sharding or replicated) sharded like the parameter."""
    import torch_xla

    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or not isinstance(p, ShardedParameter) or p.device.type != "xla":
                continue
            spec = torch_xla._XLAC._get_xla_sharding_spec(p)
            if not spec:
                continue
            sharding = None
            for key, value in list(state.items()):
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(p.shape) or value.dim() == 0:
                    continue
                if value.device.type == "xla" and torch_xla._XLAC._get_xla_sharding_spec(value) == spec:
                    continue
                if sharding is None:
                    sharding = torch_xla._XLAC._get_xla_op_sharding(p)
                # through the host: a fresh copy, so no tensor keeps the replicated data
                placed = value.detach().cpu().to(dtype=p.dtype if value.is_floating_point() else value.dtype,
                                                 device=p.device)
                torch_xla._XLAC._xla_mark_sharding(placed, sharding)
                state[key] = placed
