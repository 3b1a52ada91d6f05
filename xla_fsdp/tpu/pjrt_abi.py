"""The C side of libtpu's PJRT C API that xla_fsdp/tpu/pjrt.py calls: slots, argument structs, errors.

Layouts of openxla/xla `xla/pjrt/c/pjrt_c_api.h` at PJRT C API 0.75, the
version libtpu 0.0.21 reports ([Note: deviceless TPU compile] in pjrt.py).
"""
from __future__ import annotations

import ctypes as C
from typing import Dict, Mapping, Optional, Sequence, Union

INSTALL_HINT = ('pip install "libtpu==0.0.21" "jax==0.7.1" "jaxlib==0.7.1" '
                '(or, in this repository: pip install -e ".[tpu-aot]")')
LIBRARY_ENV = "TPU_LIBRARY_PATH"
HEADER_VERSION = (0, 75)  # the pjrt_c_api.h the layouts below come from

# Position of each function we call among PJRT_Api's function pointers (header order, 0.75).
_SLOTS = {
    "PJRT_Error_Destroy": 0, "PJRT_Error_Message": 1, "PJRT_Error_GetCode": 2, "PJRT_Plugin_Initialize": 3,
    "PJRT_DeviceDescription_Id": 23, "PJRT_DeviceDescription_ProcessIndex": 24,
    "PJRT_DeviceDescription_Attributes": 25, "PJRT_DeviceDescription_Kind": 26,
    "PJRT_Executable_Destroy": 40, "PJRT_Executable_NumOutputs": 44, "PJRT_Executable_GetCostAnalysis": 46,
    "PJRT_Executable_OptimizedProgram": 48,
    "PJRT_TopologyDescription_Create": 82, "PJRT_TopologyDescription_Destroy": 83,
    "PJRT_TopologyDescription_PlatformVersion": 85, "PJRT_TopologyDescription_GetDeviceDescriptions": 86,
    "PJRT_Compile": 89, "PJRT_Executable_GetCompiledMemoryStats": 96,
}
# PJRT_Api starts with size_t struct_size, PJRT_Extension_Base* extension_start and a
# PJRT_Api_Version {size_t struct_size; void* extension_start; int major; int minor}.
_VERSION_OFFSET = 8 + 8
_FIRST_SLOT_OFFSET = _VERSION_OFFSET + 24

_ERROR_CODES = {1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
                6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
                10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
                15: "DATA_LOSS", 16: "UNAUTHENTICATED"}

OptionValue = Union[str, int, bool, float, Sequence[int]]


class LibtpuMissing(ImportError):
    """libtpu (the TPU compiler) or jaxlib (which writes the protos it reads) is not installed."""


class TpuCompileError(RuntimeError):
    """libtpu refused: `compiler_message` is its own text, `function` the PJRT call that failed."""

    def __init__(self, function: str, code: int, compiler_message: str):
        self.function, self.code, self.compiler_message = function, code, compiler_message
        super().__init__(f"{function} failed ({_ERROR_CODES.get(code, code)}): {compiler_message}")


# -- argument structs (pjrt_c_api.h, 0.75) ------------------------------------------------------
def _args(name: str, *fields):
    """An argument struct: every one starts with struct_size and extension_start."""
    return type(name, (C.Structure,), {
        "_fields_": [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), *fields]})


class _Value(C.Union):
    _fields_ = [("string", C.c_void_p), ("int64", C.c_int64), ("int64_array", C.c_void_p),
                ("float", C.c_float), ("bool", C.c_bool)]


_NamedValue = _args("PJRT_NamedValue", ("name", C.c_void_p), ("name_size", C.c_size_t), ("type", C.c_int),
                    ("value", _Value), ("value_size", C.c_size_t))
_STRING, _INT64, _INT64_LIST, _FLOAT, _BOOL = range(5)  # PJRT_NamedValue_Type

_ErrorDestroy = _args("PJRT_Error_Destroy_Args", ("error", C.c_void_p))
_ErrorMessage = _args("PJRT_Error_Message_Args", ("error", C.c_void_p), ("message", C.c_void_p),
                      ("message_size", C.c_size_t))
_ErrorGetCode = _args("PJRT_Error_GetCode_Args", ("error", C.c_void_p), ("code", C.c_int))
_PluginInitialize = _args("PJRT_Plugin_Initialize_Args")
_TopologyCreate = _args("PJRT_TopologyDescription_Create_Args", ("topology_name", C.c_char_p),
                        ("topology_name_size", C.c_size_t), ("create_options", C.c_void_p),
                        ("num_options", C.c_size_t), ("topology", C.c_void_p))
_TopologyDestroy = _args("PJRT_TopologyDescription_Destroy_Args", ("topology", C.c_void_p))
_TopologyVersion = _args("PJRT_TopologyDescription_PlatformVersion_Args", ("topology", C.c_void_p),
                         ("platform_version", C.c_void_p), ("platform_version_size", C.c_size_t))
_TopologyDevices = _args("PJRT_TopologyDescription_GetDeviceDescriptions_Args", ("topology", C.c_void_p),
                         ("descriptions", C.POINTER(C.c_void_p)), ("num_descriptions", C.c_size_t))
_DeviceInt = _args("PJRT_DeviceDescription_Id_Args", ("device_description", C.c_void_p), ("value", C.c_int))
_DeviceKind = _args("PJRT_DeviceDescription_Kind_Args", ("device_description", C.c_void_p),
                    ("device_kind", C.c_void_p), ("device_kind_size", C.c_size_t))
# this one lists the count before the array
_DeviceAttributes = _args("PJRT_DeviceDescription_Attributes_Args", ("device_description", C.c_void_p),
                          ("num_attributes", C.c_size_t), ("attributes", C.c_void_p))
_Program = _args("PJRT_Program", ("code", C.c_void_p), ("code_size", C.c_size_t), ("format", C.c_void_p),
                 ("format_size", C.c_size_t))
_Compile = _args("PJRT_Compile_Args", ("topology", C.c_void_p), ("program", C.c_void_p),
                 ("compile_options", C.c_void_p), ("compile_options_size", C.c_size_t), ("client", C.c_void_p),
                 ("executable", C.c_void_p))
_ExecutableDestroy = _args("PJRT_Executable_Destroy_Args", ("executable", C.c_void_p))
_NumOutputs = _args("PJRT_Executable_NumOutputs_Args", ("executable", C.c_void_p), ("num_outputs", C.c_size_t))
_CostAnalysis = _args("PJRT_Executable_GetCostAnalysis_Args", ("executable", C.c_void_p),
                      ("num_properties", C.c_size_t), ("properties", C.c_void_p))
_OptimizedProgram = _args("PJRT_Executable_OptimizedProgram_Args", ("executable", C.c_void_p),
                          ("program", C.c_void_p))
_MEMORY_FIELDS = ("generated_code_size", "argument_size", "output_size", "alias_size", "temp_size",
                  "host_generated_code_size", "host_argument_size", "host_output_size", "host_alias_size",
                  "host_temp_size", "peak_memory")
_MemoryStats = _args("PJRT_Executable_GetCompiledMemoryStats_Args", ("executable", C.c_void_p),
                     *[(f"{name}_in_bytes", C.c_int64) for name in _MEMORY_FIELDS])


def _named_values(options: Mapping[str, OptionValue]):
    """Options -> a PJRT_NamedValue array, and the buffers that must outlive the call."""
    values, keep = (_NamedValue * max(len(options), 1))(), []
    for slot, (key, value) in zip(values, options.items()):
        name = C.create_string_buffer(key.encode())
        keep.append(name)
        slot.struct_size, slot.name, slot.name_size = C.sizeof(_NamedValue), C.addressof(name), len(key)
        if isinstance(value, str):
            text = C.create_string_buffer(value.encode())
            keep.append(text)
            slot.type, slot.value.string, slot.value_size = _STRING, C.addressof(text), len(value.encode())
        elif isinstance(value, bool):
            slot.type, slot.value.bool, slot.value_size = _BOOL, value, 1
        elif isinstance(value, int):
            slot.type, slot.value.int64, slot.value_size = _INT64, value, 1
        elif isinstance(value, float):
            slot.type, slot.value.float, slot.value_size = _FLOAT, value, 1
        elif isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            array = (C.c_int64 * max(len(value), 1))(*[int(v) for v in value])
            keep.append(array)
            slot.type, slot.value.int64_array, slot.value_size = _INT64_LIST, C.addressof(array), len(value)
        else:
            raise TypeError(f"topology option {key}={value!r}: give a str, int, bool, float or a list of ints")
    return values, keep


def _read_named_values(address: Optional[int], count: int) -> Dict[str, object]:
    """A PJRT_NamedValue array owned by libtpu -> a dict of Python values (copied out)."""
    out: Dict[str, object] = {}
    if not address:
        return out
    for nv in (_NamedValue * count).from_address(address):
        name = C.string_at(nv.name, nv.name_size).decode(errors="replace")
        if nv.type == _STRING:
            out[name] = C.string_at(nv.value.string, nv.value_size).decode(errors="replace")
        elif nv.type == _INT64:
            out[name] = nv.value.int64
        elif nv.type == _INT64_LIST:
            out[name] = list((C.c_int64 * nv.value_size).from_address(nv.value.int64_array)) if nv.value_size else []
        elif nv.type == _FLOAT:
            out[name] = nv.value.float
        elif nv.type == _BOOL:
            out[name] = bool(nv.value.bool)
    return out
