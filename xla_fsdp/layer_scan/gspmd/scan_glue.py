"""Glue between scan_layers and torch_xla 2.9's `scan`: the per-layer recompute partitioner and the gradient sharding of
scan's backward without JAX."""

from __future__ import annotations

import torch


def policy_partition(joint_module, _joint_inputs, *, num_fwd_outputs, marks: bool = True, offload: bool = False,
                     **_ignored):
    """AOTAutograd partitioner of a recomputed layer: saves the layer's inputs and, with `marks`, the nodes a
    recomputation policy's hooks marked ([Note: recomputation policies] in memory/remat_policy.py; `saved_as`, [Note:
    saved outputs under AOTAutograd]); the backward recomputes the rest (without marks: the whole layer). With `offload`
    the marked values (the layer's input among them) go to host memory after the forward and come back in the backward
    ([Note: host offload])."""
    from torch._functorch import partitioners as p

    from xla_fsdp.memory import host_offload
    from xla_fsdp.memory.saved_outputs import tag_op

    graph = joint_module.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder" and (p._is_primal(n) or p._is_fwd_seed_offset(n))]
    marked = []
    if marks:
        op = tag_op()
        marked = [n for n in graph.nodes if n.op == "call_function" and n.target is op]
        # an input read only through its mark is saved as the mark (offloaded with it)
        inputs = [n for n in inputs if not (n.users and all(u.target is op for u in n.users))]
    fwd, bwd = p._extract_fwd_bwd_modules(joint_module, inputs + marked, [], num_fwd_outputs=num_fwd_outputs)
    moves = host_offload.graph_ops() if offload else None
    if moves is not None:
        _move(fwd, bwd, {n.name for n in marked}, *moves)
    return fwd, bwd


def _move(fwd, bwd, names, to_host, to_device) -> None:
    """The saved values named `names` leave the forward graph through `to_host` and enter the backward graph through
    `to_device`."""
    out = next(n for n in fwd.graph.nodes if n.op == "output")
    values = list(out.args[0])
    for i, v in enumerate(values):
        if getattr(v, "name", None) in names:
            with fwd.graph.inserting_before(out):
                values[i] = fwd.graph.call_function(to_host, (v,))
    out.args = (tuple(values),)
    for node in list(bwd.graph.nodes):
        if node.op == "placeholder" and node.name in names:
            users = list(node.users)
            with bwd.graph.inserting_after(node):
                back = bwd.graph.call_function(to_device, (node,))
            for u in users:
                u.replace_input_with(node, back)
    for g in (fwd, bwd):
        g.graph.lint()
        g.recompile()


# [Note: scan's backward without JAX]
# Under SPMD, torch_xla 2.9's scan gives each gradient of the loop the sharding of the input it belongs to
# (`_backward_shard_alike`) with `shard_as`, which lowers JAX's `shard_alike` through torchax. torch_xla's wheel vendors
# torchax 0.0.6, whose package imports flax, so on a machine without flax the first backward fails ("Jax is required for
# this feature"). On first use, scan_layers points torch_xla's scan module at `shard_like` instead: a gradient takes its
# input's sharding annotation when the input has one (the hidden state, batch sharded), and is left to the partitioner's
# propagation otherwise (a stacked parameter's slice carries no annotation of its own, so shard_alike constrained
# nothing there either).
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
