"""HBM bytes one fusion of a TPU-optimized program moves, for the step-time projection
(`xla_fsdp.tpu.step_time`): each operand read once, or only the slices the fusion takes of it
(also inside fusions nested in it), its result written once, or only the update of an
in-place dynamic-update-slice."""
from __future__ import annotations

import re
from typing import Dict, List, Optional

from xla_fsdp.tpu import optimized_hlo as oh
from xla_fsdp.tpu.optimized_hlo import operand_names

_SLICING = ("slice", "dynamic-slice", "gather")


def _parameters(body: List[oh.Instruction]) -> Dict[int, str]:
    """A fused computation's parameters by number."""
    return {int(m.group(1)): i.name for i in body if i.opcode == "parameter" and (m := re.match(r"(\d+)\)", i.rest))}


def _sliced_bytes(param: str, body: List[oh.Instruction], comps, depth: int = 0) -> Optional[float]:
    """Bytes fused computation `body` reads of its parameter `param` when it only takes slices of it, directly or in
    nested fusions (a loop body's dynamic-slice of the saved stack); None when a use reads all of it."""
    uses = [i for i in body if param in operand_names(i.rest)]
    if not uses:
        return None
    total = 0.0
    for u in uses:
        if u.opcode in _SLICING:
            total += sum(oh.shape_bytes(u.shape))
            continue
        inner = comps.get(u.called, []) if u.opcode == "fusion" and depth < 3 else []
        if not inner:
            return None
        params = _parameters(inner)
        for pos, o in enumerate(operand_names(u.rest)):
            if o == param:
                read = _sliced_bytes(params.get(pos, ""), inner, comps, depth + 1)
                if read is None:
                    return None
                total += read
    return total


def fusion_bytes(ins: oh.Instruction, entry_shapes: Dict[str, str], comps) -> float:
    """HBM bytes a fusion moves, as the module docstring says."""
    ops = operand_names(ins.rest)
    body = comps.get(ins.called, [])
    params = _parameters(body)
    users: Dict[str, List[oh.Instruction]] = {}
    for i in body:
        for o in operand_names(i.rest):
            users.setdefault(o, []).append(i)
    total = 0.0
    for idx, name in enumerate(ops):
        full = sum(oh.shape_bytes(entry_shapes.get(name, "")))
        inner = users.get(params.get(idx, ""), [])
        sliced = _sliced_bytes(params[idx], body, comps) if inner else None
        if sliced is not None:
            total += min(full, sliced)
        elif inner and all(u.opcode == "dynamic-update-slice" and operand_names(u.rest)[:1] == [params[idx]]
                           for u in inner):
            continue  # the buffer updated in place: only the update is written (counted below)
        else:
            total += full
    root = body[-1] if body else None
    if root is not None and root.opcode == "dynamic-update-slice":
        update = operand_names(root.rest)[1:2]
        shapes = {i.name: i.shape for i in body}
        total += sum(oh.shape_bytes(shapes.get(update[0], ""))) if update else 0
    else:
        total += sum(oh.shape_bytes(ins.shape))
    return total
