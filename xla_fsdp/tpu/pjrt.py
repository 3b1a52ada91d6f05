"""libtpu's compiler without a TPU: a ctypes binding to its PJRT C API.

[Note: deviceless TPU compile] libtpu.so exports `GetPjrtApi()`, a table of C functions (`PJRT_Api`). Some compile
for a slice that is not attached: `PJRT_TopologyDescription_Create` builds a slice from a topology name and create
options (no client, no device), `PJRT_Compile` compiles a serialized HloModuleProto with a serialized
CompileOptionsProto against it, and the executable it returns answers memory statistics, a cost analysis and its
TPU-optimized program. We hand over HLO, not StableHLO: converting to StableHLO drops `constrain_layout`, which
decides whether pinned collectives compile at all.

Table slots and argument layouts are those of openxla/xla `xla/pjrt/c/pjrt_c_api.h` at PJRT C API 0.75 (commit
885cdb03), the version libtpu 0.0.21 reports. Within major version 0 the header only appends and every argument
struct carries its size in `struct_size`, so a newer libtpu reads our structs and an older one is caught by the
table size check in `TpuCompiler.__init__`.
"""
from __future__ import annotations

import ctypes as C
import importlib.util
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from xla_fsdp.runtime import environment
from xla_fsdp.tpu import compile_log
from xla_fsdp.tpu.compile_log import ProgramHbm

from xla_fsdp.tpu.pjrt_abi import (  # callers name LibtpuMissing, TpuCompileError, ... from here
    INSTALL_HINT, LIBRARY_ENV, HEADER_VERSION, _SLOTS, _VERSION_OFFSET, _FIRST_SLOT_OFFSET, OptionValue,
    LibtpuMissing, TpuCompileError, _ErrorDestroy, _ErrorMessage, _ErrorGetCode, _PluginInitialize,
    _TopologyCreate, _TopologyDestroy, _TopologyVersion, _TopologyDevices, _DeviceInt, _DeviceKind,
    _DeviceAttributes, _Program, _Compile, _ExecutableDestroy, _NumOutputs, _CostAnalysis, _OptimizedProgram,
    _MEMORY_FIELDS, _MemoryStats, _named_values, _read_named_values)

# -- what callers get -------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceInfo:
    """One TPU device of a topology: one chip, or one TensorCore where chips are not megacore."""

    id: int
    process_index: int  # the host that drives it
    kind: str           # e.g. "TPU v4", "TPU v5 lite"
    coords: Tuple[int, ...] = ()  # the chip's place in the slice grid, when libtpu tells
    core_on_chip: Optional[int] = None
    attributes: Mapping[str, object] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class MemoryStats:
    """Bytes per device as the compiler plans them: HBM, and host memory in the host_* fields."""

    generated_code_size: int
    argument_size: int
    output_size: int
    alias_size: int        # output bytes that reuse donated arguments
    temp_size: int
    host_generated_code_size: int
    host_argument_size: int
    host_output_size: int
    host_alias_size: int
    host_temp_size: int
    # libtpu's own peak of live buffers (arguments, outputs, what lives between them; no code):
    # at least argument + output - alias, sometimes more than that + temp_size. 0 if not filled.
    peak_memory: int

    @property
    def total(self) -> int:
        """Arguments + outputs (donated bytes once) + temporaries + code: the usual HBM estimate per device."""
        return self.argument_size + self.output_size - self.alias_size + self.temp_size + self.generated_code_size


@dataclass
class CompiledProgram:
    """What one compile told us; the executable itself is freed before this is returned."""

    memory: MemoryStats
    optimized_hlo: str             # HLO text of the program as the TPU runs it (after all passes)
    cost: Dict[str, float]         # libtpu's cost analysis ("flops", "bytes accessed", ...)
    num_outputs: int
    compile_seconds: float
    # what libtpu's own log says the program needs per chip ([Note: the HBM a TPU program needs]);
    # None when libtpu wrote no log this process can read
    hbm: Optional[ProgramHbm] = None
    # the compile's stages in seconds, from the same log ([Note: where libtpu's compile time goes])
    stages: Dict[str, float] = field(default_factory=dict)


class Topology:
    """A TPU slice by topology name (no devices attached); freed by `close()`, a `with` block's end or the GC."""

    def __init__(self, compiler: "TpuCompiler", handle: int, name: str, options: Mapping[str, OptionValue]):
        self.name, self.options = name, dict(options)
        self._handle = handle
        self._finalizer = weakref.finalize(self, compiler._destroy_topology, handle)
        version, found = _TopologyVersion(0, None, handle, None, 0), _TopologyDevices(0, None, handle, None, 0)
        compiler._call("PJRT_TopologyDescription_PlatformVersion", version)
        text = C.string_at(version.platform_version, version.platform_version_size)
        self.platform_version = text.decode(errors="replace")
        compiler._call("PJRT_TopologyDescription_GetDeviceDescriptions", found)
        self.devices: List[DeviceInfo] = [compiler._device(d) for d in found.descriptions[:found.num_descriptions]]

    @property
    def handle(self) -> int:
        if not self._finalizer.alive:
            raise ValueError(f"topology {self.name!r} was closed; create it again with TpuCompiler.topology()")
        return self._handle

    @property
    def num_processes(self) -> int:
        """Hosts of the slice: one process drives each."""
        return len({d.process_index for d in self.devices})

    @property
    def device_ids(self) -> List[int]:
        return [d.id for d in self.devices]

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "Topology":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Topology({self.name!r}, {len(self.devices)} devices of {self.devices[0].kind!r} "
                f"over {self.num_processes} processes)" if self.devices else f"Topology({self.name!r})")


# -- the library --------------------------------------------------------------------------------
def library_path() -> str:
    """libtpu.so: $TPU_LIBRARY_PATH, else the `libtpu` package's (found without importing it, which sets that)."""
    given = environment.raw(LIBRARY_ENV)
    if given:
        if not os.path.isfile(given):
            raise LibtpuMissing(f"{LIBRARY_ENV}={given!r} is not a file: point it at libtpu.so, or unset it "
                                f"to use the libtpu package ({INSTALL_HINT})")
        return given
    spec = importlib.util.find_spec("libtpu")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "libtpu.so")
        if os.path.isfile(path):
            return path
    raise LibtpuMissing(f"libtpu is not installed, so there is no TPU compiler here: {INSTALL_HINT}")


def _prepare_environment() -> None:
    """Environment libtpu reads. We never open a TPU, so: no metadata server to ask for the accelerator type (off a
    TPU VM the query waits on the network); no claim on /tmp/libtpu_lockfile, so that a second compiling process
    (or a training job on a TPU VM) is not refused; and no TPU_ACCELERATOR_TYPE (GKE sets it in TPU pods): with it,
    libtpu looks for that chip's config file during compile and aborts the process when it is missing."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    given = os.environ.pop(environment.TPU_ACCELERATOR_TYPE, None)
    if given is not None:
        warnings.warn(f"unset TPU_ACCELERATOR_TYPE={given!r} in this process: libtpu's deviceless compile "
                      "aborts with it set; the slice comes from the topology instead", stacklevel=3)


class TpuCompiler:
    """libtpu's compiler, loaded once per process: use `get_compiler()`."""

    def __init__(self, path: Optional[str] = None):
        _prepare_environment()
        self.library_path = path or library_path()
        self._lib = C.CDLL(self.library_path)  # kept referenced: the library stays loaded
        self._lib.GetPjrtApi.restype = C.c_void_p
        self._api = self._lib.GetPjrtApi()
        if not self._api:
            raise LibtpuMissing(f"{self.library_path}: GetPjrtApi() returned NULL; reinstall libtpu: {INSTALL_HINT}")
        major, minor = (C.c_int * 2).from_address(self._api + _VERSION_OFFSET + 16)
        self.api_version: Tuple[int, int] = (major, minor)
        table_size = C.c_size_t.from_address(self._api).value
        needed = _FIRST_SLOT_OFFSET + 8 * (max(_SLOTS.values()) + 1)
        if major != HEADER_VERSION[0] or table_size < needed:
            raise LibtpuMissing(
                f"{self.library_path} speaks PJRT C API {major}.{minor} with a {table_size}-byte function table; "
                f"this binding needs major version {HEADER_VERSION[0]} and at least {needed} bytes "
                f"(written against {HEADER_VERSION[0]}.{HEADER_VERSION[1]}): {INSTALL_HINT}")
        self._functions: Dict[str, object] = {}
        with _COMPILER_LOCK:
            if self._api not in _INITIALIZED:  # "must be called once", and dlopen shares one table
                self._call("PJRT_Plugin_Initialize", _PluginInitialize())
                _INITIALIZED.add(self._api)

    # -- calling ----------------------------------------------------------------------------
    def _function(self, name: str):
        fn = self._functions.get(name)
        if fn is None:
            address = C.c_void_p.from_address(self._api + _FIRST_SLOT_OFFSET + 8 * _SLOTS[name]).value
            if not address:
                raise TpuCompileError(name, 12, f"libtpu {self.api_version} does not implement {name}")
            fn = self._functions[name] = C.CFUNCTYPE(C.c_void_p, C.c_void_p)(address)
        return fn

    def _call(self, name: str, args: C.Structure) -> None:
        """Call one PJRT function; its PJRT_Error becomes a TpuCompileError (and is freed)."""
        args.struct_size = C.sizeof(args)
        error = self._function(name)(C.addressof(args))
        if error:
            raise self._take_error(name, error)

    def _take_error(self, function: str, error: int) -> TpuCompileError:
        message = _ErrorMessage(C.sizeof(_ErrorMessage), None, error)
        self._function("PJRT_Error_Message")(C.addressof(message))
        text = C.string_at(message.message, message.message_size).decode(errors="replace")
        code = _ErrorGetCode(C.sizeof(_ErrorGetCode), None, error)
        self._function("PJRT_Error_GetCode")(C.addressof(code))
        self._function("PJRT_Error_Destroy")(C.addressof(_ErrorDestroy(C.sizeof(_ErrorDestroy), None, error)))
        return TpuCompileError(function, code.code, text)

    # -- topology ---------------------------------------------------------------------------
    def topology(self, name: str, options: Mapping[str, OptionValue]) -> Topology:
        """A slice by libtpu's topology name and create options (`topology.parse_accelerator_type` gives both)."""
        values, keep = _named_values(options)
        encoded = name.encode()
        args = _TopologyCreate(0, None, encoded, len(encoded), C.addressof(values) if options else None,
                               len(options), None)
        self._call("PJRT_TopologyDescription_Create", args)
        del keep
        return Topology(self, args.topology, name, options)

    def _destroy_topology(self, handle: int) -> None:
        self._call("PJRT_TopologyDescription_Destroy", _TopologyDestroy(0, None, handle))

    def _device(self, description: int) -> DeviceInfo:
        ident, process = _DeviceInt(0, None, description, 0), _DeviceInt(0, None, description, 0)
        kind, attributes = _DeviceKind(0, None, description, None, 0), _DeviceAttributes(0, None, description, 0, None)
        for function, args in (("Id", ident), ("ProcessIndex", process), ("Kind", kind), ("Attributes", attributes)):
            self._call("PJRT_DeviceDescription_" + function, args)
        attrs = _read_named_values(attributes.attributes, attributes.num_attributes)
        core = attrs.get("core_on_chip")
        return DeviceInfo(id=ident.value, process_index=process.value,
                          kind=C.string_at(kind.device_kind, kind.device_kind_size).decode(),
                          coords=tuple(attrs.get("coords", ())), core_on_chip=None if core is None else int(core),
                          attributes=attrs)

    # -- compile ----------------------------------------------------------------------------
    def compile(self, topology: Topology, hlo_module_proto: bytes, compile_options: bytes) -> CompiledProgram:
        """Compile a serialized HloModuleProto for `topology` with a serialized CompileOptionsProto (`compile_options`
        builds both); TpuCompileError, with libtpu's own message, when it refuses."""
        if not isinstance(hlo_module_proto, bytes) or not isinstance(compile_options, bytes):
            raise TypeError("compile() takes the serialized HloModuleProto and CompileOptionsProto as bytes; "
                            "build them with xla_fsdp.tpu.compile_options (hlo_text_to_proto, spmd_options, ...)")
        _check_devices(topology, compile_options)
        code, fmt = C.create_string_buffer(hlo_module_proto, len(hlo_module_proto)), C.create_string_buffer(b"hlo")
        options = C.create_string_buffer(compile_options, len(compile_options))
        program = _Program(C.sizeof(_Program), None, C.addressof(code), len(hlo_module_proto), C.addressof(fmt), 3)
        args = _Compile(0, None, topology.handle, C.addressof(program), C.addressof(options), len(compile_options),
                        None, None)
        logged = compile_log.mark()
        start = time.perf_counter()
        self._call("PJRT_Compile", args)
        seconds = time.perf_counter() - start
        executable = args.executable
        try:
            stats = _MemoryStats(0, None, executable)
            self._call("PJRT_Executable_GetCompiledMemoryStats", stats)
            optimized = self._optimized(executable)
            cost = _CostAnalysis(0, None, executable, 0, None)
            self._call("PJRT_Executable_GetCostAnalysis", cost)
            outputs = _NumOutputs(0, None, executable, 0)
            self._call("PJRT_Executable_NumOutputs", outputs)
            log = compile_log.compile_since(logged)
            return CompiledProgram(MemoryStats(*[getattr(stats, f"{name}_in_bytes") for name in _MEMORY_FIELDS]),
                                   optimized, _read_named_values(cost.properties, cost.num_properties),
                                   outputs.num_outputs, seconds, hbm=compile_log.program_hbm(log),
                                   stages=compile_log.stage_seconds(log))
        finally:
            self._call("PJRT_Executable_Destroy", _ExecutableDestroy(0, None, executable))

    def _optimized(self, executable: int) -> str:
        """The TPU-optimized program as HLO text: a first call (no buffer) says the size, a second fills our buffer."""
        program = _Program(C.sizeof(_Program), None, None, 0, None, 0)
        args = _OptimizedProgram(0, None, executable, C.addressof(program))
        self._call("PJRT_Executable_OptimizedProgram", args)
        buffer = C.create_string_buffer(program.code_size)
        program.code = C.addressof(buffer)
        self._call("PJRT_Executable_OptimizedProgram", args)
        fmt = C.string_at(program.format, program.format_size).decode()
        from xla_fsdp.tpu.compile_options import hlo_program_to_text

        return hlo_program_to_text(buffer.raw[:program.code_size], fmt)


def _check_devices(topology: Topology, compile_options: bytes) -> None:
    """Refuse a device assignment the slice cannot hold before libtpu sees it: libtpu aborts on a device id it lacks,
    and silently accepts more replicas than devices or one device twice."""
    from xla_fsdp.tpu.compile_options import assigned_devices

    replicas, partitions, ids = assigned_devices(compile_options)
    have = topology.device_ids
    if replicas * partitions > len(have):
        raise ValueError(f"the compile options ask for {replicas} replicas x {partitions} partitions, but "
                         f"{topology.name} has {len(have)} devices: build them for this topology's device_ids")
    unknown = sorted(set(ids) - set(have))
    if unknown or len(set(ids)) != len(ids):
        raise ValueError(f"device assignment {ids} " + (f"names devices {unknown} that {topology.name} lacks"
                         if unknown else "uses a device twice") + f"; its devices are {have[:16]}"
                         + ("..." if len(have) > 16 else ""))


_COMPILER: Optional[TpuCompiler] = None
_COMPILER_LOCK = threading.RLock()
_INITIALIZED: set = set()  # PJRT_Api tables whose plugin is initialized


def get_compiler() -> TpuCompiler:
    """The process-wide compiler; LibtpuMissing, naming the install command, without libtpu or jaxlib."""
    global _COMPILER
    with _COMPILER_LOCK:
        if _COMPILER is None:
            if importlib.util.find_spec("jaxlib") is None:
                raise LibtpuMissing(f"jaxlib is not installed (it writes the protos libtpu reads): {INSTALL_HINT}")
            compile_log.libtpu_loading()
            with compile_log.unbuffered_log():
                _COMPILER = TpuCompiler()
        return _COMPILER
