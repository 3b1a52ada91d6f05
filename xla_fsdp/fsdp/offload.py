"""`CPUOffloadPolicy`: parameters, gradients and optimizer state in host memory.

[Note: CPU offload on the single controller] As FSDP2 does on GPUs, the parameter the optimizer holds is a host
tensor (here the whole padded global parameter of this host, `ShardedParameter` on the CPU). Each step:
- the root's forward first places every offloaded parameter on the chips, sharded on dim 0 (a fresh leaf tensor, which
  the unit gathers from), so each chip receives only its rows;
- at the end of backward the step's program runs, the gradients come back to the host parameters' `.grad` (added to
  any gradient already there), and the host parameters are registered again;
- the optimizer steps on the host, so its state lives there too.
A forward without autograd (evaluation) registers the host parameters again right after it. Per step this moves every
offloaded parameter to the chips and its gradient back: 2 x 4 bytes per float32 parameter element (padding rows
included), the cost `docs/fsdp2.md` states. The chips hold the parameters only while the step runs, and no optimizer
state."""
from __future__ import annotations

import weakref
from typing import Dict, List

import torch

from .. import abstract
from ..unit_state import state_of, units


class HostOffload:
    """The offloaded units under one module (the root, once it runs) and their host parameters."""

    def __init__(self):
        self._hosts: Dict[int, torch.Tensor] = {}  # id(record) -> host parameter, while the step runs
        self._pending = False
        self._traced_grads: List[torch.Tensor] = []

    @staticmethod
    def attach(unit) -> "HostOffload":
        """Offload `unit`'s parameters: to the host now (a meta one gets host storage at to_empty)."""
        offload = HostOffload()
        for rec in state_of(unit).group.params:
            if not rec.sharded.is_meta:
                to_host(rec, unit)
        return offload

    @staticmethod
    def keep_on_host(rec, unit) -> None:
        """A parameter a load just placed on the chips, back on the host (see `to_host`)."""
        to_host(rec, unit)

    # -- per step ------------------------------------------------------------
    @staticmethod
    def _records(root) -> List[tuple]:
        seen, out = set(), []
        for unit in units(root):  # a unit of several modules once
            state = state_of(unit)
            if state.offload is not None and id(state) not in seen:
                seen.add(id(state))
                out += [(unit, rec) for rec in state.group.params]
        return out

    def to_device(self, root) -> None:
        """Before the root's forward: every offloaded parameter onto the chips, as a fresh leaf."""
        if self._pending:
            raise RuntimeError("CPUOffloadPolicy: a forward ran before the previous backward finished; call "
                               "backward on the previous step's loss first (or run evaluation under torch.no_grad())")
        self._traced_grads = []
        for unit, rec in self._records(root):
            host = rec.sharded
            if host.device.type not in ("cpu", "meta"):  # meta: traced for the check, a placeholder below
                continue
            comm = state_of(unit).group.comm
            dev = rec.param_cls(comm.place_global(host.detach()), requires_grad=rec.requires_grad)
            dev.bind(rec, state_of(unit).device_mesh)
            self._hosts[id(rec)] = host
            rec.sharded = dev
            rec.register(dev)

    def after_forward(self, root, out) -> None:
        """Without autograd, the host parameters come back now; with it, at the end of backward."""
        if not torch.is_grad_enabled():
            self.to_host(root, grads=False)
            return
        from torch.utils._pytree import tree_flatten

        leaves, _ = tree_flatten(out)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            self.to_host(root, grads=False)
            return
        self._pending = True
        ref = weakref.ref(root)
        queued = [False]

        def queue(grad):
            if not queued[0]:
                queued[0] = True
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self.to_host(ref(), grads=True) if ref() is not None else None)
            return grad

        for t in tensors:
            t.register_hook(queue)

    def to_host(self, root, grads: bool) -> None:
        """The step's gradients onto the host parameters (added), which are registered again."""
        self._pending = False
        records = [(unit, rec) for unit, rec in self._records(root) if id(rec) in self._hosts]
        if abstract.active():
            # [Note: abstract tracing] nothing can be read: the gradients stay outputs of the traced step (held until
            # the next step), as a real run's transfers to the host make them
            self._traced_grads = [rec.sharded.grad for _, rec in records if rec.sharded.grad is not None]
            for _, rec in records:
                rec.sharded = self._hosts.pop(id(rec))
                rec.register(rec.sharded)
            return
        if grads and any(rec.sharded.grad is not None for _, rec in records):
            import torch_xla

            torch_xla.sync()  # run the step once; each gradient below is then a transfer only
        for unit, rec in records:
            host = self._hosts.pop(id(rec))
            dev = rec.sharded
            if grads and dev.grad is not None:
                g = dev.grad.detach().cpu()
                host.grad = g if host.grad is None else host.grad + g
            rec.sharded = host
            rec.register(host)


def to_host(rec, unit) -> None:
    """`rec`'s parameter as a host tensor (the whole padded global parameter), registered."""
    data = rec.sharded.detach()
    if abstract.active():  # [Note: abstract tracing]: a placeholder cannot be read; the host copy is a shape
        data = torch.empty(data.shape, dtype=data.dtype, device="meta")
    host = rec.param_cls(data.cpu() if data.device.type not in ("cpu", "meta") else data,
                         requires_grad=rec.requires_grad)
    host.bind(rec, state_of(unit).device_mesh)
    rec.sharded = host
    rec.register(host)
