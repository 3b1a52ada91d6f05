"""Compiling the traced step for the slice, and the report: compiles, HBM per chip, collectives.

Memory per chip is libtpu's own account of the program (its compile log: program + arguments + outputs not in
donated arguments, against the HBM it lets programs use; [Note: the HBM a TPU program needs]), PJRT's statistics
beside it. The collectives come from the TPU-optimized program (`xla_fsdp.tpu.optimized_hlo`), never from the
program XLA:CPU would run.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from typing import Callable, Optional

from xla_fsdp.aot import program as prog
from xla_fsdp.aot.dump import BUFFER_ASSIGNMENT
from xla_fsdp.tpu import compile_options as co
from xla_fsdp.tpu import buffer_assignment, compile_log, dcn, host_transfers, memory_breakdown, optimized_hlo, step_time

GIB = 1024 ** 3
DUMP_FLAG = "xla_dump_to"  # a compile option libtpu takes (a string): [Note: libtpu's buffer assignment]
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
# libtpu's out-of-memory refusal: "Ran out of memory in memory space hbm. Used 67.64G of 30.75G hbm."
_OOM = re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm")


def out_of_memory(message: str):
    """(needed, usable) bytes per chip when the compiler refused for lack of HBM, else None."""
    m = _OOM.search(message)
    return (compile_log.size_bytes(m.group(1), m.group(2)), compile_log.size_bytes(m.group(3), m.group(4))) if m \
        else None


def is_spmd(text: str) -> bool:
    """One program for every device (single controller, GSPMD) rather than one per replica."""
    m = _PARTITIONS.search(text.split("\n", 1)[0])  # the module's header
    return bool(m) and int(m.group(1)) > 1


def per_replica_argument_bytes(text: str) -> int:
    """Bytes of the entry parameters of a per-replica program (what each chip is handed)."""
    lines = text.splitlines()
    return sum(sum(optimized_hlo.shape_bytes(lines[i].split(" = ", 1)[1].split(" parameter(", 1)[0]))
               for i in prog.entry_lines(text) if " parameter(" in lines[i])


def _diagnose(message: str, text: str, calls=()) -> str:
    """What in the job caused a compile error, where we can tell."""
    if "mix of layout constrained and unconstrained" in message and (mix := prog.layout_mix(text, calls)):
        return mix
    if start_up := _start_up_only(message):
        return (f"{start_up} is read when libtpu starts, not per compile: put it in LIBTPU_INIT_ARGS and "
                "give the compile flags with --libtpu-flags (the check compiles with those)")
    if "RESOURCE_EXHAUSTED" in message or "Ran out of memory" in message:
        return ("the step's buffers do not fit in the chip's HBM; shard more (FULL_SHARD), checkpoint "
                "activations (xla_fsdp_grad_ckpt), lower the per-device batch, or pick a larger slice")
    return ""


def _start_up_only(message: str) -> Optional[str]:
    """The flag a compile refused because libtpu reads it only when it starts (its dumps, its thread count)."""
    m = re.search(r"No such compile option: '([\w.]+)'", message)
    return m.group(1) if m else None


def hbm_account(compiled, hbm_per_chip: int) -> dict:
    """HBM per chip of a compiled program: libtpu's own account when its log has one, PJRT's statistics beside it.
    "peak" is what the chip needs, "usable" what it has for programs; "source" says whose they are."""
    m = compiled.memory
    out = {"arguments": m.argument_size, "outputs": m.output_size, "aliased": m.alias_size,
           "temporaries": m.temp_size, "generated_code": m.generated_code_size, "pjrt_peak": m.total,
           "compiler_peak": m.peak_memory}
    own = getattr(compiled, "hbm", None)
    if own is None:  # no libtpu log to read: PJRT's count, which overstates looping programs
        out.update(peak=m.total, usable=hbm_per_chip, source="pjrt")
    else:
        out.update(peak=own.total, usable=own.usable, source="libtpu", libtpu_program=own.program,
                   libtpu_temporaries=own.temporaries, libtpu_fragmentation=own.fragmentation)
    return out


def _compile(text: str, spec, compiler, flags: list, spmd: bool, started_with: bool):
    """(the compiled program or None, the compiler's message, the start-up flags left out)."""
    start_up, message = [], ""
    while True:
        try:
            with compiler.topology(spec.topology_name, spec.options) as topology:
                options = (co.spmd_options if spmd else co.per_process_options)(topology.device_ids, flags)
                return compiler.compile(topology, co.hlo_text_to_proto(text), options), "", start_up
        except Exception as e:  # the compiler's own error text is the report
            message = getattr(e, "compiler_message", None) or str(e)
            name = _start_up_only(message)
            if name != DUMP_FLAG and not (started_with and name and any(n == name for n, _ in flags)):
                return None, message, start_up
            if name != DUMP_FLAG:  # a libtpu that takes no dump option: no breakdown, nothing else lost
                start_up.append(name)
            flags = [(n, v) for n, v in flags if n != name]


def check_program(text: str, spec, compiler, libtpu_flags: str = "", say: Callable = print, calls=(),
                  started_with: bool = False, tensors=None, keep_in: Optional[str] = None,
                  with_curve: bool = False) -> dict:
    """Compile the traced module `text` for the slice `spec` (a `SliceSpec`); the report as a dict. `calls`: the
    job's own collective calls the trace recorded (see `program.layout_mix`). `started_with`: `libtpu_flags` is the
    LIBTPU_INIT_ARGS libtpu read when it started, so a flag it takes only then applies already and is left out of
    the compile's own flags (listed under "start_up_flags") instead of failing it. `tensors`: the job's tensors by
    kind (capture.TENSORS), to tell the program's arguments apart in the memory breakdown. `keep_in`: a folder to
    copy libtpu's buffer assignment into (as BUFFER_ASSIGNMENT), for --dump. `with_curve`: keep the HBM in use over
    the schedule as "hbm_curve" (for --timeline)."""
    spmd = is_spmd(text)
    text = prog.place_parameter_shardings(text) if spmd else text
    result = {"tpu": spec.name, "chips": spec.job_chips, "hosts": spec.hosts * spec.slices, "slices": spec.slices,
              "program": "spmd" if spmd else "per_replica", "libtpu_flags": libtpu_flags,
              "hbm_per_chip": spec.hbm_bytes_per_chip, "compiles": False, "fits": False, "error": "", "cause": ""}
    mix = prog.layout_mix(text, calls)
    say(f"xla_fsdp.aot: compiling the step for {spec.name} with libtpu ({'one SPMD program over' if spmd else 'one program per chip,'} "
        f"{spec.job_chips} chips)")
    started = time.time()
    dumps = tempfile.mkdtemp(prefix="xla_fsdp_aot_libtpu_dump_")  # [Note: libtpu's buffer assignment]: its dumps
    flags = co.parse_libtpu_init_args(libtpu_flags) + [(DUMP_FLAG, dumps)]
    try:
        compiled, message, start_up = _compile(text, spec, compiler, flags, spmd, started_with)
        dumped = buffer_assignment.find(dumps) if compiled is not None else None
        assignment = buffer_assignment.read_file(dumped) if dumped else None
        if dumped and keep_in:
            shutil.copy(dumped, os.path.join(keep_in, BUFFER_ASSIGNMENT))
    finally:
        shutil.rmtree(dumps, ignore_errors=True)
    if start_up:
        result["start_up_flags"] = start_up
    if compiled is None:
        result.update(error=message.strip(), cause=_diagnose(message, text, calls) or (mix or ""),
                      compile_seconds=round(time.time() - started, 1))
        oom = out_of_memory(message)
        if oom:  # the program is valid; its buffers exceed the chip: "does not fit", with the numbers
            result["does_not_fit"] = {"needed": oom[0], "usable": oom[1],
                                      "arguments": None if spmd else per_replica_argument_bytes(text)}
        return result
    # compile_stages: [Note: where libtpu's compile time goes] in xla_fsdp/tpu/compile_log.py ({} without libtpu's log)
    result.update(compile_seconds=round(time.time() - started, 1),
                  compile_stages={name: round(s, 1) for name, s in compiled.stages.items()})
    memory = hbm_account(compiled, spec.hbm_bytes_per_chip)
    result.update(compiles=True, memory=memory, fits=memory["peak"] <= memory["usable"], cost=compiled.cost)
    if assignment is not None and memory["source"] == "libtpu":  # [Note: the peak HBM, broken down]
        try:
            kinds = memory_breakdown.parameter_kinds(text, tensors) if tensors else None
            split = memory_breakdown.breakdown(assignment, compiled.optimized_hlo, memory, kinds)
        except Exception as e:  # a dump this reader does not follow costs the breakdown, not the check
            memory["breakdown_error"] = f"{type(e).__name__}: {e}"
        else:
            memory["breakdown"] = dict(split.as_dict(), arguments_by_kind=kinds is not None)
            if with_curve:
                result["hbm_curve"] = split.curve
    hlo = compiled.optimized_hlo
    found = optimized_hlo.all_collectives(hlo)  # While bodies once per trip
    result["collectives"] = optimized_hlo.summarize(found, spec.chips)
    result["while_loops"] = optimized_hlo.while_loops(hlo)
    events = [] if spec.slices > 1 or host_transfers.HOST in hlo else None
    result["projection"] = step_time.estimate(hlo, spec.chip, spec.chips, spec.torus_axes, events=events).as_dict()
    seconds = result["projection"]["projected_seconds"]
    if spec.slices > 1:  # [Note: DCN transfers in libtpu's program]
        result["dcn"] = dcn.summarize(hlo, spec.slices, spec.dcn_bytes_per_s, events, seconds)
    if host_transfers.HOST in hlo:  # [Note: host transfers in libtpu's program]
        result["host_transfers"] = host_transfers.summarize(hlo, spec, events, seconds)
    if result["projection"]["kernel_calls"]:  # Pallas kernels: also at full MXU peak ([Note: charging Pallas kernels])
        at_peak = step_time.estimate(hlo, spec.chip, spec.chips, spec.torus_axes, kernel_mxu_share=1.0)
        result["projection"]["projected_seconds_kernels_at_peak"] = at_peak.seconds
    result.update(collective_list=[c.as_dict() for c in found], optimized_hlo=hlo)
    return result


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB // 10 else f"{n / 2 ** 20:.1f} MiB"


_STAGE_NAMES = (("hlo_passes", "HLO passes"), ("back_end", "back end"), ("code_generation", "code generation"))


def _stages(stages) -> str:
    """": HLO passes 6.2 s, back end 67.3 s, code generation 4.4 s" ("" without them)."""
    named = [f"{label} {stages[key]:.1f} s" for key, label in _STAGE_NAMES if key in (stages or {})]
    return (": " + ", ".join(named)) if named else ""


def _allocator(name) -> str:
    """[Note: libtpu's compile and the host's malloc]: what the compile allocated with, and the faster way."""
    if name == "glibc":
        return "; glibc's malloc: about 0.75x the time with jemalloc or tcmalloc, apt install libjemalloc2"
    return f"; {name}" if name else ""


def render(r: dict) -> str:
    """The human-readable report, with the retry without rings when the check made one."""
    text = _render_one(r)
    other = r.get("without_rings")
    return text if other is None else text + "\n" + render_without_rings(other, r["hbm_per_chip"])


def render_without_rings(o: dict, hbm: int) -> str:
    """What the step needs with the rings variable 0 ([Note: rings off for the last GiB])."""
    (name, value), = o["switch"].items()
    head = f"With {name}={value} (all-gathers and staged reduce-scatters, libtpu's 70% budget), checked again:"
    if o.get("does_not_fit"):
        need = o["does_not_fit"]
        return (f"{head} does not fit either: {_gib(need['needed'])} needed, {_gib(need['usable'])} usable "
                "per chip. Shard more, checkpoint more layers, or shorten the batch per chip.")
    if not o["compiles"]:
        first = (o.get("error") or "").strip().splitlines()[:1]
        return f"{head} does not compile" + (f": {first[0]}" if first else ".")
    peak, hbm = o["memory"]["peak"], o["memory"].get("usable", hbm)
    if not o["fits"]:
        return f"{head} does not fit either: {_gib(peak)} needed, {_gib(hbm)} usable per chip."
    line = f"{head} FITS, peak {_gib(peak)} of {_gib(hbm)} usable per chip"
    if p := o.get("projection"):
        line += (f"; PROJECTED step {p['projected_seconds']:.3f} s ({p['calibrated_seconds']:.3f} s "
                 f"calibrated), not measured")
    return line + (f". Run the job with `export {name}={value}` (xla_spawn, run_clm, the Trainer integration "
                   "and `import xla_fsdp` read it before libtpu starts).")


def _render_one(r: dict) -> str:
    lines = [f"== {r.get('script', 'job')} on {r['tpu']} ({r['chips']} chips, {r['hosts']} host(s)), "
             f"{r.get('runtime', '').replace('_', ' ')} runtime, {r['program'].replace('_', ' ')} program"]
    if r.get("does_not_fit"):
        need = r["does_not_fit"]
        args = need.get("arguments")
        extra = f" (the compiler's count; the step's inputs, {_gib(args)} per chip, come on top when it " \
                "lists them as 0B)" if args else " (the compiler's count)"
        lines.append(f"DOES NOT FIT: {_gib(need['needed'])} needed, {_gib(need['usable'])} usable per chip "
                     f"(of {_gib(r['hbm_per_chip'])} HBM){extra}. The compiler's account:")
        lines += ["  " + line for line in r["error"].splitlines()[:40]]
        lines.append("What to do: " + r["cause"])
        return "\n".join(lines)
    if not r["compiles"]:
        lines.append("DOES NOT COMPILE for this TPU. The compiler said:")
        lines += ["  " + line for line in r["error"].splitlines()[:20]]
        if r["cause"]:
            lines.append("Cause: " + r["cause"])
        return "\n".join(lines)
    m = r["memory"]
    usable = m.get("usable", r["hbm_per_chip"])
    lines.append(f"compiles (libtpu, {r['compile_seconds']:.1f} s{_stages(r.get('compile_stages'))}"
                 f"{_allocator(r.get('allocator'))})")
    if r.get("start_up_flags"):
        lines.append("  read by libtpu when it started (LIBTPU_INIT_ARGS), not compile flags: "
                     + ", ".join(r["start_up_flags"]))
    if m.get("source") == "libtpu":
        lines.append("HBM per chip (libtpu's own account, from its compile log):")
        lines.append(f"  {'program':<15}{_gib(m['libtpu_program']):>12}   temporaries and code; of the temporaries "
                     f"{_gib(m['libtpu_fragmentation'])} are the buffer heap's fragmentation")
        lines.append(f"  {'arguments':<15}{_gib(m['arguments']):>12}")
        lines.append(f"  {'outputs':<15}{_gib(m['outputs']):>12}   ({_gib(m['aliased'])} of them in donated arguments)")
        lines.append(f"  PJRT's statistics count the fragmentation twice: {_gib(m['pjrt_peak'])}")
    else:
        lines.append("HBM per chip (PJRT's compiled-memory statistics; libtpu wrote no log to read, so "
                     "looping programs may be overstated):")
        lines += [f"  {key:<15}{_gib(m[key]):>12}"
                  for key in ("arguments", "outputs", "aliased", "temporaries", "generated_code")]
    lines.append(f"  {'needs':<15}{_gib(m['peak']):>12}   of {_gib(usable)} usable per chip "
                 f"({100 * m['peak'] / usable:.0f}%)")
    lines += _render_breakdown(m.get("breakdown"), m.get("libtpu_fragmentation"))
    if not r["fits"]:
        lines.append(f"DOES NOT FIT: {_gib(m['peak'])} needed, {_gib(usable)} usable per chip")
    lines += _render_recompute(r.get("recompute"))
    lines += _render_fit(r.get("fit"))
    c = r["collectives"]
    async_share = _share(c["async_bytes_fraction"] * c["bytes"], c["bytes"])
    lines.append(f"collectives of the TPU-optimized program: {c['count']} ({c['sync']} synchronous, "
                 f"{c['async']} asynchronous), {c['bytes'] / 1e9:.3f} GB per step; {async_share} of the bytes "
                 f"asynchronous, {100 * c['async_bytes_with_matmul_fraction']:.0f}% with a matmul scheduled beside them")
    lines += _render_loops(r.get("while_loops"))
    lines.append(f"  {'kind':<20}{'sync':>6}{'async':>7}{'with matmul':>13}{'GB':>10}{'async bytes':>13}"
                 f"{'GB sent/chip':>14}")
    for kind, k in sorted(c["by_kind"].items()):
        lines.append(f"  {kind:<20}{k['sync']:>6}{k['async']:>7}{k['async_with_matmul']:>13}"
                     f"{k['bytes'] / 1e9:>10.3f}{_share(k.get('async_bytes', 0), k['bytes']):>13}"
                     f"{k.get('sent', 0) / 1e9:>14.3f}")
    p = r.get("projection")
    if p:
        lines.append(f"PROJECTED step time on the compiled schedule (not measured; roofline, see "
                     f"xla_fsdp/tpu/step_time.py): {p['projected_seconds']:.3f} s, of which compute "
                     f"{p['compute_seconds']:.3f} s and communication the core waits for "
                     f"{p['projected_seconds'] - p['compute_seconds']:.3f} s; x{step_time.CALIBRATION_RATIO:.3f} "
                     f"calibration ({step_time.CALIBRATION_SOURCE}): {p['calibrated_seconds']:.3f} s")
        if p.get("kernel_calls"):
            lines.append(f"  Pallas kernels: {p['kernel_calls']} calls, {p['kernel_flops'] / 1e12:.2f} TFLOP charged at "
                         f"{100 * p['kernel_mxu_share']:.0f}% of MXU peak ({p['kernel_seconds']:.3f} s); at 100%: "
                         f"PROJECTED step {p['projected_seconds_kernels_at_peak']:.3f} s "
                         "(xla_fsdp/tpu/kernel_cost.py)"
                         + (f"; {p['kernels_without_flops']} charged their bytes only" if p["kernels_without_flops"] else ""))
    lines += _render_dcn(r.get("dcn")) + host_transfers.describe(r.get("host_transfers"), p)
    return "\n".join(lines)


def _render_recompute(blocks) -> list:
    """What each checkpointed block saved ([Note: recomputation policies]; remat_policy.applied)."""
    if not blocks:
        return []
    return ["recomputation (what each checkpointed block saves for its backward):"] + [
        f"  {b['count']} {b['block']} ({b['where']}): {b['policy']}, {b['saves']}" for b in blocks]


def _render_fit(f: Optional[dict]) -> list:
    """[Note: keep what fits] in xla_fsdp/memory/fit.py: what "fit" chose on this slice."""
    if not f:
        return []
    first = f["every_unit_recomputed"]
    was = first.get("projection", {}).get("projected_seconds")
    what = (f"remat_policy=\"fit\": the {f['units']} checkpointed units save {', '.join(f['policies'])} "
            "(forward order)" if f.get("policies") else
            f"checkpoint_all_but_last=\"fit\": the last {f['count']} of {f['units']} checkpointed units keep "
            "their activations")
    lines = [f"{what} on this slice (every unit recomputed: {_gib(first['memory']['peak'])}"
             + (f", PROJECTED {was:.3f} s" if was else "") + ")"]
    if f.get("last_unit_fits_over_time"):  # [Note: keep what fits, over time] in xla_fsdp/memory/fit.py
        lines.append("  by the step's memory over time the last unit's activations fit (\"fit\" sets them against "
                     "the peak, deeper in the backward): checkpoint_all_but_last=1 may run faster; check it")
    return lines


def _render_loops(loops) -> list:
    return [f"  While loop {loop['name']} (scan_layers): body counted "
            + (f"{loop['trip_count']} times (its trip count)" if loop["trip_count"] else
               "ONCE: its trip count is not in the program, so its collectives and time are undercounted")
            for loop in loops or ()]


def _render_dcn(d: Optional[dict]) -> list:
    """The cross-slice transfers ([Note: DCN transfers in libtpu's program])."""
    if not d:
        return []
    lines = [f"between the {d['slices']} slices (DCN, libtpu's megascale transfers; the collectives above run on "
             f"ICI within a slice): {d['transfers']} transfers, {d['bytes_per_chip'] / 1e6:.1f} MB per chip "
             f"({d['sent_per_chip'] / 1e6:.1f} MB sent on the ring), "
             f"{100 * d['beside_compute_fraction']:.0f}% of the bytes with compute scheduled beside them, "
             f"{100 * d['beside_matmul_fraction']:.0f}% with a matmul"]
    if "projected_seconds" in d:
        lines.append(f"  PROJECTED at {d['dcn_bytes_per_s'] * 8 / 1e9:.1f} Gbit/s of DCN per chip: "
                     f"{d['dcn_seconds']:.3f} s on the DCN from {100 * d['first_send_fraction']:.0f}% of the step on, "
                     f"the core waits {d['exposed_seconds']:.3f} s for it: step {d['projected_seconds']:.3f} s "
                     "(before calibration)")
    if d.get("in_loops"):
        lines.append(f"  {d['in_loops']} transfers inside While loops are not counted here")
    return lines


def _render_breakdown(b: Optional[dict], libtpu_fragmentation: Optional[int] = None) -> list:
    """The peak, part by part, and libtpu's fragmentation figure where it differs from ours by over 1% of the peak."""
    if not b:
        return []
    lines = [f"  the peak by what it holds (libtpu's buffer assignment; the heap at its fullest at "
             f"{b['peak_instruction']}, {_gib(b['live_peak'])} live):"]
    lines += [f"    {name:<22}{_gib(size):>12}   {_share(size, b['peak'])}"
              for name, size in b["parts"].items() if size]
    note = "" if b.get("arguments_by_kind") else " (arguments not told apart: the job's tensors were not listed)"
    lines.append(f"    {'sum':<22}{_gib(b['sum']):>12}   of the peak {_gib(b['peak'])}{note}")
    ours = b["parts"].get("heap fragmentation", 0)
    if libtpu_fragmentation is not None and abs(libtpu_fragmentation - ours) > 0.01 * b["peak"]:
        lines.append(f"    libtpu's log counts {_gib(libtpu_fragmentation)} of the heap as fragmentation, where the "
                     f"buffer assignment's live values leave {_gib(ours)} (the two agreed within 3 MiB on a 125M "
                     "step without a While loop, not on the scanned 2B: docs/observability.md)")
    return lines


def _share(part: float, whole: float) -> str:
    """`part` of `whole` as a percentage, or "-" when there is nothing to share."""
    return f"{100 * part / whole:.1f}%" if whole else "-"
