"""The serialized inputs libtpu's compile takes, and its optimized program read back as text.

libtpu reads protos: the program as an HloModuleProto, the settings as a CompileOptionsProto; jaxlib (the release
torch_xla 2.9's extras pin) writes both. Its HLO text parser keeps every attribute our programs depend on
(`constrain_layout`, channel ids, `use_global_device_ids`, `sharding=`), which the StableHLO route does not.
Two kinds of program: one per process (torch_xla's multi-process runtime, one chip each: `per_process_options`,
N replicas, 1 partition), or one SPMD program over the slice (single controller, GSPMD: `spmd_options`, 1 replica,
N partitions, the SPMD partitioner on).
"""
from __future__ import annotations

from typing import Iterable, Iterator, List, Mapping, Sequence, Tuple, Union

Flags = Union[Mapping[str, object], Iterable[Tuple[str, object]]]


def _jaxlib():
    try:
        from jax._src.lib import _jax, xla_client
    except ImportError as exc:
        from xla_fsdp.tpu.pjrt_abi import INSTALL_HINT, LibtpuMissing

        raise LibtpuMissing(f"jax/jaxlib is needed to write the protos libtpu reads ({exc}): {INSTALL_HINT}") from exc
    return _jax, xla_client


def per_process_options(device_ids: Sequence[int], libtpu_flags: Flags = ()) -> bytes:
    """CompileOptionsProto for one program per process: replica r runs on device_ids[r]."""
    return _options(device_ids, replicas=len(device_ids), partitions=1, spmd=False, libtpu_flags=libtpu_flags)


def spmd_options(device_ids: Sequence[int], libtpu_flags: Flags = (), propagate_output_sharding: bool = True) -> bytes:
    """CompileOptionsProto for one SPMD program: partition p on device_ids[p], partitioned from its `sharding=`
    annotations; outputs keep the partitioner's sharding, as torch_xla's default (else replicated: more HBM)."""
    return _options(device_ids, replicas=1, partitions=len(device_ids), spmd=True, libtpu_flags=libtpu_flags,
                    propagate_output_sharding=propagate_output_sharding)


def _options(device_ids: Sequence[int], replicas: int, partitions: int, spmd: bool, libtpu_flags: Flags,
             propagate_output_sharding: bool = False) -> bytes:
    import numpy as np

    _, xc = _jaxlib()
    if not device_ids:
        raise ValueError("no device ids: pass the topology's (Topology.device_ids)")
    opts = xc.CompileOptions()
    opts.num_replicas, opts.num_partitions = replicas, partitions
    build = opts.executable_build_options
    build.num_replicas, build.num_partitions = replicas, partitions
    build.use_spmd_partitioning = spmd
    if spmd:
        build.allow_spmd_sharding_propagation_to_output = [propagate_output_sharding]
    # device_assignment[replica][partition] = device id
    build.device_assignment = xc.DeviceAssignment.create(
        np.asarray(list(device_ids), dtype=np.int32).reshape(replicas, partitions))
    opts.env_option_overrides = flag_overrides(libtpu_flags)
    return opts.SerializeAsString()


def flag_overrides(flags: Flags) -> list:
    """libtpu flags ({"xla_tpu_enable_async_collective_fusion": True} or pairs) -> the (name, "value") string
    pairs of `env_option_overrides`: libtpu parses every value from a string, bools spelled "true"/"false"."""
    pairs = flags.items() if isinstance(flags, Mapping) else flags
    return [(str(name).lstrip("-"), str(value).lower() if isinstance(value, bool) else str(value))
            for name, value in pairs]


def parse_libtpu_init_args(text: str) -> list:
    """LIBTPU_INIT_ARGS ("--name=value --other") -> flag pairs; a bare flag means "true"."""
    import shlex

    return [(name, value or "true") for name, _, value in
            (token.lstrip("-").partition("=") for token in shlex.split(text or ""))]


def hlo_text_to_proto(text: str) -> bytes:
    """HLO module text (as torch_xla dumps it) -> a serialized HloModuleProto for `TpuCompiler.compile`."""
    _jax, _ = _jaxlib()
    if not text.strip():
        raise ValueError("empty HLO text: pass a module as torch_xla dumps it (`HloModule ...` then its computations)")
    try:
        module = _jax.hlo_module_from_text(text)
    except Exception as exc:  # jaxlib raises its own XlaRuntimeError
        first = text.strip().splitlines()[0][:120]
        raise ValueError(f"HLO text does not parse (it starts {first!r}): {exc}") from exc
    return module.as_serialized_hlo_module_proto()


def hlo_proto_to_text(proto: bytes) -> str:
    """A serialized HloModuleProto -> HLO module text."""
    _jax, _ = _jaxlib()
    return _jax.HloModule.from_serialized_hlo_module_proto(proto).to_string()


def hlo_program_to_text(code: bytes, fmt: str) -> str:
    """The program `PJRT_Executable_OptimizedProgram` returned in `fmt` (libtpu 0.0.21: "hlo_with_config") as text."""
    if fmt == "hlo":
        return hlo_proto_to_text(code)
    if fmt == "hlo_with_config":
        return hlo_proto_to_text(_message_field(code, 1))
    if fmt in ("hlo_text", "text"):
        return code.decode(errors="replace")
    raise ValueError(f"libtpu returned its optimized program in format {fmt!r}, which this binding does not read; "
                     "teach xla_fsdp/tpu/compile_options.hlo_program_to_text that format")


def assigned_devices(compile_options: bytes) -> Tuple[int, int, List[int]]:
    """(num_replicas, num_partitions, assigned device ids or []) of a serialized CompileOptionsProto, which
    `TpuCompiler.compile` checks against the topology first (libtpu aborts the process on a device id it lacks)."""
    _, xc = _jaxlib()
    options = xc.CompileOptions.ParseFromString(compile_options)
    assignment = options.executable_build_options.device_assignment
    ids: List[int] = []
    if assignment is not None:
        # DeviceAssignmentProto (xla/xla_data.proto): computation_devices = 3, each a
        # ComputationDevice {repeated int64 replica_device_ids = 1}
        for number, wire_type, value in _fields(assignment.serialize()):
            if number == 3 and wire_type == 2:
                ids += _int64s(value, 1)
    return options.num_replicas, options.num_partitions, ids


def _message_field(data: bytes, number: int) -> bytes:
    """Field `number` (a nested message) of a serialized protobuf message: jaxlib parses only the HloModuleProto of
    HloModuleProtoWithConfig, so we walk the wire format rather than depend on protobuf."""
    for field_number, wire_type, value in _fields(data):
        if field_number == number and wire_type == 2:
            return value
    raise ValueError(f"field {number} not found in the {len(data)}-byte message libtpu returned")


def _int64s(data: bytes, number: int) -> List[int]:
    """The values of `repeated int64` field `number`, packed or not."""
    out: List[int] = []
    for field_number, wire_type, value in _fields(data):
        if field_number != number:
            continue
        if wire_type == 0:
            out.append(value)
        elif wire_type == 2:
            pos = 0
            while pos < len(value):
                item, pos = _varint(value, pos)
                out.append(item)
    return out


def _fields(data: bytes) -> Iterator[Tuple[int, int, object]]:
    """(field number, wire type, value) of each field of a serialized protobuf message (value None: fixed-width)."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _varint(data, pos)
        elif wire_type == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        elif wire_type in (1, 5):
            value, pos = None, pos + (8 if wire_type == 1 else 4)
        else:
            raise ValueError(f"unexpected protobuf wire type {wire_type} at byte {pos}")
        yield number, wire_type, value


def _varint(data: bytes, pos: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
