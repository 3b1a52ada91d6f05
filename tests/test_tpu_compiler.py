"""libtpu's deviceless compiler through our PJRT C API binding (xla_fsdp/tpu/pjrt.py).

Real compiles with libtpu 0.0.21 of small hand-written HLO modules, no TPU
attached and nothing mocked: topologies of every accelerator type we name,
the collectives FSDP issues (pinned all-gather, reduce-scatter, all-reduce
with channel ids and global device ids), the compiler's own refusal of a
mix of pinned and unpinned all-reduces, memory statistics checked against
the bytes the module declares, and the TPU-optimized program read back.
"""
from __future__ import annotations

import importlib.util
import os
import re

import pytest

# found, not imported: importing the libtpu package sets TPU_LIBRARY_PATH for the whole session
if importlib.util.find_spec("libtpu") is None or importlib.util.find_spec("jaxlib") is None:
    pytest.skip("libtpu's TPU compiler and jaxlib are not installed: `pip install -e .[tpu-aot]` "
                "(libtpu 0.0.21, jax/jaxlib 0.7.1)", allow_module_level=True)

from xla_fsdp.tpu import compile_options as co  # noqa: E402
from xla_fsdp.tpu import pjrt, topology  # noqa: E402

F32 = 4
ROWS, WIDTH = 8, 128  # each device's shard: f32[8,128]; the weight: f32[128,128]


def collectives_module(devices: int, mix_pinning: bool = False) -> str:
    """An SPMD module, manual everywhere (as FSDP's collectives are): gather the shards, multiply
    by a weight, reduce-scatter the product, all-reduce the shard. All pinned
    (constrain_layout=true); `mix_pinning` adds one unpinned all-reduce."""
    group = "{{" + ",".join(map(str, range(devices))) + "}}"
    full = ROWS * devices
    unpinned = (f"  extra = f32[{ROWS},{WIDTH}]{{1,0}} all-reduce(ar), channel_id=4, replica_groups={group}, "
                f"use_global_device_ids=true, to_apply=add, sharding={{manual}}\n") if mix_pinning else ""
    return f"""HloModule fsdp_collectives, num_partitions={devices}

add {{
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}}

ENTRY main {{
  shard = f32[{ROWS},{WIDTH}]{{1,0}} parameter(0), sharding={{manual}}
  weight = f32[{WIDTH},{WIDTH}]{{1,0}} parameter(1), sharding={{manual}}
  ag = f32[{full},{WIDTH}]{{1,0}} all-gather(shard), channel_id=1, replica_groups={group}, dimensions={{0}}, constrain_layout=true, use_global_device_ids=true, sharding={{manual}}
  y = f32[{full},{WIDTH}]{{1,0}} dot(ag, weight), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, sharding={{manual}}
  rs = f32[{ROWS},{WIDTH}]{{1,0}} reduce-scatter(y), channel_id=2, replica_groups={group}, dimensions={{0}}, constrain_layout=true, use_global_device_ids=true, to_apply=add, sharding={{manual}}
  ar = f32[{ROWS},{WIDTH}]{{1,0}} all-reduce(rs), channel_id=3, replica_groups={group}, constrain_layout=true, use_global_device_ids=true, to_apply=add, sharding={{manual}}
{unpinned}  ROOT out = (f32[{full},{WIDTH}]{{1,0}}, f32[{ROWS},{WIDTH}]{{1,0}}) tuple(y, {"extra" if mix_pinning else "ar"}), sharding={{{{manual}},{{manual}}}}
}}
"""


@pytest.fixture(scope="module")
def compiler():
    return pjrt.get_compiler()


def _open(compiler, accelerator_type: str):
    spec = topology.parse_accelerator_type(accelerator_type)
    return spec, compiler.topology(spec.topology_name, spec.options)


def test_libtpu_speaks_the_pjrt_c_api_our_layouts_come_from(compiler):
    assert compiler.api_version[0] == 0 and compiler.api_version[1] >= pjrt.HEADER_VERSION[1], compiler.api_version
    assert pjrt.get_compiler() is compiler


def test_hlo_text_to_proto_keeps_pinning_channels_and_shardings():
    text = co.hlo_proto_to_text(co.hlo_text_to_proto(collectives_module(4)))
    assert text.count("constrain_layout=true") == 3, text
    for attribute in ("channel_id=1", "channel_id=2", "channel_id=3", "use_global_device_ids=true",
                      "sharding={manual}", "replica_groups={{0,1,2,3}}"):
        assert attribute in text, (attribute, text)


@pytest.mark.parametrize("accelerator_type", ["v4-8", "v5e-8"])
def test_pinned_fsdp_collectives_compile_with_consistent_memory(compiler, accelerator_type):
    spec, slice_ = _open(compiler, accelerator_type)
    with slice_:
        n = len(slice_.devices)
        assert n == spec.devices
        program = compiler.compile(slice_, co.hlo_text_to_proto(collectives_module(n)),
                                   co.spmd_options(slice_.device_ids))
    memory = program.memory
    # arguments are exactly the two parameters the module declares, per device
    assert memory.argument_size == (ROWS * WIDTH + WIDTH * WIDTH) * F32, memory
    outputs = (ROWS * n * WIDTH + ROWS * WIDTH) * F32
    assert outputs <= memory.output_size <= outputs + 4096, memory  # plus the output tuple's index table
    assert memory.generated_code_size > 0 and memory.alias_size == 0 and memory.temp_size >= 0, memory
    assert memory.host_argument_size == memory.host_output_size == memory.host_temp_size == 0, memory
    assert memory.total == memory.argument_size + memory.output_size + memory.temp_size + memory.generated_code_size
    assert memory.total <= spec.hbm_bytes_per_chip
    assert memory.peak_memory >= memory.argument_size + memory.output_size - memory.alias_size, memory
    # the dot alone is 2*M*K*N FLOPs per device
    assert program.cost["flops"] >= 2 * ROWS * n * WIDTH * WIDTH, program.cost
    assert program.num_outputs == 2 and program.compile_seconds > 0
    # the TPU-optimized program keeps the pinned gather; the TPU compiler turns the
    # reduce-scatter into an all-reduce (plus a dynamic slice), beside the module's own all-reduce
    hlo = program.optimized_hlo
    assert hlo.startswith("HloModule ") and "ENTRY" in hlo, hlo[:200]
    assert len(re.findall(r"= \S+ all-gather\(", hlo)) == 1, hlo
    assert len(re.findall(r"= \S+ all-reduce\(", hlo)) == 2, hlo
    assert "reduce-scatter(" not in hlo
    assert all("constrain_layout=true" in line for line in hlo.splitlines()
               if re.search(r"= \S+ (all-gather|all-reduce)\(", line)), hlo


def test_mix_of_pinned_and_unpinned_all_reduces_is_refused_with_the_compilers_words(compiler):
    _, slice_ = _open(compiler, "v4-8")
    with slice_, pytest.raises(pjrt.TpuCompileError) as refused:
        compiler.compile(slice_, co.hlo_text_to_proto(collectives_module(4, mix_pinning=True)),
                         co.spmd_options(slice_.device_ids))
    assert "mix of layout constrained" in refused.value.compiler_message, refused.value
    assert refused.value.function == "PJRT_Compile" and "mix of layout constrained" in str(refused.value)


def test_per_process_program_and_libtpu_flags(compiler):
    module = """HloModule per_rank
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
ENTRY main {
  g = f32[4096]{0} parameter(0)
  ROOT r = f32[4096]{0} all-reduce(g), replica_groups={{0,1,2,3}}, to_apply=add
}
"""
    _, slice_ = _open(compiler, "v4-8")
    with slice_:
        flags = {"xla_tpu_enable_async_collective_fusion": True}
        options = co.per_process_options(slice_.device_ids, flags)
        program = compiler.compile(slice_, co.hlo_text_to_proto(module), options)
        assert program.memory.argument_size == 4096 * F32
        with pytest.raises(pjrt.TpuCompileError, match="No such compile option"):
            compiler.compile(slice_, co.hlo_text_to_proto(module),
                             co.per_process_options(slice_.device_ids, {"xla_no_such_flag": True}))
        # device ids the slice lacks would abort the process inside libtpu: refused before it
        with pytest.raises(ValueError, match="lacks"):
            compiler.compile(slice_, co.hlo_text_to_proto(module), co.per_process_options([0, 1, 2, 99]))
    with pytest.raises(ValueError, match="was closed"):
        slice_.handle


def test_spmd_outputs_keep_the_partitioners_sharding_unless_asked_to_replicate(compiler):
    module = """HloModule gspmd, num_partitions=4
ENTRY main {
  x = f32[64,128]{1,0} parameter(0), sharding={devices=[4,1]0,1,2,3}
  w = f32[128,256]{1,0} parameter(1), sharding={devices=[1,4]0,1,2,3}
  ROOT y = f32[64,256]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    _, slice_ = _open(compiler, "v4-8")
    with slice_:
        proto = co.hlo_text_to_proto(module)
        sharded = compiler.compile(slice_, proto, co.spmd_options(slice_.device_ids)).memory
        replicated = compiler.compile(slice_, proto, co.spmd_options(slice_.device_ids,
                                                                     propagate_output_sharding=False)).memory
    # each device holds a quarter of x and of w either way
    assert sharded.argument_size == replicated.argument_size == (64 * 128 + 128 * 256) // 4 * F32
    assert replicated.output_size == 64 * 256 * F32 and sharded.output_size < replicated.output_size


def _one_collective_module(op: str, rows: int, devices: int) -> str:
    """One unpinned collective over every device of an SPMD module, on bf16[rows,128]:
    a reduce-scatter on dim 0 or an all-reduce."""
    group = "{{" + ",".join(map(str, range(devices))) + "}}"
    out = rows // devices if op == "reduce-scatter" else rows
    extra = ", dimensions={0}" if op == "reduce-scatter" else ""
    return f"""HloModule one_collective, num_partitions={devices}
add {{
  a = bf16[] parameter(0)
  b = bf16[] parameter(1)
  ROOT s = bf16[] add(a, b)
}}
ENTRY main {{
  g = bf16[{rows},128]{{1,0}} parameter(0), sharding={{manual}}
  c = bf16[{out},128]{{1,0}} {op}(g), channel_id=1, replica_groups={group}{extra}, use_global_device_ids=true, to_apply=add, sharding={{manual}}
  ROOT out = bf16[{out},128]{{1,0}} copy(c), sharding={{manual}}
}}
"""


def test_large_reduce_scatter_is_read_as_one(compiler):
    """[Note: libtpu's reduce-scatter emitter]: libtpu writes a 16 MiB reduce-scatter on v4-8
    as a fusion holding an all-reduce and a slice, but gives it the emitter of the
    reduce-scatters it keeps, not the all-reduce's; our reader counts it as a reduce-scatter."""
    from xla_fsdp.tpu import optimized_hlo as oh

    _, slice_ = _open(compiler, "v4-8")
    programs = {}
    with slice_:
        for op, rows in (("reduce-scatter", 65536), ("reduce-scatter", 4096), ("all-reduce", 65536)):
            programs[(op, rows)] = compiler.compile(slice_, co.hlo_text_to_proto(_one_collective_module(op, rows, 4)),
                                                    co.spmd_options(slice_.device_ids)).optimized_hlo

    def top(text):  # the entry's collective instructions with their emitters
        entry = oh.computations(text)["ENTRY"]
        return [(i.opcode, oh.emitter(i)) for i in entry if oh.emitter(i)]

    large, kept, reduce_all = (top(programs[k]) for k in programs)
    assert large[0][0] == "fusion" and "reduce-scatter(" not in programs[("reduce-scatter", 65536)], large
    assert "all-reduce(" in programs[("reduce-scatter", 65536)]  # inside the fusion
    assert kept[0][0] == "reduce-scatter", kept
    assert large[0][1] == kept[0][1] != reduce_all[0][1], (large, kept, reduce_all)
    found = [c for c in oh.collectives(programs[("reduce-scatter", 65536)]) if c.bytes > 1 << 20]
    assert [c.kind for c in found] == ["reduce-scatter"], found
    full = 65536 * 128 * 2
    assert full <= found[0].bytes <= 1.02 * full, found
    assert oh.ring_bytes(found[0], 4) == pytest.approx(0.75 * found[0].bytes)
    assert [c.kind for c in oh.collectives(programs[("all-reduce", 65536)])] == ["all-reduce"]


@pytest.mark.parametrize("accelerator_type,devices,processes", [
    ("v4-8", 4, 1), ("v4-32", 16, 4), ("v5e-8", 8, 1), ("v5e-16", 16, 4), ("v5p-8", 4, 1), ("v6e-8", 8, 1)])
def test_topology_reports_devices_and_processes(compiler, accelerator_type, devices, processes):
    spec, slice_ = _open(compiler, accelerator_type)
    with slice_:
        assert (len(slice_.devices), slice_.num_processes) == (devices, processes), slice_
        per_process = {p: sum(d.process_index == p for d in slice_.devices) for p in range(processes)}
        assert set(per_process.values()) == {devices // processes}, per_process
        assert {d.kind for d in slice_.devices} == {spec.chip.device_kind}
        assert sorted(slice_.device_ids) == list(range(devices))
        assert all(len(d.coords) == 3 for d in slice_.devices)
        assert "TPU" in slice_.platform_version


def test_every_known_accelerator_type_is_a_topology_libtpu_accepts(compiler):
    wrong = []
    for name in topology.known_types():
        spec, slice_ = _open(compiler, name)
        with slice_:
            got = (len(slice_.devices), slice_.num_processes, {d.kind for d in slice_.devices})
        if got != (spec.devices, spec.hosts, {spec.chip.device_kind}):
            wrong.append((name, got))
    assert not wrong, wrong


def test_accelerator_types_as_users_type_them():
    v4 = topology.parse_accelerator_type("v4-8")
    assert (v4.chips, v4.hosts, v4.topology_name, v4.options["chip_config_name"]) == (4, 1, "v4:2x2x1", "megacore")
    assert topology.parse_accelerator_type("V5litepod-8") == topology.parse_accelerator_type("v5e-8")
    cube = topology.parse_accelerator_type("v4-128")
    assert cube.topology_name == "v4:4x4x4" and cube.options["wrap"] == [True, True, True]
    assert topology.parse_accelerator_type("v4-64").options["wrap"] == [False, False, False]
    v5e = topology.parse_accelerator_type("v5e-8")
    assert v5e.options["chips_per_host_bounds"] == [2, 4, 1] and v5e.hbm_bytes_per_chip == 16 * 1024 ** 3
    assert v5e.peak_bf16_flops_per_chip == 197e12 and v5e.hbm_bandwidth == 819e9 and v5e.ici_bandwidth > 0


@pytest.mark.parametrize("text", ["v7-8", "v4-7", "v4-6", "v5e-3", "tpu", "v5e-"])
def test_unknown_accelerator_type_lists_the_known_ones(text):
    with pytest.raises(ValueError) as unknown:
        topology.parse_accelerator_type(text)
    message = str(unknown.value)
    assert repr(text) in message and "v4-8" in message and "v5e-8" in message and "v6e-256" in message


def test_topology_refusal_carries_libtpu_message(compiler):
    with pytest.raises(pjrt.TpuCompileError, match="not divisible"):
        compiler.topology("v4:3x3x3", {"chip_config_name": "megacore", "chips_per_host_bounds": [2, 2, 1]})


def test_missing_library_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv(pjrt.LIBRARY_ENV, str(tmp_path / "no-libtpu.so"))
    with pytest.raises(pjrt.LibtpuMissing, match=r'pip install "libtpu==0\.0\.21"'):
        pjrt.library_path()


def _looping_module(n: int) -> str:
    """Four passes of a (n, n) f32 matmul in a While loop; values made before it live across it."""
    return f"""HloModule looping
cond {{
  c = (s32[], f32[{n},{n}]{{1,0}}, f32[{n},{n}]{{1,0}}) parameter(0)
  i = s32[] get-tuple-element(c), index=0
  four = s32[] constant(4)
  ROOT lt = pred[] compare(i, four), direction=LT
}}
body {{
  c = (s32[], f32[{n},{n}]{{1,0}}, f32[{n},{n}]{{1,0}}) parameter(0)
  i = s32[] get-tuple-element(c), index=0
  x = f32[{n},{n}]{{1,0}} get-tuple-element(c), index=1
  w = f32[{n},{n}]{{1,0}} get-tuple-element(c), index=2
  y = f32[{n},{n}]{{1,0}} dot(x, w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  z = f32[{n},{n}]{{1,0}} tanh(y)
  one = s32[] constant(1)
  j = s32[] add(i, one)
  ROOT t = (s32[], f32[{n},{n}]{{1,0}}, f32[{n},{n}]{{1,0}}) tuple(j, z, w)
}}
ENTRY main {{
  p = f32[{n},{n}]{{1,0}} parameter(0)
  q = f32[{n},{n}]{{1,0}} dot(p, p), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  r = f32[{n},{n}]{{1,0}} exponential(p)
  zero = s32[] constant(0)
  init = (s32[], f32[{n},{n}]{{1,0}}, f32[{n},{n}]{{1,0}}) tuple(zero, q, r)
  loop = (s32[], f32[{n},{n}]{{1,0}}, f32[{n},{n}]{{1,0}}) while(init), condition=cond, body=body
  h = f32[{n},{n}]{{1,0}} get-tuple-element(loop), index=1
  s = f32[{n},{n}]{{1,0}} add(h, q)
  ROOT out = f32[{n},{n}]{{1,0}} multiply(s, r)
}}
"""


def test_libtpu_states_the_hbm_a_program_needs_and_pjrt_counts_its_fragmentation_twice(compiler):
    """[Note: the HBM a TPU program needs]: libtpu's compile log gives the program, arguments and
    outputs per chip; the check sets that against the usable HBM it prints, and PJRT's temporaries
    are libtpu's plus the heap's fragmentation again."""
    from dataclasses import replace

    from xla_fsdp.aot import report
    from xla_fsdp.tpu import compile_log

    n = 8192  # 256 MiB a matrix: past the chip's 128 MiB of CMEM, where small buffers go
    spec = topology.parse_accelerator_type("v4-8")
    _, slice_ = _open(compiler, "v4-8")
    with slice_:
        program = compiler.compile(slice_, co.hlo_text_to_proto(_looping_module(n)),
                                   co.per_process_options(slice_.device_ids))
    own = program.hbm
    assert own is not None, f"no libtpu log read from {compile_log.log_file()}"
    matrix = n * n * F32
    assert (own.arguments, own.outputs, own.shared) == (matrix, matrix, 0)
    assert own.usable == int(30.75 * 2 ** 30)  # a v4 chip's 32 GiB less libtpu's reserve
    assert own.total == own.program + 2 * matrix
    assert 0 < own.temporaries <= own.program
    # PJRT's temporaries = libtpu's (which hold the fragmentation) + the fragmentation again; the
    # log's sizes carry 3-4 digits
    assert abs(program.memory.temp_size - (own.temporaries + own.fragmentation)) <= 0.01 * program.memory.temp_size
    memory = report.hbm_account(program, spec.hbm_bytes_per_chip)
    assert (memory["source"], memory["peak"], memory["usable"]) == ("libtpu", own.total, own.usable)
    assert memory["pjrt_peak"] == program.memory.total
    # without a log to read, PJRT's count and the chip's HBM, and it says so
    fallback = report.hbm_account(replace(program, hbm=None), spec.hbm_bytes_per_chip)
    assert (fallback["source"], fallback["peak"], fallback["usable"]) == ("pjrt", program.memory.total,
                                                                           spec.hbm_bytes_per_chip)
    assert compile_log.program_hbm("no compile here") is None


def test_the_compile_s_stages_are_read_from_libtpus_log_and_named_in_the_report(compiler):
    """[Note: where libtpu's compile time goes]: a real compile's HLO passes, back end and code
    generation, each within the compile's own wall time; durations as libtpu prints them; the
    check's report line names them. The compile's last line (END_TO_END) is read as soon as the
    compile returns: libtpu was loaded to write its log unbuffered, and LIBTPU_INIT_ARGS is as
    the user left it ([Note: the HBM a TPU program needs])."""
    from xla_fsdp.aot import report
    from xla_fsdp.tpu import compile_log

    assert "logbuflevel" not in os.environ.get("LIBTPU_INIT_ARGS", "")
    _, slice_ = _open(compiler, "v4-8")
    with slice_:
        program = compiler.compile(slice_, co.hlo_text_to_proto(_looping_module(1024)),
                                   co.per_process_options(slice_.device_ids))
    stages = program.stages
    assert {"hlo_passes", "back_end", "code_generation", "end_to_end"} <= set(stages), stages
    assert all(0 < stages[k] for k in ("hlo_passes", "back_end")), stages
    assert sum(stages[k] for k in ("hlo_passes", "back_end", "code_generation")) <= program.compile_seconds, \
        (stages, program.compile_seconds)
    assert compile_log.duration_seconds("1m7.34833860575s") == pytest.approx(67.34833860575)
    assert compile_log.duration_seconds("862.71086675ms") == pytest.approx(0.86271086675)
    assert compile_log.duration_seconds("1h2m3.5s") == pytest.approx(3723.5)
    with pytest.raises(ValueError, match="not a libtpu duration"):
        compile_log.duration_seconds("7 parsecs")
    assert compile_log.stage_seconds("no compile here") == {}
    line = report._stages({"hlo_passes": 6.21, "back_end": 67.3, "code_generation": 4.4, "end_to_end": 78.8})
    assert line == ": HLO passes 6.2 s, back end 67.3 s, code generation 4.4 s", line


def test_the_largest_program_of_a_log_is_found_among_several(compiler):
    """[Note: keep what fits] reads libtpu's log of a training job, where the step is one program
    among several: of the programs compiled since a mark, the one needing the most HBM."""
    from xla_fsdp.tpu import compile_log

    _, slice_ = _open(compiler, "v4-8")
    start = compile_log.mark()
    with slice_:
        big = compiler.compile(slice_, co.hlo_text_to_proto(_looping_module(8192)),
                               co.per_process_options(slice_.device_ids)).hbm
        small = compiler.compile(slice_, co.hlo_text_to_proto(_looping_module(1024)),
                                 co.per_process_options(slice_.device_ids)).hbm
    text = compile_log.since(start)
    assert big.total > small.total
    # under the single controller torch_xla gives no device figures; "fit" reads them here
    from xla_fsdp.memory import device_figures

    def spmd():
        raise RuntimeError("MemoryInfo not supported for SPMD virtual device")

    got = device_figures.figures(device_figures.Before(spmd), spmd)
    assert got is None  # nothing compiled since
    before = device_figures.Before(spmd)
    before.log = start
    got = device_figures.figures(before, spmd)
    assert got == {"peak": big.total, "limit": big.usable, "source": "libtpu log"}, got
    assert compile_log.program_hbm(text) == small  # the last one
    assert compile_log.largest_program_hbm(text) == big
    assert compile_log.largest_program_hbm("no compile here") is None


def test_a_compile_s_last_stage_line_written_late_is_still_read(monkeypatch, tmp_path):
    """compile_log.compile_since: the stages are in the log but END_TO_END is not yet; it is
    written 0.2 s later (by another thread here), and the read waits for it. Without stage lines
    at all (no log, a libtpu that does not time its stages) it does not wait."""
    import threading
    import time

    from xla_fsdp.tpu import compile_log

    log = tmp_path / "tpu_driver.log.INFO.x"
    log.write_text("I1201 earlier line\n")
    monkeypatch.setattr(compile_log, "log_file", lambda: str(log))
    where = compile_log.mark()
    with open(log, "a") as f:
        f.write("I1201 HLO_PASSES stage duration: 7.3ms\nI1201 BACKEND_PASSES stage duration: 169ms\n")

    def late():
        time.sleep(0.2)
        with open(log, "a") as f:
            f.write("I1201 CODE_GENERATION stage duration: 25ms\nI1201 END_TO_END stage duration: 286.3ms\n")

    writer = threading.Thread(target=late)
    writer.start()
    stages = compile_log.stage_seconds(compile_log.compile_since(where))
    writer.join()
    assert stages == {"hlo_passes": 0.0073, "back_end": 0.169, "code_generation": 0.025, "end_to_end": 0.2863}, stages

    quiet = tmp_path / "quiet.log"
    quiet.write_text("I1201 nothing about stages\n")
    monkeypatch.setattr(compile_log, "log_file", lambda: str(quiet))
    start = time.monotonic()
    assert compile_log.compile_since((str(quiet), 0)) == "I1201 nothing about stages\n"
    assert time.monotonic() - start < 0.5


def test_the_suites_xla_cpu_flags_leave_the_tpu_program_unchanged(tmp_path):
    """[Note: the suite compiles XLA:CPU at optimization level 0] (tests/conftest.py): libtpu reads
    XLA_FLAGS too, and with the suite's flags (optimization level 0, XLA:CPU's older emitters, one
    code generation module) its program is the same text. Each compile runs in its own process
    (libtpu reads the flags when it loads); a flag that does change the TPU program (one pass
    disabled) shows that the comparison sees XLA_FLAGS."""
    import subprocess
    import sys

    from conftest import FAST_COMPILE_FLAGS

    code = ("import sys; sys.path.insert(0, sys.argv[2]); "
            "from test_tpu_compiler import collectives_module, _open; "
            "from xla_fsdp.tpu import compile_options as co, pjrt; "
            "c = pjrt.get_compiler(); spec, s = _open(c, 'v5e-8')\n"
            "with s:\n"
            "    p = c.compile(s, co.hlo_text_to_proto(collectives_module(len(s.devices))), co.spmd_options(s.device_ids))\n"
            "open(sys.argv[1], 'w').write(p.optimized_hlo)")
    programs = {}
    for name, flags in (("none", ""), ("level 0", " ".join(FAST_COMPILE_FLAGS)),
                        ("control", "--xla_disable_hlo_passes=reduce-scatter-decomposer")):
        out = tmp_path / f"{len(programs)}.hlo"
        env = dict(os.environ, XLA_FLAGS=flags, PJRT_DEVICE="CPU")
        proc = subprocess.run([sys.executable, "-c", code, str(out), os.path.dirname(__file__)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        programs[name] = out.read_text()
    assert programs["level 0"] == programs["none"]
    assert programs["control"] != programs["none"] and "reduce-scatter(" in programs["control"]
