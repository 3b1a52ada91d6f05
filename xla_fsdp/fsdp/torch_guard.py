"""PyTorch's own `fully_shard` on an XLA model: an error that names ours.

torch 2.9's `torch.distributed.fsdp.fully_shard` fails on XLA modules deep in its setup (no default process group, or no
device handle for "xla"), with messages that do not say what to use instead. Once `xla_fsdp.fsdp` is imported, the
helpers it calls first (building the default mesh, finding the mesh's device, moving the parameters to it) check for XLA
and raise an error that names `xla_fsdp.fsdp.fully_shard`; everything else reaches PyTorch's code unchanged. The helpers
are looked up in their module at call time, so this holds however the script imported PyTorch's `fully_shard`."""
from __future__ import annotations

_MESSAGE = ("torch.distributed.fsdp.fully_shard does not run on XLA devices in torch 2.9; use "
            "xla_fsdp.fsdp.fully_shard (same signature): `from xla_fsdp.fsdp import fully_shard, "
            "MixedPrecisionPolicy, CPUOffloadPolicy`")


def _xla_active() -> bool:
    try:
        import torch_xla.runtime as xr
    except ImportError:
        return False
    return xr.is_spmd() or xr.device_type() not in (None, "")


_INSTALLED = []


def install() -> None:
    """Wrap the helpers (once): one of the import-time effects docs/DESIGN.md lists."""
    try:
        from torch.distributed.fsdp._fully_shard import _fully_shard as impl
    except ImportError:
        return
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    default_mesh = impl._init_default_fully_shard_mesh
    device_from_mesh = impl._get_device_from_mesh

    def init_default_mesh(*args, **kwargs):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) and _xla_active():
            raise RuntimeError(_MESSAGE)
        return default_mesh(*args, **kwargs)

    def get_device_from_mesh(mesh, *args, **kwargs):
        if getattr(mesh, "device_type", None) == "xla":
            raise RuntimeError(_MESSAGE)
        return device_from_mesh(mesh, *args, **kwargs)

    move_states = impl._move_states_to_device

    def move_states_to_device(params, buffers, device, *args, **kwargs):
        if any(t.device.type == "xla" for t in list(params) + list(buffers)):
            raise RuntimeError(_MESSAGE)
        return move_states(params, buffers, device, *args, **kwargs)

    impl._move_states_to_device = move_states_to_device
    impl._init_default_fully_shard_mesh = init_default_mesh
    impl._get_device_from_mesh = get_device_from_mesh
