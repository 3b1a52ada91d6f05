"""The process group line of an FSDP2 script on XLA: `dist.init_process_group("gloo", init_method="xla://")`.

[Note: xla:// enters the single controller] FSDP2 scripts initialize the process group before they build the model, and
torch_xla's `xla://` rendezvous starts the XLA runtime to learn the rank and world size. Started that way the runtime
runs one process per device, and turning the SPMD runtime on afterwards (as `fully_shard` must) crashes it. So once
`xla_fsdp.fsdp` is imported, the `xla://` rendezvous first enters the single controller (torch_xla's SPMD mode) and then
runs torch_xla's own handler, which under SPMD numbers one member per host: `dist.get_rank()` / `get_world_size()` count
processes, as FSDP2 scripts assume. On one host the store is an in-process one (no port to collide on); virtual hosts
(`environment.VIRTUAL_HOSTS`, tests) meet over MASTER_ADDR/MASTER_PORT. Nothing happens at import; only that rendezvous
changes (and, on a machine without CUDA, the devices gloo groups serve: `_gloo_on_the_host_only`)."""
from __future__ import annotations


def install() -> None:
    """Put our `xla://` handler in front of torch_xla's (once)."""
    import importlib

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module (the package re-exports a function of that name)
    import torch_xla.distributed.xla_backend  # noqa: F401  registers torch_xla's handler first

    handlers = rdzv._rendezvous_handlers
    theirs = handlers.get("xla")
    if theirs is None or getattr(theirs, "_xla_fsdp", False):
        return

    def handler(url, timeout=None, **kwargs):
        import torch.distributed as dist
        import torch_xla.runtime as xr

        from ..runtime.choice import enter_single_controller

        if not xr.is_spmd() and runtime_started():
            # one process per chip (xmp.spawn, xla_spawn --per_chip): torch_xla's own meaning; fully_shard then refuses
            # by name
            yield from (theirs(url, **kwargs) if timeout is None else theirs(url, timeout, **kwargs))
            return
        enter_single_controller()
        _gloo_on_the_host_only()
        view = _virtual_hosts()
        if view is not None:
            # the hosts' group as host_group() makes it ([Note: virtual hosts] in runtime/hosts.py)
            from ..runtime.hosts import virtual_group_address

            yield from dist.rendezvous(virtual_group_address(), rank=view.index, world_size=view.count,
                                       **({} if timeout is None else {"timeout": timeout}))
            return
        if xr.process_count() == 1:
            # one host: a store in this process, not torch_xla's TCP store on its fixed port (12355), which two jobs on
            # one machine would both try to bind
            yield dist.HashStore(), 0, 1
            return
        yield from (theirs(url, **kwargs) if timeout is None else theirs(url, timeout, **kwargs))

    handler._xla_fsdp = True
    handlers["xla"] = handler


def _virtual_hosts():
    """This process's HostView when it is one of several virtual hosts, else None."""
    from ..runtime import hosts

    if not hosts.virtual_hosts_requested():
        return None
    view = hosts.host_view()
    return view if view.count > 1 else None


def runtime_started() -> bool:
    """Whether this process's XLA runtime already runs (its mode can no longer change)."""
    import torch_xla

    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def _gloo_on_the_host_only() -> None:
    """Without CUDA, "gloo" groups serve the CPU only. torch registers gloo for "cpu" and "cuda" whatever the machine
    has, and its state-dict helpers move tensors that live on neither (XLA) to the group's first device type, which is
    CUDA: `set_state_dict(..., StateDictOptions(broadcast_from_rank0=True))` then fails with "Found no NVIDIA driver".
    The rendezvous runs before the group's backends are made, so this reaches the group."""
    import torch
    from torch.distributed import Backend

    capability = Backend.backend_capability.get("gloo")
    if capability and "cuda" in capability and not torch.cuda.is_available():
        Backend.backend_capability["gloo"] = [d for d in capability if d != "cuda"]
