"""Recomputation policies ([Note: recomputation policies] in xla_fsdp/memory/remat_policy.py) on the
collectives engine, in this process on XLA:CPU at world size 1: each policy trains a Llama (and a
GPT-2) like the full recomputation, within 1e-5 (first step's gradients, losses, parameters after 3
AdamW steps), and its step program really skips the saved matmuls (fewer dots than "full"). The
offloaded policies' host moves are read from the TPU-traced HLO; bad names are refused.

The GSPMD engine's cases run in tests/test_remat_policies_gspmd.py. The default run keeps a few
policies per path; `-m slow` runs every policy on every path."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import xla_fsdp
from xla_fsdp import FSDP
from xla_fsdp.memory.remat_policy import NAMES

torch_xla = pytest.importorskip("torch_xla")

ROOT = Path(__file__).resolve().parents[1]
CASE = ROOT / "tests" / "spmd_cases" / "remat_case.py"
sys.path.insert(0, str(CASE.parent))

from remat_case import run as run_model  # noqa: E402

FAST_UNSCANNED = ("minimal", "none")
FAST_SCANNED = ("save_out_proj", "minimal_offloaded")
RECOMPUTING = tuple(n for n in NAMES if n not in ("full", "none"))


def _close(got, ref, what):
    for name, want in ref.items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} {name}: {m}")


def _check(policy: str, scan: bool, model: str = "llama"):
    ref = run_model("collectives", "full", scan, model)
    got = run_model("collectives", policy, scan, model)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    _close(got["grads"], ref["grads"], "first step's gradient")
    _close(got["params"], ref["params"], "parameter after 3 steps")
    # the policy acted: saving matmul outputs drops them from the recomputation; "none" recomputes nothing
    saves = policy not in ("full", "full_offloaded")
    assert (got["dots"] < ref["dots"]) if saves else (got["dots"] == ref["dots"]), (policy, got["dots"], ref["dots"])


@pytest.mark.parametrize("policy", FAST_UNSCANNED)
def test_unscanned_policy_trains_like_full_recompute(policy):
    _check(policy, scan=False)


@pytest.mark.parametrize("policy", FAST_SCANNED)
def test_scanned_policy_trains_like_full_recompute(policy):
    _check(policy, scan=True)


def test_gpt2_roles_save_its_fused_projection():
    """GPT-2 names its fused q/k/v projection c_attn and both output projections c_proj (attn's, mlp's)."""
    _check("save_dot_except_mlp", scan=True, model="gpt2")


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("policy", [n for n in NAMES if n != "full"])
def test_every_policy_trains_like_full_recompute(policy, scan):
    if scan and policy == "none":
        pytest.skip("refused under the collectives engine's scan (test_none_under_scan_is_refused)")
    _check(policy, scan)


@pytest.mark.slow
@pytest.mark.parametrize("policy", RECOMPUTING)
def test_every_policy_on_gpt2(policy):
    _check(policy, scan=False, model="gpt2")


def test_none_under_scan_is_refused():
    with pytest.raises(ValueError, match=r'remat_policy="none".*recomputes every layer'):
        run_model("collectives", "none", True, "llama")


def test_an_unknown_policy_name_lists_the_names():
    with pytest.raises(ValueError, match=r"remat_policy='save_qkv' is not a recomputation policy; the policies "
                                         r"are full, save_qkv_proj, .*minimal_offloaded"):
        FSDP(nn.Linear(4, 4).to(torch_xla.device()), remat_policy="save_qkv")
    from xla_fsdp.config.fsdp_config import load_fsdp_config
    from xla_fsdp.config.schema import FSDPConfigError

    with pytest.raises(FSDPConfigError, match=r"remat_policy: unknown value 'qkv'; valid: full, save_qkv_proj"):
        load_fsdp_config({"xla": True, "xla_fsdp_grad_ckpt": True, "transformer_layer_cls_to_wrap": ["Block"],
                          "xla_fsdp_settings": {"remat_policy": "qkv"}})
    with pytest.raises(FSDPConfigError, match=r"remat_policy .*xla_fsdp_grad_ckpt is off"):
        load_fsdp_config({"xla": True, "transformer_layer_cls_to_wrap": ["Block"],
                          "xla_fsdp_settings": {"remat_policy": "minimal"}})


def test_a_policy_without_checkpointing_is_refused():
    model = FSDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(torch_xla.device()),
                 auto_wrap_policy=xla_fsdp.wrap.transformer_policy([nn.Linear]), remat_policy="minimal")
    with pytest.raises(ValueError, match=r"remat_policy='minimal' says what checkpointed units save, and no unit "
                                         r"is checkpointed: turn on activation_checkpointing=True"):
        model(torch.ones(2, 8, device=torch_xla.device()))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def test_a_role_the_block_lacks_is_an_error_naming_its_matmuls():
    model = nn.Sequential(_Block(), _Block()).to(torch_xla.device())
    model = FSDP(model, auto_wrap_policy=xla_fsdp.wrap.transformer_policy([_Block]),
                 auto_wrapper_callable=lambda m, **kw: FSDP(xla_fsdp.checkpoint_module(m), **kw),
                 remat_policy="save_qkv_proj")
    x = torch.ones(2, 8, device=torch_xla.device())
    with pytest.raises(ValueError, match=r"remat_policy='save_qkv_proj': _Block has no q/k/v projections by name; "
                                         r"its matmuls are: fc1 \(other\), fc2 \(other\)"):
        model(x).sum().backward()


def test_offloaded_policies_annotate_host_moves_for_a_tpu():
    """[Note: host offload]: traced for a TPU (the check's trace), the saved tensors leave for the host
    (`pinned_host`) after the forward and come back (`device`) for the backward, in both engines' loops
    and in the unscanned checkpoint; on XLA:CPU (the parity tests above) there are no moves."""
    env = dict(os.environ, PJRT_DEVICE="CPU", XLA_FSDP_AOT="1")
    got = subprocess.run([sys.executable, str(CASE), "hlo"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in got.stdout.splitlines() if line.startswith("RESULT ")]
    assert got.returncode == 0 and lines, got.stderr[-3000:]
    moves = json.loads(lines[-1][len("RESULT "):])
    # Llama, 3 layers. Scanned, one loop body: the layer's input and the 6 matmul outputs "minimal" saves
    # (q, k, v, o, gate, up; not down_proj's), each to the host and back; "full_offloaded": the input alone
    assert moves["scan minimal_offloaded"] == {"pinned_host": 7, "device": 7}, moves
    assert moves["scan full_offloaded"] == {"pinned_host": 1, "device": 1}, moves
    # unscanned, per layer: its hidden input and q, k, v (the mask and rotary tables stay on the device)
    assert moves["unscanned qkv_proj_offloaded"] == {"pinned_host": 3 * 4, "device": 3 * 4}, moves
    assert moves["unscanned full"] == {"pinned_host": 0, "device": 0}, moves



def test_a_policy_holds_no_more_than_it_names_on_a_tpu():
    """[Note: recompute barrier]: what the recomputation derives from kept outputs alone (here a 128 MiB
    softmax from the kept q, as GPT-2's attention scores from q/k/v) is recomputed, not merged with the
    forward's: compiled by libtpu for v4-8, 8 such blocks under `save_qkv_proj` peak below two blocks'
    scores (with the kept q outside the barrier libtpu held all 8: 925 MiB)."""
    pytest.importorskip("libtpu", reason="the TPU compiler comes with `pip install -e .[tpu-aot]`")
    from common import aot_cases as ac

    got = ac.check("v4-8", [str(ROOT / "tests" / "fixtures" / "aot_policy_scores.py"), "save_qkv_proj"],
                   runtime="multi_process", extra=["--quiet"], timeout=600)
    report = got["report"]
    assert got["rc"] == 0 and report is not None, got["output"]
    scores = 8 * 2048 * 2048 * 4  # one block's float32 softmax
    assert report["compiles"] and report["memory"]["peak"] < 2 * scores, report["memory"]


class _Attention(nn.Module):
    def __init__(self, direct: bool, hooked: bool = False):
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)
        self.direct, self.hooked = direct, hooked

    def forward(self, x):
        if not self.direct:
            return self.o_proj(torch.tanh(self.q_proj(x)))
        q = torch.einsum("bi,oi->bo", x, self.q_proj.weight) + self.q_proj.bias  # the weights read directly
        if self.hooked:
            from xla_fsdp.memory.saved_outputs import as_output_of

            q = as_output_of(self.q_proj, (x,), q)
        return self.o_proj(torch.tanh(q))


class _AttnBlock(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.attn = _Attention(**kw)

    def forward(self, x):
        return x + self.attn(x)


def _attn_model(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(_AttnBlock(**kw), _AttnBlock(**kw)).to(torch_xla.device())
    return FSDP(model, auto_wrap_policy=xla_fsdp.wrap.transformer_policy([_AttnBlock]),
                auto_wrapper_callable=lambda m, **k: FSDP(xla_fsdp.checkpoint_module(m), **k),
                remat_policy="save_qkv_proj")


def test_a_forward_that_reads_the_weights_directly_is_refused_unless_it_says_what_it_computed():
    """[Note: saved outputs]: a policy whose modules the block never calls would save nothing; the
    head-major attention paths (llama_heads.py, gpt2_heads.py) hand their einsums to the hooks with
    `as_output_of`, and then the policy saves them (the step has fewer dots than "full")."""
    x = torch.randn(4, 8).to(torch_xla.device())
    with pytest.raises(ValueError, match=r"remat_policy: the block ran without calling the 1 modules its policy "
                                         r"saves \(Linear\)"):
        _attn_model(direct=True)(x).sum().backward()
    from xla_fsdp.memory.remat_policy import set_policy

    dots = {}
    for policy in ("full", "save_qkv_proj"):
        model = _attn_model(direct=True, hooked=True)
        set_policy([model[0], model[1]], policy)
        model(x).sum().backward()
        dots[policy] = torch_xla._XLAC._get_xla_tensors_hlo([p.grad for p in model.parameters()]).count(" dot(")
        torch_xla.sync()
    assert dots["save_qkv_proj"] < dots["full"], dots  # q_proj leaves the recomputation
