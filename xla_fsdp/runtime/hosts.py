"""The hosts of a slice as the SPMD runtimes see them: how many, which one this process is, which devices it addresses,
and the group the hosts agree through (for files and data, never for tensors of the training step).

Under the SPMD runtimes (the single controller, the GSPMD engine) one process per host drives every chip of its host,
and all hosts run one program. On a pod `torch_xla.runtime.process_count()` is the host count; each process addresses
only its own chips (`_xla_get_runtime_devices()`).

[Note: the hosts' group] What hosts must agree on is host-side: "my files are written", "did anyone fail", a few small
records (rows sent for an export, a virtual host's pieces). That is a gloo process group over the hosts, started with
torch_xla's `xla://` rendezvous, which under SPMD numbers the members by process index and finds the master host from
the TPU metadata, so a pod needs no extra configuration (torch_xla's own SPMD checkpointing uses the same group). XLA
collectives are the wrong tool: they run inside the compiled program on device tensors, would cost a compile and a
device round trip, and could not run at all once a host's write failed. A host that stops answering is waited for at
most the host timeout (`environment.HOST_TIMEOUT`) and named ([Note: a host that does not answer] in host_watch.py).

[Note: virtual hosts] torch_xla 2.9 cannot run one SPMD program across processes on XLA:CPU (no cross-process
collectives; process_count() is 1). To prove the per-host code on one machine, `environment.VIRTUAL_HOSTS`=N and
`environment.VIRTUAL_HOST_INDEX`=i make N processes act as N hosts of one slice: each runs the same SPMD program on all
of its (virtual CPU) devices, but the checkpoint and data layers treat only block i of the devices (global order, N
equal blocks) as this host's, and the hosts form their gloo group over MASTER_ADDR/MASTER_PORT (default 127.0.0.1:29531)
as pod hosts do over `xla://`. Only `HostView.devices` and the group's address differ from the production path. Where a
virtual host must hand torch_xla data of devices that are not its own (torch_xla takes a shard for every device the
process addresses), it gets them from the other hosts (`HostGroup.exchange`); on a pod that call is never made."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from xla_fsdp.runtime import environment

ENV_HOSTS = environment.VIRTUAL_HOSTS
ENV_INDEX = environment.VIRTUAL_HOST_INDEX
DEFAULT_PORT = 29531


@dataclass(frozen=True)
class HostView:
    """This process's place among the hosts of the slice."""

    count: int  # hosts in the slice
    index: int  # this host, 0..count-1
    devices: Tuple[str, ...]  # this host's devices as torch_xla names them ("TPU:4"), in global order
    all_devices: Tuple[str, ...]  # every device the process drives (virtual: all blocks; pod: = devices)
    virtual: bool

    def owns(self, device: str) -> bool:
        return device in self.devices

    @property
    def is_single(self) -> bool:
        return self.count == 1


def device_ordinal(device: str) -> int:
    """"TPU:5" -> 5: torch_xla's device names carry the global device id."""
    return int(device.rsplit(":", 1)[1])


def virtual_hosts_requested() -> bool:
    return bool(environment.get(ENV_HOSTS))


def host_view() -> HostView:
    """The hosts as this process sees them (virtual hosts when ENV_HOSTS is set)."""
    import torch_xla
    import torch_xla.runtime as xr

    local = tuple(sorted(torch_xla._XLAC._xla_get_runtime_devices(), key=device_ordinal))
    if not virtual_hosts_requested():
        return HostView(xr.process_count(), xr.process_index(), local, local, False)
    count, index = _virtual_env()
    if xr.process_count() != 1:
        raise RuntimeError(f"{ENV_HOSTS}={count} is a test mode for one machine; this process is one of "
                           f"{xr.process_count()} real hosts. Unset {ENV_HOSTS} on a pod.")
    if not xr.is_spmd():
        raise RuntimeError(f"{ENV_HOSTS}={count} needs the SPMD runtime (xr.use_spmd()): virtual hosts split "
                           "the devices one SPMD program drives")
    if len(local) % count:
        raise ValueError(f"{ENV_HOSTS}={count} does not divide the {len(local)} devices of this process; "
                         f"set CPU_NUM_DEVICES to a multiple of {count}")
    per_host = len(local) // count
    return HostView(count, index, local[index * per_host:(index + 1) * per_host], local, True)


def _virtual_env() -> Tuple[int, int]:
    try:
        count = int(environment.get(ENV_HOSTS))
        index = int(environment.get(ENV_INDEX))
    except ValueError:
        raise ValueError(f"{ENV_HOSTS}={environment.get(ENV_HOSTS)!r} and {ENV_INDEX}="
                         f"{environment.get(ENV_INDEX)!r}: both must be integers (N hosts, this one's index "
                         "0..N-1)") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"{ENV_HOSTS}={count}, {ENV_INDEX}={index}: need N >= 1 and 0 <= index < N")
    return count, index


def virtual_group_address() -> str:
    """Virtual hosts: where their gloo group meets (MASTER_ADDR/MASTER_PORT, default 127.0.0.1:29531), as
    `tcp://addr:port` ([Note: virtual hosts])."""
    addr = environment.get(environment.MASTER_ADDR) or "127.0.0.1"
    port = int(environment.get(environment.MASTER_PORT) or DEFAULT_PORT)
    return f"tcp://{addr}:{port}"


class HostGroup:
    """The hosts agreeing on host-side facts (files written, batches read): a gloo group, one member per host. One host:
    every call is local. Every agreement waits for a host that stopped answering at most the host timeout
    (`environment.HOST_TIMEOUT`), then raises `HostLostError` naming it ([Note: a host that does not answer] in
    host_watch.py)."""

    def __init__(self, view: HostView, dist=None, watch=None):
        self.view, self.rank, self.world = view, view.index, view.count
        self._dist, self._watch = dist, watch

    def _agree(self, run):
        """`run()` (a gloo collective) once every host is there ([Note: a host that does not answer])."""
        if self._watch is None:
            return run()
        self._watch.meet()
        try:
            return run()
        except RuntimeError as e:  # a host died during the exchange: name it if its heartbeat stopped
            silent = self._watch.silent_hosts()
            if not silent:
                raise
            raise self._watch.lost(silent, f"stopped answering during an exchange of the hosts ({e})") from e

    def barrier(self) -> None:
        if self._dist is not None:
            # gloo's barrier after the meeting: host 0, which serves the store, must not go on (and perhaps exit) before
            # every host has seen the meeting complete
            self._agree(self._dist.barrier)

    def all_ok(self, ok: bool) -> bool:
        if self._dist is None:
            return ok
        import torch

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        self._agree(lambda: self._dist.all_reduce(flag, op=self._dist.ReduceOp.MIN))
        return bool(flag.item())

    def all_gather(self, value: Any) -> List[Any]:
        """`value` of every host, in host order (picklable values)."""
        if self._dist is None:
            return [value]
        out: List[Any] = [None] * self.world
        self._agree(lambda: self._dist.all_gather_object(out, value))
        return out

    def gather(self, value: Any, dst: int = 0) -> Optional[List[Any]]:
        """`value` of every host, in host order, on host `dst` (None on the others)."""
        if self._dist is None:
            return [value]
        out: Optional[List[Any]] = [None] * self.world if self.rank == dst else None
        self._agree(lambda: self._dist.gather_object(value, out, dst=dst))
        return out

    def exchange(self, mine: dict) -> dict:
        """Virtual hosts only: the union of every host's {device: value}, so this process can hand torch_xla a value for
        every device it drives ([Note: virtual hosts])."""
        if not self.view.virtual:
            raise RuntimeError("HostGroup.exchange is the virtual-host test mode's; a pod host addresses only "
                               "its own devices")
        return {device: value for part in self.all_gather(mine) for device, value in part.items()}


_GROUP: Optional[HostGroup] = None


def host_group(view: Optional[HostView] = None) -> HostGroup:
    """The group over this slice's hosts, started on first use: gloo over torch_xla's `xla://` rendezvous on a pod
    (process_count()/process_index() under SPMD), over MASTER_ADDR/MASTER_PORT for virtual hosts. An already initialized
    torch.distributed default group of one member per host is used as it is."""
    global _GROUP
    view = view or host_view()
    if _GROUP is not None and (_GROUP.world, _GROUP.rank) == (view.count, view.index):
        return _GROUP
    if view.count == 1:
        _GROUP = HostGroup(view)
        return _GROUP
    import datetime

    import torch.distributed as dist

    from .host_watch import HostWatch, host_timeout, store_of_default_group

    # a host that never joins is waited for this long, as one that stops answering later
    timeout = datetime.timedelta(seconds=host_timeout())
    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) != (view.count, view.index):
            raise RuntimeError(f"torch.distributed is initialized with world {dist.get_world_size()} rank "
                               f"{dist.get_rank()}; the SPMD runtime needs one member per host ({view.count} "
                               f"hosts, this one {view.index}). Destroy it or initialize it over the hosts.")
    elif view.virtual:
        dist.init_process_group("gloo", init_method=virtual_group_address(), rank=view.index,
                                world_size=view.count, timeout=timeout)
    else:
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the xla:// rendezvous

        dist.init_process_group("gloo", init_method="xla://", timeout=timeout)
    if _GROUP is not None and _GROUP._watch is not None:
        _GROUP._watch.close()
    _GROUP = HostGroup(view, dist, HostWatch(store_of_default_group(), view.index, view.count, timeout.total_seconds()))
    return _GROUP


def global_tensor(shards: dict, sharding, shape, view: Optional[HostView] = None, group: Optional[HostGroup] = None):
    """The global XLA tensor of `shape` with `sharding` (an OpSharding) from this host's {device: shard} (each padded to
    the shard shape): what a pod host hands torch_xla for its own devices; a virtual host first gets the other blocks'
    shards ([Note: virtual hosts])."""
    import torch_xla

    view = view or host_view()
    if view.virtual:
        shards = (group or host_group(view)).exchange(shards)
    ordered = [shards[d] for d in view.all_devices]
    return torch_xla._XLAC._global_tensor_from_cpu_shards(ordered, sharding, list(shape))
