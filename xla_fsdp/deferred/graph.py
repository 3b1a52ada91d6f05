"""The recorded initialization history of a deferred model, and its replay.

[Note: storages, not tensors] Eager construction mutates memory through many aliases: ``weight.data``, ``weight[0]``,
``weight[:, :k]``, the ``Parameter`` wrapping an ``empty`` tensor. Tracking each alias through its view ops is fragile,
so the graph keys everything by *storage*: every op argument is recorded as a ``TensorRef`` (storage id, dtype, size,
stride, offset), which is exactly how an alias addresses memory. At replay a ref becomes a real view with
``Tensor.set_(storage, offset, size, stride)``, so an in-place op on any alias lands in the same bytes it did eagerly.
Pure view ops need no record at all.

[Note: replay order and RNG] Events carry the global sequence number of their op. Materializing a set of tensors replays
the smallest set of events that determines their final bytes (every write to their storages, plus whatever those writes
read, at the version they read it), in sequence order, drawing random numbers from torch's generators at replay time.
Eager construction also draws random numbers for tensors that end up unused (GPT-2's untied ``lm_head.weight`` is
initialized, then replaced by the tied embedding). When one call materializes everything still deferred, those orphan
random ops are replayed too, so the draws happen in eager order and the values equal eager construction bit for bit.
Partial calls skip them: they cannot match eager anyway, and would cost memory the caller is trying to save."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.utils._pytree import tree_flatten, tree_map


class DeferredInitError(RuntimeError):
    """A deferred construction cannot be recorded or replayed."""


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """How an op addressed a tensor: which storage, and the view into it."""

    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclasses.dataclass
class Constant:
    """A real tensor that a deferred op read (e.g. built by ``torch.tensor``).

    Held by reference, not copied: a caller-provided pretrained tensor would otherwise be duplicated.  ``version`` lets
    replay detect that it changed."""

    tensor: torch.Tensor
    version: int
    where: str


@dataclasses.dataclass
class Event:
    seq: int
    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    reads: frozenset[int]
    writes: frozenset[int]
    # (index among the flattened outputs, storage id, meta layout) for each output that owns fresh memory.
    creates: tuple[tuple[int, int, TensorRef, int], ...]
    random: bool

    @property
    def outputs(self) -> set[int]:
        """The storages it writes or creates."""
        return self.writes | {c[1] for c in self.creates}


class InitGraph:
    """Events and storages recorded by one ``deferred_init`` call."""

    def __init__(self, label: str):
        self.label = label
        self.events: list[Event] = []
        self.constants: dict[int, Constant] = {}
        self._next_storage = 0
        self._writers: dict[int, list[Event]] = {}

    # -- recording ---------------------------------------------------------

    def new_storage_id(self) -> int:
        self._next_storage += 1
        return self._next_storage

    def add_constant(self, tensor: torch.Tensor, where: str) -> int:
        sid = self.new_storage_id()
        self.constants[sid] = Constant(tensor, tensor._version, where)
        return sid

    def add_event(self, event: Event) -> None:
        self.events.append(event)
        for sid in event.outputs:
            self._writers.setdefault(sid, []).append(event)

    # -- planning ----------------------------------------------------------

    def plan(self, wanted: set[int], with_orphan_random: bool) -> list[Event]:
        """The events that determine the final bytes of ``wanted`` storages."""
        chosen: dict[int, Event] = {}
        limits: dict[int, float] = {}
        pending: list[int] = []

        def need(sid: int, limit: float) -> None:
            if sid in self.constants or limits.get(sid, -1) >= limit:
                return
            limits[sid] = limit
            pending.append(sid)

        def choose(event: Event) -> None:
            if event.seq in chosen:
                return
            chosen[event.seq] = event
            # Everything the op touches must exist, at the version it had then.
            for sid in event.reads | event.writes:
                need(sid, event.seq)

        def close() -> None:
            while pending:
                sid = pending.pop()
                for event in self._writers.get(sid, ()):
                    if event.seq < limits[sid]:
                        choose(event)

        for sid in wanted:
            need(sid, math.inf)
        close()
        if with_orphan_random and chosen:
            last = max(chosen)
            for event in self.events:
                if event.random and event.seq < last:
                    choose(event)
            close()
        return sorted(chosen.values(), key=lambda e: e.seq)

    def prune(self, still_wanted: set[int]) -> None:
        """Forget every event no still-deferred tensor depends on."""
        keep = self.plan(still_wanted, with_orphan_random=False)
        self.events, self._writers = [], {}
        for event in keep:
            self.add_event(event)
        used = set().union(*(e.reads for e in keep)) if keep else set()
        self.constants = {k: v for k, v in self.constants.items() if k in used}

    # -- replay ------------------------------------------------------------

    def replay(self, refs: list[TensorRef], with_orphan_random: bool) -> list[torch.Tensor]:
        """Real tensors for ``refs`` (views sharing storage where the refs do)."""
        wanted = {ref.storage for ref in refs}
        events = self.plan(wanted, with_orphan_random)
        last_use: dict[int, int] = {}
        for event in events:
            for sid in event.reads | event.outputs:
                last_use[sid] = event.seq

        real: dict[int, torch.UntypedStorage] = {}
        with torch.no_grad():
            for event in events:
                self._run(event, real)
                # Free temporaries (and orphans) as soon as nothing needs them.
                for sid in event.reads | event.outputs:
                    if last_use[sid] == event.seq and sid not in wanted:
                        real.pop(sid, None)
            missing = wanted - real.keys() - self.constants.keys()
            if missing:
                raise DeferredInitError(
                    f"deferred_init({self.label}): the recorded history has no op that created a tensor being "
                    "materialized; it was probably created before deferred_init started recording. Create it "
                    "inside the function passed to deferred_init.")
            return [self._view(real, ref) for ref in refs]

    def _run(self, event: Event, real: dict[int, torch.UntypedStorage]) -> None:
        def resolve(x):
            return self._view(real, x) if isinstance(x, TensorRef) else x

        args = tree_map(resolve, event.args)
        kwargs = tree_map(resolve, event.kwargs)
        try:
            out = event.func(*args, **kwargs)
        except Exception as exc:  # name the op; the original is chained
            raise DeferredInitError(f"deferred_init({self.label}): replaying {event.func} failed: {exc}") from exc
        flat_out, _ = tree_flatten(out)
        for index, sid, layout, nbytes in event.creates:
            if flat_out[index].is_meta:
                # A meta operand makes some CPU kernels silently do nothing.
                raise DeferredInitError(
                    f"deferred_init({self.label}): replaying {event.func} produced a meta tensor (was "
                    "deferred_init called with the meta device as default?). Call it without a meta device context.")
            real[sid] = _own_storage(flat_out[index], layout, nbytes)

    def _view(self, real: dict[int, torch.UntypedStorage], ref: TensorRef) -> torch.Tensor:
        if ref.storage in self.constants:
            const = self.constants[ref.storage]
            if const.tensor._version != const.version:
                raise DeferredInitError(
                    f"deferred_init({self.label}): a real tensor read during construction ({const.where}) was "
                    "modified in place after deferred_init returned, so replay would not reproduce the constructor. "
                    "Leave it unchanged until materialize_module has run, or pass a copy.")
            storage = const.tensor.untyped_storage()
        else:
            storage = real[ref.storage]
        return torch.empty(0, dtype=ref.dtype, device=storage.device).set_(storage, ref.offset, ref.size, ref.stride)


def _own_storage(out: torch.Tensor, layout: TensorRef, nbytes: int) -> torch.UntypedStorage:
    """The storage of a fresh op output, laid out exactly as recorded on meta."""
    storage = out.untyped_storage()
    if (storage.nbytes() == nbytes and out.storage_offset() == layout.offset
            and tuple(out.stride()) == layout.stride and out.dtype == layout.dtype):
        return storage
    # A real kernel chose a different layout than the meta kernel; later refs address the meta layout, so copy into it.
    fresh = torch.empty(nbytes, dtype=torch.uint8, device=out.device).untyped_storage()
    view = torch.empty(0, dtype=layout.dtype, device=out.device)
    view.set_(fresh, layout.offset, layout.size, layout.stride).copy_(out)
    return fresh
