"""Programs and options in the forms libtpu takes: HloModuleProto and CompileOptionsProto.

jaxlib (of the JAX release torch_xla 2.9's pallas extra pins) parses HLO text
into an HloModuleProto with every attribute kept (`constrain_layout`,
channel ids, shardings, buffer donors), and writes CompileOptionsProto.
"""
from __future__ import annotations

import shlex
from typing import List, Sequence, Tuple


def hlo_text_to_proto(text: str) -> bytes:
    """A serialized HloModuleProto of HLO module text."""
    from jax._src.lib import _jax

    return _jax.hlo_module_from_text(text).as_serialized_hlo_module_proto()


def module_text(data: bytes, fmt: str) -> str:
    """HLO text of a program libtpu returned (`hlo` or `hlo_with_config`: serialized protos)."""
    from jax._src.lib import _jax

    if fmt == "hlo_with_config":
        from jax._src.lib import xla_client  # noqa: F401  (registers the proto types)

        return _jax.HloModule.from_serialized_hlo_module_proto(_strip_config(data)).to_string()
    if fmt == "hlo":
        return _jax.HloModule.from_serialized_hlo_module_proto(data).to_string()
    return data.decode(errors="replace")


def _strip_config(data: bytes) -> bytes:
    """HloModuleProtoWithConfig -> its `hlo_module` field (field 1, length-delimited)."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 2:
            size, pos = _varint(data, pos)
            if field == 1:
                return data[pos:pos + size]
            pos += size
        elif wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            break
    raise ValueError("no hlo_module in the optimized program libtpu returned")


def _varint(data: bytes, pos: int) -> Tuple[int, int]:
    value, shift = 0, 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def parse_flags(text: str) -> List[Tuple[str, str]]:
    """`--name=value --other` (as in LIBTPU_INIT_ARGS) -> [(name, value)]; a bare flag is "true"."""
    out = []
    for token in shlex.split(text or ""):
        name, _, value = token.lstrip("-").partition("=")
        out.append((name, value or "true"))
    return out


def compile_options(device_ids: Sequence[int], spmd: bool, libtpu_flags=()) -> bytes:
    """A serialized CompileOptionsProto: one SPMD program over `device_ids` (single controller,
    GSPMD), or one program per replica (one process per chip)."""
    import numpy as np
    from jax._src.lib import xla_client as xc

    n = len(device_ids)
    opts = xc.CompileOptions()
    build = opts.executable_build_options
    if spmd:
        opts.num_replicas, opts.num_partitions = 1, n
        build.num_replicas, build.num_partitions = 1, n
        build.use_spmd_partitioning = True
        build.allow_spmd_sharding_propagation_to_output = [True]
        assignment = np.asarray(device_ids).reshape(1, n)
    else:
        opts.num_replicas, opts.num_partitions = n, 1
        build.num_replicas, build.num_partitions = n, 1
        assignment = np.asarray(device_ids).reshape(n, 1)
    build.device_assignment = xc.DeviceAssignment.create(assignment)
    opts.device_assignment = xc.DeviceAssignment.create(assignment)
    opts.env_option_overrides = list(libtpu_flags)
    return opts.SerializeAsString()
