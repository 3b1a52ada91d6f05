"""An XLA While loop inside the single controller's manual region.

[Note: a loop in the manual region]
torch_xla's scan builds its While from tensors it makes itself (the trip counter, the stacked outputs) and from
the data the body captured (scalars such as `0.5` or a norm's epsilon become device data, hoisted into loop
operands). Inside the region the loop's carry is per-device (manual sharding), and the SPMD partitioner then marks
the captured scalars manual inside the body too; with the operands outside left replicated it aborts the process
(`Check failed: !IsManual()` in HandleTuple, torch_xla 2.9). So this module builds the loop itself and marks every
operand manual: what is replicated is the same on every device, so each device's piece is the whole tensor. A
captured tensor split over the devices (a global tensor read with `to_local` inside the body) cannot be marked so
and is refused; pass its local piece in the carry instead.

The body is traced once, lazily, with placeholder inputs (any engine code may run in it, explicit collectives
included); torch's RNG state must not be used in it (a scanned layer draws from keys, layer_scan/keyed_random.py).

[Note: the loop's output buffers]
Each trip writes its outputs into one buffer of all trips, in place, and every slice is written before anything
reads it, so what the buffer holds first never matters. On XLA:CPU it starts as zeros. For a TPU it is libtpu's
`AllocateBuffer` custom call, memory nothing writes first: zeros would cost a write of the whole buffer every step (GBs
of saved layer inputs and stacked gradients per chip). It is made from the loop's first carry, so that it is allocated
when the loop starts: made from a constant, libtpu allocated it early and the 2B's peak HBM grew by 1.8 GB.

[Note: the loop's 32-bit indices]
The trip counter and every index the loop computes are s32. A TPU has no 64-bit integer unit: libtpu emulates
each s64 scalar op with pairs of u32 ops, and an s64 remainder (the shifted reads' (i + k) mod L) with a long
division of about 140 scalar ops (with s64 indices the 2B GPT-2's loop bodies each held about 1,700 such ops). The
shifted index is one add, one compare and one select instead.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

Body = Callable[[List[torch.Tensor], List[torch.Tensor]], Tuple[List[torch.Tensor], List[torch.Tensor]]]


def _manual(t: torch.Tensor, mesh, data: bool = False) -> torch.Tensor:
    """`t` as a loop operand inside the region: marked manual. Data made outside the region (`data`: the trip counter,
    the output buffers, what the body captured) is replicated and taken in through the region's entry, which XLA cannot
    simplify away (a marked `t * 1` becomes `t` again, replicated)."""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    from .conversions import _fresh, to_local

    if mesh is None:  # one process per device: no manual sharding
        return t
    if data:
        return to_local(t, mesh, (None,) * t.dim())
    spec = torch_xla._XLAC._get_xla_sharding_spec(t)
    if "devices=" in spec:
        raise RuntimeError(
            f"a scanned loop body read a tensor split over the devices (shape {tuple(t.shape)}, "
            f"sharding {spec}) from outside the loop; only replicated tensors can be captured "
            "inside the single controller's region. This is a bug in xla_fsdp's scan; turn "
            "scan_layers off")
    x = _fresh(t)
    torch_xla._XLAC._mark_manual_sharding(x, torch_xla._XLAC.OpSharding([], [], [], xs.ShardingType.MANUAL))
    return x


def while_loop(body: Body, carry: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], mesh=None,
               reverse: bool = False, shifts: Optional[Sequence[int]] = None,
               ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Runs `body(carry, x)` for each slice x of `xs` along dim 0 (last first with `reverse`);
    returns the final carry and the bodies' second outputs stacked on a new dim 0. `shifts`: per
    x, k: trip i reads its slice (i + k) mod trips, in place (a rolled copy would cost a copy of
    the whole x). `mesh`: the single controller's (None with one process per device)."""
    import torch_xla
    import torch_xla.core.xla_builder as xb
    from torch_xla.experimental.scan import Builder, dynamic_slice, dynamic_update_slice

    trips = xs[0].shape[0]
    shifts = [k % trips for k in shifts] if shifts is not None else [0] * len(xs)
    fake_carry = [xb.create_placeholder_tensor(t.shape, t.dtype) for t in carry]
    fake_x = [xb.create_placeholder_tensor(t.shape[1:], t.dtype) for t in xs]
    out_carry, out_y = body(list(fake_carry), list(fake_x))
    for before, after in zip(carry, out_carry):
        if before.shape != after.shape or before.dtype != after.dtype:
            raise RuntimeError(f"a loop body changed its carry from {tuple(before.shape)} {before.dtype} to "
                               f"{tuple(after.shape)} {after.dtype}")
    lowering = torch_xla._XLAC.lowering.LoweringContext("ScanBody")
    lowering.build(list(out_carry) + list(out_y))
    computation = xb.computation_from_module_proto("scan_body", lowering.hlo())
    ids, values = torch_xla._XLAC._get_tensors_xla_device_data_node(list(out_carry) + list(out_y))
    if torch_xla._XLAC._get_seed_info_id() in ids:
        raise RuntimeError("a scanned layer draws from torch's random number generator; inside the loop "
                           "every trip would draw the same numbers. Turn scan_layers off")

    builder = Builder("scan_in_region")
    to_while = {}  # the body computation's parameter id -> the While's
    # [Note: the loop's 32-bit indices]
    builder.add_param(_manual(torch.tensor(0, dtype=torch.int32, device=carry[0].device), mesh, data=True))
    for real, fake in ((carry, fake_carry), (xs, fake_x)):
        for value, placeholder in zip(real, fake):
            index = builder.add_param(_manual(value, mesh))
            pid = lowering.tensor_parameter_id(placeholder)
            if pid != -1:
                to_while[pid] = index
    ys = [_output_buffer((trips, *y.shape), y.dtype, carry[0], mesh) for y in out_y]
    for y in ys:
        builder.add_param(y)
    captured = lowering.device_parameter_id_tensor_mapping()
    for placeholder in list(fake_carry) + list(fake_x):
        captured.pop(lowering.tensor_parameter_id(placeholder), None)
    for pid, tensor in captured.items():
        to_while[pid] = builder.add_param(_manual(tensor, mesh, data=True))
    n_carry, n_x, n_y = len(carry), len(xs), len(ys)

    def const(counter, value):
        return xb.Op.scalar(counter.builder(), value, dtype=xb.Type.S32)

    def cond(counter, *rest):
        return counter < const(counter, trips)

    def step(*params):
        counter = params[0]
        slices = params[1 + n_carry:1 + n_carry + n_x]
        outs = list(params[1 + n_carry + n_x:1 + n_carry + n_x + n_y])
        index = const(counter, trips - 1) - counter if reverse else counter
        inputs = list(params)
        for k, (v, shift) in enumerate(zip(slices, shifts)):
            at = index
            if shift:  # (index + shift) mod trips, both in [0, trips): one compare, no division
                at = index + const(counter, shift)
                at = (at >= const(counter, trips)).select(at - const(counter, trips), at)
            inputs[1 + n_carry + k] = dynamic_slice(v, at)
        result = xb.Op.call(computation, [inputs[to_while[pid]] for pid in range(len(to_while))])
        state = [result.get_tuple_element(k) for k in range(n_carry)]
        outs = [dynamic_update_slice(o, result.get_tuple_element(n_carry + k), index) for k, o in enumerate(outs)]
        return (counter + const(counter, 1), *state, *slices, *outs, *params[1 + n_carry + n_x + n_y:])

    loop = xb.Op.mkwhile(builder.params(), cond, step).build("scan_in_region")
    outputs = torch_xla._XLAC._xla_user_computation("xla::scan_in_region", builder.param_tensors(), loop)
    return list(outputs[1:1 + n_carry]), list(outputs[1 + n_carry + n_x:1 + n_carry + n_x + n_y])


def _output_buffer(shape, dtype, first: torch.Tensor, mesh) -> torch.Tensor:
    """The buffer a loop writes its stacked outputs into ([Note: the loop's output buffers])."""
    import torch_xla

    from .auto import tpu_target

    if not tpu_target():
        return _manual(torch.zeros(shape, dtype=dtype, device=first.device), mesh, data=True)
    seed = (first.detach().reshape(-1)[:1].sum() * 0).to(dtype)
    out = torch_xla._XLAC._xla_custom_call([seed], "AllocateBuffer", [list(shape)], [dtype], False, "", 1, {})[0]
    if mesh is not None:  # made inside the region: each device's own buffer
        import torch_xla.distributed.spmd as xs

        torch_xla._XLAC._mark_manual_sharding(out, torch_xla._XLAC.OpSharding([], [], [], xs.ShardingType.MANUAL))
    return out
