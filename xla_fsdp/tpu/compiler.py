"""libtpu's own compiler, without a TPU: a ctypes binding to its PJRT C API.

[Note: deviceless TPU compile] libtpu exports `GetPjrtApi()`, a table of C
functions. Three of them compile for a TPU slice that is not there:
`PJRT_TopologyDescription_Create` (a slice by name, no client, no device),
`PJRT_Compile` (a serialized HloModuleProto and CompileOptionsProto against
that topology) and, on the executable, `GetCompiledMemoryStats` and
`OptimizedProgram`. We pass HLO, not StableHLO: converting to StableHLO
drops `constrain_layout`, which decides whether our pinned collectives
compile at all. The table's order is append-only across PJRT C API
versions; the indices below are those of the header (openxla/xla,
`xla/pjrt/c/pjrt_c_api.h`), all present since well before 0.75, the
version libtpu 0.0.21 (torch_xla 2.9's pin) reports.
"""
from __future__ import annotations

import ctypes as C
import glob
import importlib.util
import os
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

INSTALL_HINT = ('pip install "libtpu==0.0.21" "jax==0.7.1" "jaxlib==0.7.1"  '
                "(or: pip install -e '.[tpu-aot]'; `make test` installs it)")
LIBRARY_ENV = "TPU_LIBRARY_PATH"

# slot of each function in PJRT_Api, counted from the first function pointer
_SLOTS = {"Error_Destroy": 0, "Error_Message": 1, "Error_GetCode": 2, "Plugin_Initialize": 3,
          "DeviceDescription_Id": 23, "DeviceDescription_ProcessIndex": 24, "DeviceDescription_Kind": 26,
          "Executable_Destroy": 40, "Executable_OptimizedProgram": 48,
          "TopologyDescription_Create": 82, "TopologyDescription_Destroy": 83,
          "TopologyDescription_GetDeviceDescriptions": 86, "Compile": 89,
          "Executable_GetCompiledMemoryStats": 96}
_FIRST_FUNCTION_OFFSET = 8 + 8 + 24  # struct_size, extension_start, PJRT_Api_Version


class LibtpuMissing(ImportError):
    """libtpu (or the jaxlib that serializes what it reads) is not installed."""


class TpuCompileError(RuntimeError):
    """The TPU compiler refused the program; `compiler_message` is its own text."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.compiler_message = message
        self.code = code


def _struct(*fields):
    class S(C.Structure):
        _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), *fields]

    return S


_ErrorMessage = _struct(("error", C.c_void_p), ("message", C.c_char_p), ("message_size", C.c_size_t))
_ErrorDestroy = _struct(("error", C.c_void_p))
_ErrorCode = _struct(("error", C.c_void_p), ("code", C.c_int))
_PluginInit = _struct()
_NamedValue = _struct(("name", C.c_char_p), ("name_size", C.c_size_t), ("type", C.c_int),
                      ("value", C.c_int64), ("value_size", C.c_size_t))
_TopoCreate = _struct(("topology_name", C.c_char_p), ("topology_name_size", C.c_size_t),
                      ("create_options", C.c_void_p), ("num_options", C.c_size_t), ("topology", C.c_void_p))
_TopoDestroy = _struct(("topology", C.c_void_p))
_TopoDevices = _struct(("topology", C.c_void_p), ("descriptions", C.POINTER(C.c_void_p)),
                       ("num_descriptions", C.c_size_t))
_DescId = _struct(("description", C.c_void_p), ("id", C.c_int))
_DescKind = _struct(("description", C.c_void_p), ("kind", C.c_char_p), ("kind_size", C.c_size_t))
_Program = _struct(("code", C.c_void_p), ("code_size", C.c_size_t), ("format", C.c_char_p),
                   ("format_size", C.c_size_t))
_Compile = _struct(("topology", C.c_void_p), ("program", C.c_void_p), ("compile_options", C.c_char_p),
                   ("compile_options_size", C.c_size_t), ("client", C.c_void_p), ("executable", C.c_void_p))
_ExecDestroy = _struct(("executable", C.c_void_p))
_Optimized = _struct(("executable", C.c_void_p), ("program", C.c_void_p))
_MEMORY_FIELDS = ("generated_code_size", "argument_size", "output_size", "alias_size", "temp_size",
                  "host_generated_code_size", "host_argument_size", "host_output_size", "host_alias_size",
                  "host_temp_size")
_MemoryStats = _struct(("executable", C.c_void_p), *[(f, C.c_int64) for f in _MEMORY_FIELDS])

_NV_STRING, _NV_INT64, _NV_INT64_LIST, _NV_FLOAT, _NV_BOOL = range(5)


@dataclass(frozen=True)
class MemoryStats:
    """Bytes per chip as the compiler counts them (HBM; host_* for host memory)."""

    generated_code_size: int
    argument_size: int
    output_size: int
    alias_size: int
    temp_size: int
    host_generated_code_size: int
    host_argument_size: int
    host_output_size: int
    host_alias_size: int
    host_temp_size: int

    @property
    def peak(self) -> int:
        """Arguments + outputs - donated (counted once) + temporaries + code."""
        return self.argument_size + self.output_size - self.alias_size + self.temp_size + self.generated_code_size


@dataclass(frozen=True)
class DeviceInfo:
    id: int
    process_index: int
    kind: str


@dataclass
class CompiledProgram:
    memory: MemoryStats
    optimized_hlo: str


def library_path() -> str:
    """Where libtpu.so is: $TPU_LIBRARY_PATH, else the `libtpu` package's."""
    given = os.environ.get(LIBRARY_ENV)
    if given:
        if not os.path.isfile(given):
            raise LibtpuMissing(f"{LIBRARY_ENV}={given} is not a file; unset it, or install libtpu: {INSTALL_HINT}")
        return given
    spec = importlib.util.find_spec("libtpu")
    if spec is None or not spec.submodule_search_locations:
        raise LibtpuMissing(f"libtpu is not installed, so no TPU compiler is available: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        found = glob.glob(os.path.join(folder, "libtpu*.so"))
        if found:
            return found[0]
    raise LibtpuMissing(f"the libtpu package holds no libtpu.so: reinstall it: {INSTALL_HINT}")


class TpuCompiler:
    """The process's libtpu compiler (see the note above). Use `get_compiler()`."""

    def __init__(self, path: Optional[str] = None):
        # no metadata server to ask on a machine that is not a TPU VM
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        self._lib = C.CDLL(path or library_path())
        self._lib.GetPjrtApi.restype = C.c_void_p
        self._api = self._lib.GetPjrtApi()
        version = (C.c_int * 2).from_address(self._api + 32)  # pjrt_api_version.{major,minor}
        self.api_version = (version[0], version[1])
        self._lock = threading.Lock()
        self._call("Plugin_Initialize", _PluginInit())

    def _fn(self, name: str):
        address = C.c_void_p.from_address(self._api + _FIRST_FUNCTION_OFFSET + 8 * _SLOTS[name]).value
        return C.CFUNCTYPE(C.c_void_p, C.c_void_p)(address)

    def _call(self, name: str, args) -> None:
        args.struct_size = C.sizeof(args)
        error = self._fn(name)(C.addressof(args))
        if error:
            raise TpuCompileError(*self._take_error(error))

    def _take_error(self, error: int):
        msg = _ErrorMessage(C.sizeof(_ErrorMessage), None, error)
        C.CFUNCTYPE(None, C.c_void_p)(C.c_void_p.from_address(self._api + _FIRST_FUNCTION_OFFSET + 8).value)(
            C.addressof(msg))
        text = C.string_at(msg.message, msg.message_size).decode(errors="replace")
        code = _ErrorCode(C.sizeof(_ErrorCode), None, error)
        self._fn("Error_GetCode")(C.addressof(code))
        C.CFUNCTYPE(None, C.c_void_p)(C.c_void_p.from_address(self._api + _FIRST_FUNCTION_OFFSET).value)(
            C.addressof(_ErrorDestroy(C.sizeof(_ErrorDestroy), None, error)))
        return text, code.code

    # -- topology ------------------------------------------------------------
    def topology(self, name: str, options: Dict[str, object]) -> "Topology":
        """A slice by libtpu's topology name (e.g. "v4:2x2x1") and create options."""
        keep, values = [], (_NamedValue * max(len(options), 1))()
        for i, (key, value) in enumerate(options.items()):
            nv = values[i]
            nv.struct_size, nv.name, nv.name_size = C.sizeof(_NamedValue), key.encode(), len(key)
            if isinstance(value, str):
                buf = C.create_string_buffer(value.encode())
                keep.append(buf)
                nv.type, nv.value, nv.value_size = _NV_STRING, C.addressof(buf), len(value)
            elif isinstance(value, bool):
                nv.type, nv.value, nv.value_size = _NV_BOOL, int(value), 1
            elif isinstance(value, int):
                nv.type, nv.value, nv.value_size = _NV_INT64, value, 1
            else:
                arr = (C.c_int64 * len(value))(*[int(v) for v in value])
                keep.append(arr)
                nv.type, nv.value, nv.value_size = _NV_INT64_LIST, C.addressof(arr), len(value)
        args = _TopoCreate(0, None, name.encode(), len(name), C.addressof(values), len(options), None)
        with self._lock:
            self._call("TopologyDescription_Create", args)
        return Topology(self, args.topology)

    def devices(self, topology: int) -> List[DeviceInfo]:
        args = _TopoDevices(0, None, topology, None, 0)
        self._call("TopologyDescription_GetDeviceDescriptions", args)
        out = []
        for i in range(args.num_descriptions):
            desc = args.descriptions[i]
            ident, proc = _DescId(0, None, desc, 0), _DescId(0, None, desc, 0)
            kind = _DescKind(0, None, desc, None, 0)
            self._call("DeviceDescription_Id", ident)
            self._call("DeviceDescription_ProcessIndex", proc)
            self._call("DeviceDescription_Kind", kind)
            out.append(DeviceInfo(ident.id, proc.id, C.string_at(kind.kind, kind.kind_size).decode()))
        return out

    # -- compile -------------------------------------------------------------
    def compile(self, topology: "Topology", hlo_module_proto: bytes, compile_options: bytes) -> CompiledProgram:
        """Compile a serialized HloModuleProto for `topology`; raises TpuCompileError with the
        compiler's own message when it refuses."""
        code = C.create_string_buffer(hlo_module_proto, len(hlo_module_proto))
        program = _Program(C.sizeof(_Program), None, C.addressof(code), len(hlo_module_proto), b"hlo", 3)
        args = _Compile(0, None, topology.handle, C.addressof(program), compile_options, len(compile_options),
                        None, None)
        with self._lock:
            self._call("Compile", args)
        try:
            stats = _MemoryStats(0, None, args.executable)
            self._call("Executable_GetCompiledMemoryStats", stats)
            memory = MemoryStats(*[getattr(stats, f) for f in _MEMORY_FIELDS])
            return CompiledProgram(memory, self._optimized_text(args.executable))
        finally:
            self._call("Executable_Destroy", _ExecDestroy(0, None, args.executable))

    def _optimized_text(self, executable: int) -> str:
        program = _Program(C.sizeof(_Program), None, None, 0, None, 0)
        self._call("Executable_OptimizedProgram", _Optimized(0, None, executable, C.addressof(program)))
        buf = C.create_string_buffer(program.code_size)
        program.code = C.addressof(buf)
        self._call("Executable_OptimizedProgram", _Optimized(0, None, executable, C.addressof(program)))
        data = buf.raw[:program.code_size]
        from xla_fsdp.tpu.program_format import module_text

        return module_text(data, C.string_at(program.format, program.format_size).decode())


class Topology:
    """A slice's topology (no devices attached); frees itself with `close()`."""

    def __init__(self, compiler: TpuCompiler, handle: int):
        self.compiler, self.handle = compiler, handle
        self.devices = compiler.devices(handle)

    @property
    def num_processes(self) -> int:
        return len({d.process_index for d in self.devices})

    def close(self) -> None:
        if self.handle:
            self.compiler._call("TopologyDescription_Destroy", _TopoDestroy(0, None, self.handle))
            self.handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_COMPILER: Optional[TpuCompiler] = None


def get_compiler() -> TpuCompiler:
    """The process-wide compiler (libtpu is loaded once); LibtpuMissing names the install command."""
    global _COMPILER
    if _COMPILER is None:
        try:
            import jaxlib  # noqa: F401  (serializes programs and options for libtpu)
        except ImportError:
            raise LibtpuMissing(f"jaxlib is not installed (it serializes programs for libtpu): {INSTALL_HINT}")
        _COMPILER = TpuCompiler()
    return _COMPILER
