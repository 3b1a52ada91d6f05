"""Glue between scan_layers and torch_xla 2.9's `scan`: the per-layer recompute partitioner
and the gradient sharding of scan's backward without JAX."""

from __future__ import annotations

import torch


def recompute_partition(joint_module, _joint_inputs, *, num_fwd_outputs, **_ignored):
    """AOTAutograd partitioner that saves only the layer's inputs: the
    backward body recomputes the whole layer (per-layer checkpointing)."""
    from torch._functorch import partitioners as p

    saved = [
        n for n in joint_module.graph.nodes if n.op == "placeholder" and (p._is_primal(n) or p._is_fwd_seed_offset(n))
    ]
    return p._extract_fwd_bwd_modules(joint_module, saved, [], num_fwd_outputs=num_fwd_outputs)


# [Note: scan's backward without JAX]
# Under SPMD, torch_xla 2.9's scan gives each gradient of the loop the sharding of the input it
# belongs to (`_backward_shard_alike`) with `shard_as`, which lowers JAX's `shard_alike`
# through torchax. torch_xla's wheel vendors torchax 0.0.6, whose package imports flax, so on
# a machine without flax the first backward fails ("Jax is required for this feature"). On
# first use, scan_layers points torch_xla's scan module at `shard_like` instead: a gradient
# takes its input's sharding annotation when the input has one (the hidden state, batch
# sharded), and is left to the partitioner's propagation otherwise (a stacked parameter's
# slice carries no annotation of its own, so shard_alike constrained nothing there either).
def shard_like(inputs, grads):
    """`shard_as(inputs, grads)` of torch_xla's scan, without JAX: (inputs, annotated grads)."""
    import torch_xla
    from torch.utils._pytree import tree_map

    from xla_fsdp.runtime.mesh import annotate_with

    def one(x, g):
        if not isinstance(x, torch.Tensor) or not isinstance(g, torch.Tensor):
            return g
        if not torch_xla._XLAC._get_xla_sharding_spec(x):
            return g
        return annotate_with(g, torch_xla._XLAC._get_xla_op_sharding(x))

    return inputs, tree_map(one, inputs, grads)


def use_shard_like() -> None:
    """Points torch_xla's scan at `shard_like` ([Note: scan's backward without JAX])."""
    import torch_xla.experimental.scan as txla_scan

    txla_scan.shard_as = shard_like
