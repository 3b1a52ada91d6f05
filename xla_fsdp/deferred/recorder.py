"""Runs a constructor on the meta device while recording every op.

A ``TorchDispatchMode`` sees each aten op below autograd.  Factory ops (``empty``, ``randn``, ``arange`` ...) are
redirected to ``device="meta"``, so no memory is allocated, and every op that creates or writes memory reachable from a
meta tensor is appended to an ``InitGraph`` (see the notes there). Ops whose tensor inputs are all real run for real:
their data is already in memory and nothing needs deferring."""

from __future__ import annotations

import os
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .graph import DeferredInitError, Event, InitGraph, TensorRef

aten = torch.ops.aten

# Ops that hand tensor *values* back to Python.  A deferred tensor has no values yet, so a constructor that branches on
# them cannot be recorded.
_DATA_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default,}

# Metadata-only ops: they change which storage a tensor uses, never bytes.
_METADATA_ONLY = {aten.set_.source_Tensor, aten.set_.source_Storage,
                  aten.set_.source_Storage_storage_offset, aten.set_.default}

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def caller_location() -> str:
    """'Class.__init__ at file:line' of the innermost frame outside torch and us."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_TORCH_DIR) or path.startswith(_PACKAGE_DIR) or path.startswith("<")):
            owner = frame.f_locals.get("self")
            name = frame.f_code.co_name
            if isinstance(owner, torch.nn.Module):
                name = f"{type(owner).__name__}.{name}"
            return f"{name} at {frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "".join(traceback.format_stack(limit=3)).strip()


class RecordingMode(TorchDispatchMode):
    """Records ops into ``graph``; see the module docstring."""

    def __init__(self, graph: InitGraph):
        super().__init__()
        self.graph = graph
        self._seq = 0
        # storage address -> storage id.  The storage objects are held so that an address cannot be reused by a later
        # allocation while recording.
        self._storage_ids: dict[int, int] = {}
        self._held: list[torch.UntypedStorage] = []
        self._constants: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}

    # -- identity ----------------------------------------------------------

    def storage_id(self, tensor: torch.Tensor) -> int | None:
        return self._storage_ids.get(tensor.untyped_storage()._cdata)

    def _claim(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        sid = self.graph.new_storage_id()
        self._storage_ids[storage._cdata] = sid
        self._held.append(storage)
        return sid

    def ref(self, tensor: torch.Tensor, sid: int) -> TensorRef:
        return TensorRef(sid, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def _constant_ref(self, tensor: torch.Tensor) -> TensorRef:
        key = (id(tensor), tensor._version)
        if key not in self._constants:
            sid = self.graph.add_constant(tensor, caller_location())
            self._constants[key] = (tensor, sid)  # holding it pins id()
        return self.ref(tensor, self._constants[key][1])

    def release(self) -> None:
        """Drop recording-time bookkeeping once construction has finished."""
        self._held.clear()
        self._constants.clear()

    # -- dispatch ----------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat_in, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat_in if isinstance(t, torch.Tensor)]
        if any(isinstance(x, torch.UntypedStorage) for x in flat_in) and func not in _METADATA_ONLY:
            raise DeferredInitError(f"deferred_init: {func} takes a storage argument, which cannot be recorded "
                                    f"({caller_location()}). Build this tensor eagerly instead.")
        if not tensors:
            return self._factory(func, args, kwargs)
        if not any(t.is_meta for t in tensors):
            return func(*args, **kwargs)  # all-real inputs: nothing to defer
        if func in _DATA_READS:
            raise DeferredInitError(
                f"deferred_init: the constructor read a tensor's value back into Python ({func}; from .item(), "
                f".tolist(), bool(tensor), torch.equal or data-dependent control flow) in {caller_location()}. "
                "Deferred tensors have no values until materialize_module() runs, so this construction cannot be "
                "recorded. Compute that value from Python numbers, or build this module eagerly.")
        if func in _METADATA_ONLY:
            return func(*args, **kwargs)
        return self._record(func, args, kwargs)

    def _factory(self, func, args, kwargs):
        schema_args = {a.name for a in func._schema.arguments}
        if "device" not in schema_args:
            return func(*args, **kwargs)  # nothing we can redirect; stays real
        recorded = _replay_devices(dict(kwargs))
        if recorded.get("device") is None:
            recorded["device"] = torch.get_default_device()
        meta_kwargs = dict(recorded, device=torch.device("meta"))
        out = self._run_meta(func, args, meta_kwargs)
        # Pin what the kernel resolved from global defaults at construction time (default dtype: Hugging Face sets it
        # for `torch_dtype`).
        if "dtype" in schema_args and recorded.get("dtype") is None and isinstance(out, torch.Tensor):
            recorded["dtype"] = out.dtype
        self._append(func, args, recorded, out, writes=frozenset(), reads=frozenset())
        return out

    def _record(self, func, args, kwargs):
        reads: set[int] = set()
        real_inputs = False

        def to_ref(x):
            nonlocal real_inputs
            if not isinstance(x, torch.Tensor):
                return x
            if x.is_meta:
                sid = self.storage_id(x)
                if sid is None:
                    raise DeferredInitError(
                        f"deferred_init: {func} used a meta tensor that was not created inside deferred_init "
                        f"({caller_location()}); its values are unknown, so it cannot be replayed. Create it inside "
                        "the function passed to deferred_init.")
            else:
                real_inputs = True
                ref = self._constant_ref(x)
                reads.add(ref.storage)
                return ref
            reads.add(sid)
            return self.ref(x, sid)

        ref_args = _replay_devices(tree_map(to_ref, args))
        ref_kwargs = _replay_devices(tree_map(to_ref, kwargs))
        writes = self._written_storages(func, args, kwargs)
        if real_inputs:
            args, kwargs = tree_map(_to_meta, (args, kwargs))
        out = self._run_meta(func, args, kwargs)
        self._append(func, ref_args, ref_kwargs, out, frozenset(writes), frozenset(reads))
        return out

    def _written_storages(self, func, args, kwargs) -> set[int]:
        writes = set()
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in tree_flatten(value)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                sid = self.storage_id(t) if t.is_meta else None
                if sid is None:
                    raise DeferredInitError(
                        f"deferred_init: {func} writes deferred values into a real tensor ({caller_location()}); "
                        "that cannot be deferred. Create the destination inside deferred_init, or copy after "
                        "materialize_module().")
                writes.add(sid)
        return writes

    def _run_meta(self, func, args, kwargs):
        try:
            return func(*args, **kwargs)
        except DeferredInitError:
            raise
        except Exception as exc:
            raise DeferredInitError(
                f"deferred_init: {func} cannot run on the meta device ({exc}) in {caller_location()}. Ops with "
                "data-dependent output shapes (nonzero, unique, masked_select) cannot be deferred; build this "
                "tensor from Python values or construct the module eagerly.") from exc

    def _append(self, func, args, kwargs, out, writes, reads):
        flat_out, _ = tree_flatten(out)
        creates = []
        for index, t in enumerate(flat_out):
            if isinstance(t, torch.Tensor) and t.is_meta and self.storage_id(t) is None:
                sid = self._claim(t)
                creates.append((index, sid, self.ref(t, sid), t.untyped_storage().nbytes()))
        if not creates and not writes:
            return  # a view or a read: addressed by refs, needs no replay
        self._seq += 1
        self.graph.add_event(Event(seq=self._seq, func=func, args=args, kwargs=kwargs, reads=reads, writes=writes,
                                   creates=tuple(creates), random=torch.Tag.nondeterministic_seeded in func.tags))


def _replay_devices(tree):
    """Map ``device="meta"`` in recorded arguments to the default device.

    Deferred tensors are meta while recording, so constructor code that follows them (``torch.arange(n,
    device=self.weight.device)``, the value tensor of ``weight[idx] = 0``) names the meta device; at replay those
    tensors live on the real device, and so must whatever follows them."""
    return tree_map(lambda x: torch.get_default_device() if isinstance(x, torch.device) and x.type == "meta" else x,
                    tree)


def _to_meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) and not x.is_meta else x
