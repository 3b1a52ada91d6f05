"""Capturing one training step's program in the traced process (never executed).

[Note: two traced steps] A job's first step is not the program it runs for days: optimizer state is created inside it,
and its inputs differ. So the trace lets the job's own loop run two steps, and the graph cut (`torch_xla.sync()` /
`xm.mark_step()`) is intercepted. Only cuts that end a training step count (an optimizer stepped since the previous
cut); a loop's earlier cuts (set-up graphs) are skipped, so their pending work joins the first step's graph.
- at the first cut nothing runs: every live XLA tensor becomes a placeholder of its shape, dtype and sharding
  ([Note: abstract tracing]), as if the step had run and left its results on the devices; torch_xla's collective
  token and RNG seed start afresh, as after a real step;
- at the second cut torch_xla's own graph cut runs (so buffer donation is decided as in a real step) and XLA,
  whose dump the parent switched on, writes the module torch_xla hands it. The process ends as soon as that file
  is whole; if XLA:CPU runs the step on the placeholders first, the process crashes instead, and the module is
  taken from the dump all the same ([Note: the module is taken from the dump, whoever gets there first] in dump.py).
After the first cut `Tensor.item()` / `tolist()` of an XLA tensor returns zeros of its dtype and shape ([Note:
values read after the first step]). Optimizer state that the first step created without a sharding of its own
takes its parameter's when it has the parameter's shape, as the SPMD partitioner gives it in a real run.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch

from xla_fsdp.aot.dump import MARKER, RECOMPUTE, TENSORS, take_program
from xla_fsdp.runtime import environment


class _State:
    cuts = 0
    steps = 2
    out = ""
    original_sync = None
    stepped = False  # an optimizer stepped since the last cut


def _spec() -> dict:
    return environment.aot()  # the check's settings (xla_fsdp/aot/trace.py lists them)


def install() -> None:
    """Route torch_xla's graph cuts through `cut`, note optimizer steps and the job's own `xm` collective calls."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    spec = _spec()
    _State.out, _State.steps = spec["out"], int(spec.get("steps", 2))
    _State.original_sync = torch_xla.sync
    torch_xla.sync = xm.mark_step = lambda *args, **kwargs: cut()
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_note_step)  # every optimizer's step, whoever built it
    _read_as_zeros_after_first_step()
    for name in ("all_reduce", "reduce_scatter", "all_gather"):
        setattr(xm, name, _recorded(getattr(xm, name), name.replace("_", "-")))


def _read_as_zeros_after_first_step() -> None:
    """[Note: values read after the first step] Under the check no step runs, and after the first cut every tensor
    the loop kept is a placeholder with no buffer: reading one aborts the process (a check failure in torch_xla, no
    Python error). Scripts read values there for logging (`losses.append(loss.item())`, a grad norm printed), never
    to decide the second step's program, so from the first cut on the reads give zeros. Before it a read still runs
    (a set-up graph on real data reads true values; one on placeholders aborts, as docs/aot.md says)."""
    def zeros_after_first_cut(original):
        def read(self):
            if _State.cuts and self.device.type == "xla":
                return original(torch.zeros(self.shape, dtype=self.dtype))
            return original(self)
        return read

    torch.Tensor.item = zeros_after_first_cut(torch.Tensor.item)
    torch.Tensor.tolist = zeros_after_first_cut(torch.Tensor.tolist)


SITES = "collective_sites.json"
_sites: list = []


def _recorded(fn, kind: str):
    """`xm.<collective>` also noting its caller and pin_layout (torch_xla's op metadata names only its own line)."""
    import functools
    import inspect
    import traceback

    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        pin = bound.arguments.get("pin_layout", signature.parameters["pin_layout"].default)
        frame = traceback.extract_stack(limit=2)[0]
        _sites.append({"kind": kind, "pinned": bool(pin), "where": f"{frame.filename}:{frame.lineno}",
                       "call": f"xm.{fn.__name__}(..., pin_layout={bool(pin)})"})
        return fn(*args, **kwargs)

    return wrapper


def _objects_of(*classes) -> list:
    """Every live object of each of `classes`, one list per class, from one walk of the heap (about half a second
    in a traced 2B job). isinstance() on torch.distributed's deprecated `reduce_op` warns, silenced here."""
    import warnings

    found = [[] for _ in classes]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.*", category=FutureWarning)
        for o in gc.get_objects():
            for i, cls in enumerate(classes):
                if isinstance(o, cls):
                    found[i].append(o)
    return found


def _is_xla_data(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is backed by XLA data (not one of the fake and functional ones AOTAutograd keeps under
    scan_layers)."""
    import torch_xla

    try:
        torch_xla._XLAC._get_xla_sharding_spec(tensor)
    except RuntimeError:  # "Expected XLA tensor"
        return False
    return True


def _note_step(optimizer, args, kwargs) -> None:
    _State.stepped = True


def cut(force: bool = False) -> None:
    """A graph cut under the check. A cut that ends a training step (an optimizer stepped since the previous cut, or
    `force`): the first `steps - 1` are as if run, the last is compiled. Any other cut (a loop's set-up) is skipped:
    its pending work joins the step's graph, since running it could touch placeholders or wait for ranks that never
    trace."""
    if not (force or _State.stepped):
        return
    _State.stepped = False
    _State.cuts += 1
    if _State.cuts < _State.steps:
        _as_if_run()
        from xla_fsdp.memory.remat_policy import forget_applied

        forget_applied()  # the report names what the compiled step's blocks got
        return
    _compile_and_exit()


def _tensors_by_kind() -> list:
    """The step's inputs the job holds, by kind, for the memory breakdown ([Note: the peak HBM, broken down]): each
    optimizer's parameters, their state and the gradients kept between steps, as {"kind", "dtype", "shape"} (the
    stored shape, as the program's arguments have it)."""
    optimizers, = _objects_of(torch.optim.Optimizer)
    out, seen = [], set()

    def add(kind: str, t) -> None:
        if isinstance(t, torch.Tensor) and t.device.type == "xla" and id(t) not in seen and _is_xla_data(t):
            seen.add(id(t))
            out.append({"kind": kind, "dtype": str(t.dtype).replace("torch.", ""),
                        "shape": list(torch.Tensor.size(t))})

    for p, state in _params_and_state(optimizers):
        add("parameters", p)
        add("gradients", p.grad)
        for value in state:
            add("optimizer state", value)
    return out


def _params_and_state(optimizers):
    """(parameter, the values of its optimizer state) of every parameter of `optimizers`."""
    return ((p, obj.state.get(p, {}).values()) for obj in optimizers for group in obj.param_groups
            for p in group["params"])


def _optimizer_shardings(optimizers):
    """id(state tensor) -> its parameter's sharding, for state shaped like its parameter."""
    import torch_xla

    out = {}
    for p, state in _params_and_state(optimizers):
        if p.device.type != "xla" or not torch_xla._XLAC._get_xla_sharding_spec(p):
            continue
        op = torch_xla._XLAC._get_xla_op_sharding(p)
        for value in state:
            if isinstance(value, torch.Tensor) and value.shape == torch.Tensor.size(p):  # stored shape
                out[id(value)] = op
    return out


def _as_if_run() -> None:
    """The first cut: results become placeholders; token and seed start afresh."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    from xla_fsdp import abstract

    optimizers, tensors = _objects_of(torch.optim.Optimizer, torch.Tensor)
    inherited = _optimizer_shardings(optimizers)
    devices = set()
    for t in [t for t in tensors if t.device.type == "xla" and _is_xla_data(t)]:
        if t.is_leaf or isinstance(t, torch.nn.Parameter) or t._base is None:
            own = torch_xla._XLAC._get_xla_op_sharding(t) if torch_xla._XLAC._get_xla_sharding_spec(t) else None
            op = own if own is not None else inherited.get(id(t))
            with torch.no_grad():
                t.data = abstract.placeholder(torch.Tensor.size(t), t.dtype, op)  # stored shape
            devices.add(str(t.device))
    for device in devices or {str(torch_xla.device())}:
        torch_xla._XLAC._set_all_reduce_token(device, None)
        xm.set_rng_state(xm.get_rng_state(device) + 1, device=device)


def _compile_and_exit() -> None:
    """The second cut: torch_xla compiles the step, XLA dumps its module; the process leaves once the dump is whole."""
    import threading

    import torch_xla.runtime as xr

    dump = _spec()["dump"]
    before = set(os.listdir(dump)) if os.path.isdir(dump) else set()
    from xla_fsdp.memory.remat_policy import applied

    written = {MARKER: {"ordinal": xr.global_ordinal(), "dumped_before": sorted(before)}, SITES: _sites,
               TENSORS: _tensors_by_kind(), RECOMPUTE: applied()}  # [Note: recomputation policies]
    for name, value in written.items():
        with open(os.path.join(_State.out, name), "w") as f:
            json.dump(value, f)
    sys.stdout.flush()
    sys.stderr.flush()
    threading.Thread(target=_State.original_sync, daemon=True).start()
    deadline, poll = time.time() + 3600, float(_spec().get("poll_s", 0.05))
    while time.time() < deadline:
        time.sleep(poll)
        if take_program(_State.out, dump):
            os._exit(0)
    os._exit(4)
