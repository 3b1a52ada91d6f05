"""Random numbers inside a scanned layer: dropout drawn from per-layer, per-sequence keys.

[Note: dropout under scan]
A scanned loop runs one traced layer for every layer, so whatever random numbers the layer draws must differ per trip,
and a backward body that recomputes the layer must draw the same ones the forward did. torch_xla 2.9's `scan` means to
give each trip its own copy of the lazy RNG seed, but under the SPMD engine its seed detection does not fire (on XLA:CPU
every layer of a scanned model applied the same dropout mask), and the backward scan would draw fresh seeds for a
recomputed layer in any case. (Random bits drawn by XLA's generator are also drawn at the global batch's shape on every
chip unless libtpu is told otherwise: [Note: random bits per chip].)

So the loop carries one int32 key per layer and sequence, drawn from torch's RNG each call (so each step differs) and
split over the devices as the batch is, and while the body is traced a function mode replaces dropout with a
counter-based one: every element's keep bit is a hash of (its sequence's key, which dropout call in the layer, its index
on each other dim). The mask is a pure function of the key, so a recomputed backward rebuilds it exactly, and it is
element-wise over iotas, so the partitioner shards it like the activation it multiplies. Dropout inside
`scaled_dot_product_attention` is computed the same way on the attention weights. Any other random draw in the body
(`torch.rand`, `bernoulli`, channel dropout, ...) is refused with the reason instead of repeating across layers.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from xla_fsdp.layer_scan import fences

_MASK32 = (1 << 32) - 1


def _i32(value: int) -> int:
    """An unsigned 32-bit constant as the int32 with the same bits."""
    value &= _MASK32
    return value - (1 << 32) if value >= (1 << 31) else value


_GOLDEN = _i32(0x9E3779B9)
_MUL1 = _i32(0x7FEB352D)
_MUL2 = _i32(0x846CA68B)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 bits (torch's `>>` is arithmetic)."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply): every input bit moves every output bit."""
    x = x ^ _shift_right(x, 16)
    x = x * _MUL1
    x = x ^ _shift_right(x, 15)
    x = x * _MUL2
    return x ^ _shift_right(x, 16)


def uniform_from_key(key: torch.Tensor, salt: int, like: torch.Tensor) -> torch.Tensor:
    """Floats in [0, 1) shaped like `like`, a pure function of (key, salt, element index). `key` holds one int32 per
    sequence of the batch; when `like`'s dim 0 is the batch, each sequence starts from its own key and the index enters
    from dim 1 on. The keys are split over the devices as the batch is, so nothing about the batch is replicated (an
    iota over the batch dim was: on the 64B GPT-2 for v4-256 the partitioner replicated it with two small all-reduces
    per trip). Any other shape hashes every dim's index from the first sequence's key. One dim at a time, so no int32
    index overflows however large the tensor."""
    salted = key.to(torch.int32) ^ _i32(salt * 0x27D4EB2F + 0x165667B1)
    if like.dim() >= 1 and like.shape[0] == key.shape[0]:
        bits = _mix(salted.view([-1] + [1] * (like.dim() - 1)))
        first = 1
    else:
        bits = _mix(salted[0])
        first = 0
    for dim in range(first, like.dim()):
        size = like.shape[dim]
        view = [1] * like.dim()
        view[dim] = size
        index = torch.arange(size, dtype=torch.int32, device=like.device).view(view)
        bits = _mix(bits + index * _GOLDEN + dim)
    top24 = _shift_right(bits, 8)
    return top24.to(torch.float32) * (1.0 / (1 << 24))


def keyed_dropout(x: torch.Tensor, p: float, key: torch.Tensor, salt: int) -> torch.Tensor:
    if p <= 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    keep = uniform_from_key(key, salt, x) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
               drop: Callable) -> torch.Tensor:
    """scaled_dot_product_attention written out, its dropout from the layer's key."""
    length, source = query.size(-2), key.size(-2)
    if enable_gqa and key.size(-3) != query.size(-3):
        repeat = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    weights = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        allowed = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        weights = weights.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            weights = weights.masked_fill(~attn_mask, float("-inf"))
        else:
            weights = weights + attn_mask
    weights = torch.softmax(weights.float(), dim=-1).to(query.dtype)
    return drop(weights, dropout_p) @ value


# random functions a scanned layer may not call (each would repeat across layers), with their names
_REFUSED: Dict[Any, str] = {
    getattr(space, name): f"{prefix}.{name}"
    for space, prefix, names in (
        (torch, "torch", "rand rand_like randn randn_like randint randint_like randperm bernoulli normal multinomial "
                         "poisson rrelu native_dropout alpha_dropout feature_dropout feature_alpha_dropout"),
        (torch.Tensor, "Tensor", "bernoulli bernoulli_ uniform_ normal_ random_ exponential_ geometric_ cauchy_ "
                                 "log_normal_ multinomial"),
        (F, "F", "rrelu alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d gumbel_softmax"))
    for name in names.split()
}


class KeyedRandom(TorchFunctionMode):
    """Active while a scanned layer is traced ([Note: dropout under scan])."""

    def __init__(self, key: torch.Tensor, where: str):
        super().__init__()
        self._key = key
        self._where = where
        self._calls = 0

    def __enter__(self):
        fences.enter()
        return super().__enter__()

    def __exit__(self, *exc):
        fences.leave()
        return super().__exit__(*exc)

    def _drop(self, x: torch.Tensor, p: float) -> torch.Tensor:
        salt = self._calls
        self._calls += 1
        return keyed_dropout(x, float(p), self._key, salt)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout or func is torch.dropout:
            return self._dropout(func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            p = _argument(args, kwargs, 4, "dropout_p", 0.0)
            if p and p > 0:
                return _attention(*args, **kwargs, drop=self._drop)
            return func(*args, **kwargs)
        if func in _REFUSED and not _inactive(func, args, kwargs):
            raise RuntimeError(f"scan_layers: a layer of {self._where} calls {_REFUSED[func]} while it is "
                               "traced for the scanned loop; every layer would draw the same numbers. Dropout "
                               "(F.dropout, nn.Dropout, attention dropout) is supported; draw other random "
                               "numbers outside the layers, or turn scan_layers off for this model.")
        return func(*args, **kwargs)

    def _dropout(self, func, args, kwargs) -> torch.Tensor:
        x = args[0] if args else kwargs["input"]
        p = _argument(args, kwargs, 1, "p", 0.5)
        training = _argument(args, kwargs, 2, "training" if func is F.dropout else "train", True)
        inplace = _argument(args, kwargs, 3, "inplace", False) if func is F.dropout else False
        if not training or p == 0:
            return x
        out = self._drop(x, p)
        return x.copy_(out) if inplace else out


def _argument(args, kwargs, position: int, name: str, default: Any) -> Any:
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


def _inactive(func, args, kwargs) -> bool:
    """The random functions that draw nothing when not training (or with p 0)."""
    if func in (F.dropout1d, F.dropout2d, F.dropout3d):
        return not _argument(args, kwargs, 2, "training", True) or _argument(args, kwargs, 1, "p", 0.5) == 0
    if func in (F.alpha_dropout, F.feature_alpha_dropout):
        return not _argument(args, kwargs, 2, "training", False) or _argument(args, kwargs, 1, "p", 0.5) == 0
    if func in (F.rrelu, torch.rrelu):
        return not _argument(args, kwargs, 3, "training", False)
    return False


def layer_keys(layers: int, hidden: torch.Tensor) -> torch.Tensor:
    """(layers, sequences) int32 keys for this call, from torch's RNG on the device (each step differs)."""
    return torch.randint(0, (1 << 31) - 1, (layers, hidden.shape[0] if hidden.dim() else 1), dtype=torch.int32,
                         device=hidden.device)
