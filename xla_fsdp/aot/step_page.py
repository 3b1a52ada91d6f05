"""`--timeline step.html`: one self-contained page picturing the PROJECTED TPU step.

[Note: the step's picture]
Everything on the page comes from the program libtpu compiled for the slice; nothing is measured:
- a timeline of the projected step (xla_fsdp/tpu/step_time.py's walk of libtpu's schedule): one lane for the
  TensorCore's compute and one per collective kind; each collective is one span, from the core issuing it to the core
  having its result, with its transfer on the ICI drawn inside it, so what runs beside compute and what the core waits
  for are visible. A While loop (scan_layers) appears once per trip. Compute spans closer than a pixel are drawn as one;
- HBM in use over the step: arguments, outputs as they are written, and the heap's live values by libtpu's buffer
  assignment ([Note: the peak HBM, broken down] in xla_fsdp/tpu/memory_breakdown.py), placed at the projected time
  of the instruction that makes or frees them;
- the kernels with the most projected time, each named by the op, the source line torch_xla wrote in its metadata
  and the function (class.method) that line is in: the layer or block that issued it;
- the memory breakdown and the check's report.
No script, no network: SVG and HTML only, readable from disk and in a test.
"""
from __future__ import annotations

import collections
import html
import os
from typing import Dict, List, Optional, Tuple

from xla_fsdp.tpu import hlo_source
from xla_fsdp.tpu import optimized_hlo as oh
from xla_fsdp.tpu import step_time

WIDTH, LEFT, LANE, GAP = 1200, 130, 26, 6
HBM_HEIGHT = 110
COLOURS = {"compute": "#4e79a7", "all-gather": "#59a14f", "reduce-scatter": "#e15759", "all-reduce": "#f28e2b",
           "collective-permute": "#b07aa1", "all-to-all": "#76b7b2"}


def events_of(optimized: str, spec, rests: Dict[str, str]) -> Tuple[List[step_time.Event], float]:
    """The step's events and length, ring permutes on their ring's lane ([Note: which ring a permute belongs to])."""
    events: List[step_time.Event] = []
    est = step_time.estimate(optimized, spec.chip, spec.chips, spec.torus_axes, events=events)
    for e in events:
        if e.lane == "collective-permute" and (ring := hlo_source.ring_kind(rests.get(e.name, ""))):
            e.lane = f"{ring} (ring)"
    return events, est.seconds


def top_kernels(events: List[step_time.Event], rests: Dict[str, str], count: int = 15) -> List[dict]:
    """The compute instructions with the most projected time over the step (a loop's body summed over its trips)."""
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.lane == "compute":
            total[e.name] += e.end - e.start
            calls[e.name] += 1
    return [{"name": name, "seconds": secs, "calls": calls[name], "source": hlo_source.describe(rests.get(name, ""))}
            for name, secs in total.most_common(count)]


def _x(t: float, length: float) -> float:
    return LEFT + (WIDTH - LEFT - 10) * (t / length if length else 0.0)


def _fmt_s(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t < 1 else f"{t:.3f} s"


def _merged_compute(events: List[step_time.Event], length: float) -> List[Tuple[float, float, int]]:
    """Compute spans as (x0, x1, instructions), those less than a pixel apart drawn as one."""
    out: List[List[float]] = []
    for e in sorted((e for e in events if e.lane == "compute"), key=lambda e: e.start):
        x0, x1 = _x(e.start, length), _x(e.end, length)
        if out and x0 - out[-1][1] < 1.0:
            out[-1][1] = max(out[-1][1], x1)
            out[-1][2] += 1
        else:
            out.append([x0, x1, 1])
    return [(a, b, int(n)) for a, b, n in out]


def _hbm_points(curve: List[Tuple[str, int]], events: List[step_time.Event]) -> List[Tuple[float, int]]:
    """The HBM curve (schedule order) at projected times: an instruction's bytes at each time it runs (every trip of
    a loop). Instructions the core spends no time on (bookkeeping, copies started beside compute) join the next one
    that it does, at the most of their bytes."""
    times: Dict[str, List[float]] = {}
    for e in events:
        times.setdefault(e.name, []).append(e.start)
    points: List[Tuple[float, int]] = []
    pending = 0
    for name, used in curve:
        pending = max(pending, used)
        points.extend((t, pending) for t in times.get(name, ()))
        if name in times:
            pending = 0
    points.sort()
    return points


def svg(events: List[step_time.Event], length: float, curve: Optional[List[Tuple[str, int]]] = None,
        hbm_bytes: int = 0) -> str:
    """The timeline (and HBM lane when `curve` is given) as one SVG element."""
    kinds = ["compute"] + sorted({e.lane for e in events if e.lane != "compute"})
    lane_y = {k: 30 + i * (LANE + GAP) for i, k in enumerate(kinds)}
    hbm_top = 30 + len(kinds) * (LANE + GAP) + 16
    height = hbm_top + (HBM_HEIGHT + 40 if curve else 10)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
             f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#fff"/>',
             f'<text x="{LEFT}" y="14">PROJECTED step, {_fmt_s(length)} (libtpu\'s schedule, roofline per '
             'instruction; not measured)</text>']
    for i in range(11):  # time axis
        t = length * i / 10
        x = _x(t, length)
        parts.append(f'<line x1="{x:.1f}" y1="20" x2="{x:.1f}" y2="{hbm_top - 8}" stroke="#ddd"/>'
                     f'<text x="{x:.1f}" y="{hbm_top - 10 + 8}" fill="#777" text-anchor="middle">{_fmt_s(t)}</text>')
    for kind, y in lane_y.items():
        count = sum(1 for e in events if e.lane == kind)
        parts.append(f'<text x="4" y="{y + LANE * 0.65:.1f}">{html.escape(kind)} ({count})</text>')
    colour = COLOURS["compute"]
    y = lane_y["compute"]
    for x0, x1, n in _merged_compute(events, length):
        parts.append(f'<rect class="compute" x="{x0:.2f}" y="{y}" width="{max(x1 - x0, 0.5):.2f}" height="{LANE}" '
                     f'fill="{colour}"><title>{n} instruction(s)</title></rect>')
    for e in events:
        if e.lane == "compute":
            continue
        y, colour = lane_y[e.lane], COLOURS.get(e.lane.split(" ")[0], "#9c755f")
        x0, x1 = _x(e.start, length), _x(e.end, length)
        i0, i1 = _x(e.ici_start, length), _x(e.ici_end, length)
        trip = f", loop trip {e.trip}" if e.trip >= 0 else ""
        tip = (f"{e.name} ({e.lane}, {'asynchronous' if e.asynchronous else 'synchronous'}{trip}): issued at "
               f"{_fmt_s(e.start)}, result at {_fmt_s(e.end)}; on the ICI {_fmt_s(e.ici_end - e.ici_start)}")
        parts.append(f'<g class="collective" data-kind="{html.escape(e.lane)}" data-name="{html.escape(e.name)}">'
                     f'<title>{html.escape(tip)}</title>'
                     f'<rect x="{x0:.2f}" y="{y + 2}" width="{max(x1 - x0, 0.5):.2f}" height="{LANE - 4}" '
                     f'fill="{colour}" fill-opacity="0.25" stroke="{colour}" stroke-width="0.5"/>'
                     f'<rect x="{i0:.2f}" y="{y + 8}" width="{max(i1 - i0, 0.5):.2f}" height="{LANE - 16}" '
                     f'fill="{colour}"/></g>')
    if curve:
        parts += _hbm_lane(_hbm_points(curve, events), length, hbm_top, hbm_bytes)
    parts.append("</svg>")
    return "\n".join(parts)


def _hbm_lane(points: List[Tuple[float, int]], length: float, top_y: float, usable: int) -> List[str]:
    """HBM in use as a filled step curve, scaled to its peak (the usable HBM drawn when within 1.5x of the peak)."""
    peak = max([b for _, b in points] or [0])
    scale = max(peak * 1.1, usable * 1.02 if usable and usable <= 1.5 * peak else 0) or 1
    base = top_y + HBM_HEIGHT
    out = [f'<text x="4" y="{top_y + 12}">HBM in use</text>',
           f'<text x="4" y="{top_y + 26}" fill="#777">at most {peak / 2 ** 30:.2f} GiB</text>']
    if usable and usable <= 1.5 * peak:
        y = base - HBM_HEIGHT * usable / scale
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - 10}" y2="{y:.1f}" stroke="#c00" '
                   f'stroke-dasharray="4 3"/><text x="{WIDTH - 12}" y="{y - 3:.1f}" fill="#c00" '
                   f'text-anchor="end">usable {usable / 2 ** 30:.2f} GiB</text>')
    elif usable:
        out.append(f'<text x="4" y="{top_y + 40}" fill="#777">of {usable / 2 ** 30:.2f} usable</text>')
    if points:
        path, last = [f"M{_x(points[0][0], length):.1f},{base:.1f}"], base
        for t, used in points:
            x, y = _x(t, length), base - HBM_HEIGHT * used / scale
            path.append(f"L{x:.1f},{last:.1f} L{x:.1f},{y:.1f}")
            last = y
        path.append(f"L{_x(length, length):.1f},{last:.1f} L{_x(length, length):.1f},{base:.1f} Z")
        out.append(f'<path class="hbm" d="{" ".join(path)}" fill="#bbb" fill-opacity="0.5" stroke="#333" '
                   'stroke-width="1"/>')
    out.append(f'<line x1="{LEFT}" y1="{base}" x2="{WIDTH - 10}" y2="{base}" stroke="#999"/>')
    return out


def _table(rows: List[List[str]], head: List[str]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def page(result: dict, report_text: str, events: List[step_time.Event], length: float,
         rests: Dict[str, str]) -> str:
    """The whole page as HTML text."""
    memory = result.get("memory", {})
    breakdown = memory.get("breakdown")
    kernel_rows = [[k["name"], k["source"] or "-", str(k["calls"]), _fmt_s(k["seconds"]),
                    f"{100 * k['seconds'] / length:.1f}%" if length else "-"] for k in top_kernels(events, rests)]
    sections = [f"<h1>{html.escape(result.get('script', 'job'))} on {html.escape(result['tpu'])}: the PROJECTED "
                "step</h1>",
                "<p>From the program libtpu compiled for this slice (deviceless, on this host). Times are "
                "projections (xla_fsdp/tpu/step_time.py), not measurements. Hover a span for its name.</p>",
                svg(events, length, result.get("hbm_curve"), memory.get("usable", 0))]
    if breakdown:
        rows = [[name, f"{size / 2 ** 30:.3f} GiB", f"{100 * size / breakdown['peak']:.1f}%"]
                for name, size in breakdown["parts"].items() if size]
        rows.append(["sum", f"{breakdown['sum'] / 2 ** 30:.3f} GiB", f"of {breakdown['peak'] / 2 ** 30:.3f} GiB peak"])
        sections += ["<h2>Peak HBM per chip, broken down</h2>", _table(rows, ["part", "size", "share of peak"])]
    sections += ["<h2>Kernels by projected time</h2>",
                 _table(kernel_rows, ["instruction", "op and source (function)", "runs", "projected", "share"]),
                 "<h2>The check's report</h2>", f"<pre>{html.escape(report_text)}</pre>"]
    style = ("body{font-family:sans-serif;margin:16px;color:#222}table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}pre{font-size:11px;background:#f7f7f7;"
             "padding:8px}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>xla_fsdp.aot step</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(sections) + "\n</body></html>\n")


def write(path: str, result: dict, report_text: str, optimized: str, spec) -> int:
    """Write the page for `result` to `path` (.svg: the timeline and HBM lanes alone); the collective spans on it."""
    rests = {ins.name: ins.rest for body in oh.computations(optimized).values() for ins in body}
    events, length = events_of(optimized, spec, rests)
    text = svg(events, length, result.get("hbm_curve"), result.get("memory", {}).get("usable", 0)) + "\n" \
        if path.endswith(".svg") else page(result, report_text, events, length, rests)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return sum(1 for e in events if e.lane != "compute")
