"""What a checkpointed block saves for its backward: the recomputation policies (`remat_policy`).

[Note: recomputation policies]
Besides recomputing all of a checkpointed block in backward (it saves only its input) or keeping all of it, a
policy names what it saves in between, by the role of the matmuls whose outputs it keeps; the rest is recomputed
from those and the block's input. The names follow MaxText's `remat_policy` where one exists:

| policy                | saves (besides the block's input)                            |
|-----------------------|--------------------------------------------------------------|
| "full"                | nothing: the whole block is recomputed (the default)         |
| "save_qkv_proj"       | the attention's q, k and v projections                        |
| "save_out_proj"       | the attention's output projection                             |
| "save_dot_except_mlp" | every matmul but the MLP's: q, k, v and the output projection |
| "minimal"             | every matmul's output (attention's and the MLP's) but one     |
| "none"                | everything: the block is not recomputed                       |
| "fit"                 | per block, what HBM holds ([Note: a policy per block], fit.py) |

and "offload" variants whose saved tensors wait in the host's memory instead of HBM ([Note: host offload] in
host_offload.py): "full_offloaded" (the block's input), "qkv_proj_offloaded" and "minimal_offloaded" (the block's
input and those outputs).

No policy saves the MLP's last matmul (down_proj, the MLP's c_proj, fc2): in a pre-norm decoder only the residual
sum reads its output, and that sum's backward reads no value, so a saved copy would be memory (and, offloaded, host
traffic) that no backward uses.

Roles come from module names, as the decoders users bring name them: a matmul module (nn.Linear, transformers'
Conv1D) below a module whose name says attention ("attn", "attention") is the output projection when its own name
says so (o_proj, out_proj, c_proj, dense, wo), else one of q/k/v (q_proj, c_attn, query_key_value, ...); below one
whose name says MLP ("mlp", "ffn", "feed_forward") it is the MLP's. A policy that names a role a block does not
have is an error that lists the block's matmuls: saving nothing instead would be a silent full recompute.

Saving a matmul's output skips only the matmul: its backward needs its input and weight, not its output, so the
recomputation still computes the input and XLA drops the matmul itself, whose value nothing reads ([Note: saved
outputs] in saved_outputs.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from xla_fsdp.class_swap import original_class

QKV, OUT, MLP, OTHER = "qkv", "out", "mlp", "other"
MLP_OUT = "mlp_out"  # the MLP's last matmul: no policy saves it (the note says why)


@dataclass(frozen=True)
class RematPolicy:
    name: str
    saves: FrozenSet[str]  # the roles whose outputs are saved
    offload: bool = False  # saved tensors (and the block's input) wait in host memory
    keeps_all: bool = False  # "none": nothing is recomputed

    def describe(self) -> str:
        if self.keeps_all:
            return "keeps every activation (no recomputation)"
        what = ", ".join(_ROLE_WORDS[r] for r in _ROLE_ORDER if r in self.saves) or "nothing but its input"
        where = " in host memory" if self.offload else ""
        return f"saves {what}{where}"


_ROLE_ORDER = (QKV, OUT, MLP, OTHER)
_ROLE_WORDS = {QKV: "q/k/v projections", OUT: "attention output projection", MLP: "MLP matmuls",
               OTHER: "other matmuls", MLP_OUT: "the MLP's output projection"}
_EVERY = frozenset(_ROLE_ORDER)

POLICIES: Dict[str, RematPolicy] = {p.name: p for p in (
    RematPolicy("full", frozenset()),
    RematPolicy("save_qkv_proj", frozenset({QKV})),
    RematPolicy("save_out_proj", frozenset({OUT})),
    RematPolicy("save_dot_except_mlp", frozenset({QKV, OUT})),
    RematPolicy("minimal", _EVERY),
    RematPolicy("none", _EVERY, keeps_all=True),
    RematPolicy("full_offloaded", frozenset(), offload=True),
    RematPolicy("qkv_proj_offloaded", frozenset({QKV}), offload=True),
    RematPolicy("minimal_offloaded", _EVERY, offload=True),
    # the collectives engine's root: each unit's policy from HBM ([Note: a policy per block] in fit.py);
    # "full" until the first step has measured
    RematPolicy("fit", frozenset()),
)}
FULL = POLICIES["full"]
NAMES: Tuple[str, ...] = tuple(POLICIES)


def policy_named(name) -> RematPolicy:
    """The policy called `name` (a RematPolicy passes through); a clear error listing the names."""
    if isinstance(name, RematPolicy):
        return name
    if name is None:
        return FULL
    key = str(name).lower() if isinstance(name, str) else name
    if key not in POLICIES:
        raise ValueError(f"remat_policy={name!r} is not a recomputation policy; the policies are "
                         f"{', '.join(NAMES)} ([Note: recomputation policies] in xla_fsdp/memory/remat_policy.py)")
    return POLICIES[key]


_KEY = "_xla_fsdp_remat_policy"


def set_policy(modules, policy) -> None:
    """Give checkpointed `modules` (one or several) their policy (a name or a RematPolicy; None: no change)."""
    if policy is None:
        return
    for module in [modules] if isinstance(modules, nn.Module) else modules:
        module.__dict__[_KEY] = policy_named(policy)


def policy_of(module: nn.Module) -> RematPolicy:
    return module.__dict__.get(_KEY, FULL)


def given(module: nn.Module) -> bool:
    """Whether `module` was given a policy other than "full"."""
    return _KEY in module.__dict__ and module.__dict__[_KEY] is not FULL


_ATTENTION_WORDS = ("attn", "attention")
_MLP_WORDS = ("mlp", "ffn", "feed_forward", "feedforward")
_OUT_NAMES = frozenset({"o_proj", "out_proj", "c_proj", "dense", "wo", "o", "proj", "out", "output"})
_MLP_OUT_NAMES = frozenset({"down_proj", "c_proj", "fc2", "w2", "dense_4h_to_h", "wo", "out_proj", "dense",
                            "proj_out"})


def _is_matmul(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (  # or transformers' GPT-2 Conv1D
        type(module).__name__ == "Conv1D" and not any(True for _ in module.children()))


def role(path: str) -> str:
    """The role of the matmul module at `path` (dotted, inside its block)."""
    parts = path.lower().split(".")
    above, leaf = parts[:-1], parts[-1]
    if any(w in p for p in above for w in _ATTENTION_WORDS):
        return OUT if leaf in _OUT_NAMES else QKV
    if any(w in p for p in above for w in _MLP_WORDS):
        return MLP_OUT if leaf in _MLP_OUT_NAMES else MLP
    return OTHER


def matmuls(block: nn.Module) -> List[Tuple[str, nn.Module, str]]:
    """(path, module, role) of every matmul module of `block`, in module order."""
    return [(path, m, role(path)) for path, m in block.named_modules() if path and _is_matmul(m)]


def saved_modules(block: nn.Module, policy: RematPolicy, where: Optional[str] = None) -> List[nn.Module]:
    """The modules of `block` whose outputs `policy` saves; refuses a role the block lacks."""
    found = matmuls(block)
    if policy.keeps_all or not policy.saves:
        return []
    missing = [r for r in policy.saves - {OTHER} if not any(r == got for _, _, got in found)]
    if policy.saves == _EVERY:
        missing = [] if found else [MLP]
    if missing:
        seen = ", ".join(f"{p} ({r})" for p, _, r in found) or "none"
        raise ValueError(
            f"remat_policy={policy.name!r}: {where or original_class(block).__name__} has no "
            f"{' or '.join(_ROLE_WORDS[r] for r in missing)} by name; its matmuls are: {seen}. "
            "[Note: recomputation policies] in xla_fsdp/memory/remat_policy.py says how roles are named; "
            "choose a policy whose roles the block has (\"minimal\" saves every matmul)")
    return [m for _, m, r in found if r in policy.saves]


# What the step's blocks got, for the ahead-of-time check's report (aot/capture.py writes it): by the block's
# class, where it runs and its policy's name, the blocks (by id) that ran so.
_APPLIED: Dict[Tuple[str, str, str], set] = {}


def note_applied(blocks, policy: Optional[RematPolicy], where: str = "checkpointed") -> None:
    """Record that `blocks` ran under `policy` (None: kept by checkpoint_all_but_last), "checkpointed" or "scanned"."""
    blocks = [blocks] if isinstance(blocks, nn.Module) else list(blocks)
    name = policy.name if policy is not None else "kept (checkpoint_all_but_last)"
    key = (original_class(blocks[0]).__name__, where, name)
    _APPLIED.setdefault(key, set()).update(id(b) for b in blocks)


def applied() -> List[dict]:
    """The records so far: [{"block", "where", "policy", "count", "saves"}]."""
    return [{"block": b, "where": w, "policy": p, "count": len(ids),
             "saves": POLICIES[p].describe() if p in POLICIES else "keeps every activation"}
            for (b, w, p), ids in sorted(_APPLIED.items())]


def forget_applied() -> None:
    _APPLIED.clear()


@contextlib.contextmanager
def role_bytes(block: nn.Module) -> Iterator[Dict[str, int]]:
    """The bytes of `block`'s matmul outputs by role while it runs (what each policy would save)."""
    out: Dict[str, int] = {}

    def hook(role_name):
        def count(_module, _args, output):
            if isinstance(output, torch.Tensor):
                out[role_name] = out.get(role_name, 0) + output.numel() * output.element_size()
        return count

    handles = [m.register_forward_hook(hook(r)) for _, m, r in matmuls(block)]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()

