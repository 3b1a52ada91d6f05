"""The traced module, made ready for libtpu's compiler, and what can be told before compiling.

The module is the text XLA dumped as `before_optimizations` in the traced process: exactly what torch_xla hands to
XLA, buffer donation included. One difference from a real run is repaired here: a placeholder has no data, so
torch_xla lowers its sharding as a `Sharding` custom call after the parameter instead of on the parameter, where
real sharded data puts it. Left alone, the partitioner would take such a parameter as replicated and every chip
would be charged the whole tensor as an argument.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from xla_fsdp.tpu import hlo_source

_PARAM = re.compile(r"^(\s*(?:ROOT )?%?([\w.\-]+) = [^=]*? parameter\((\d+)\))(.*)$")
_SHARDING_CALL = re.compile(r"custom-call\([^%]*%([\w.\-]+)\), custom_call_target=\"Sharding\", sharding=(\{[^}]*\})")
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)"
    r"(?:-start)?\((.*)$")


def entry_lines(text: str) -> range:
    """Line numbers of the entry computation's body."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY "))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("}"))
    return range(start + 1, end)


def place_parameter_shardings(text: str) -> str:
    """Give every entry parameter of an SPMD module its `Sharding` custom call's sharding, else replicated."""
    lines = text.splitlines()
    body = entry_lines(text)
    wanted: Dict[str, str] = {}
    for m in filter(None, (_SHARDING_CALL.search(lines[i]) for i in body)):
        wanted.setdefault(m.group(1), m.group(2))
    for i in body:
        m = _PARAM.match(lines[i])
        if not m or "sharding=" in m.group(4):
            continue
        sharding = wanted.get(m.group(2), "{replicated}")
        lines[i] = f"{m.group(1)}, sharding={sharding}{m.group(4)}"
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class CollectiveSite:
    """One collective of the traced module and the Python code that issued it (when known)."""

    name: str
    kind: str
    pinned: bool
    source: str

    def describe(self) -> str:
        return f"{self.kind} {self.name} ({'pinned' if self.pinned else 'unpinned'}){' from ' + self.source if self.source else ''}"


def _source(line: str) -> str:
    """"op, file:line" from an instruction's metadata ("" without any)."""
    where = hlo_source.source(line)
    op = hlo_source.op_name(line) or hlo_source.op_type(line)
    return ", ".join(x for x in (op, where and f"{where[0]}:{where[1]}") if x)


def collective_sites(text: str) -> List[CollectiveSite]:
    """Every collective in the traced module, in program order."""
    return [CollectiveSite(m.group(1), m.group(3), "constrain_layout=true" in m.group(4), _source(line))
            for line in text.splitlines() if (m := _COLLECTIVE.match(line))]


def layout_mix(text: str, calls: Sequence[dict] = ()) -> Optional[str]:
    """The TPU compiler refuses a module whose all-reduces (reduce-scatters count: it turns them into all-reduces)
    are partly layout-pinned and partly not. Said before compiling, naming one collective of each side and the fix;
    None when the module is consistent. `calls`: the job's own `xm.all_reduce`-style calls the trace recorded (kind,
    pinned, where), which name the caller's line where the op metadata names torch_xla's."""
    sites = [s for s in collective_sites(text) if s.kind in ("all-reduce", "reduce-scatter")]
    pinned = [s for s in sites if s.pinned]
    free = [s for s in sites if not s.pinned]
    if not pinned or not free:
        return None

    def side(group: List[CollectiveSite], pin: bool) -> str:
        user = [c for c in calls if c["pinned"] == pin and c["kind"] in ("all-reduce", "reduce-scatter")]
        if user:
            return f"{user[0]['call']} at {user[0]['where']} ({group[0].describe()})"
        return group[0].describe()

    return (f"the step mixes {len(pinned)} layout-pinned and {len(free)} unpinned all-reduce/reduce-scatter "
            f"collectives, which libtpu refuses to compile. Pinned: {side(pinned, True)}. Unpinned: "
            f"{side(free, False)}. Fix: issue every collective of the step with the same pin_layout, e.g. "
            "pass pin_layout=True to your xm.all_reduce / xm.reduce_scatter calls (torch_xla's default), or "
            "give xla_fsdp pin_layout_in_collective_ops=False so that it pins none of its own "
            "(one process per chip; the single-controller runtime never pins).")


RING_SOURCE = hlo_source.RING_FILE + '"'  # op metadata of the engine's rings (XLA_HLO_DEBUG=1)


def ring_ops(text: str) -> int:
    """Ops of the traced module the engine's rings made ([Note: ring reduce-scatter]), told by their metadata's file."""
    return text.count(RING_SOURCE)
