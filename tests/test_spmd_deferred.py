"""Deferred init through the SPMD engine: each unit replays its recorded
constructor right before it is sharded (run in a subprocess: SPMD mode is
process-wide)."""
import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, torch, torch_xla, torch_xla.runtime as xr
    xr.use_spmd()
    import xla_fsdp
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=128, n_positions=32)
    model = xla_fsdp.deferred_init(GPT2LMHeadModel, cfg)
    deferred_before = xla_fsdp.is_deferred(model)
    model = xla_fsdp.FSDP(model, engine="spmd", auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]))
    ids = torch.randint(0, 128, (8, 16)).to(torch_xla.device())
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    wte = model.transformer.wte.weight
    spec = torch_xla._XLAC._get_xla_sharding_spec(wte)
    print(json.dumps({
        "deferred_before": deferred_before, "deferred_after": xla_fsdp.is_deferred(model),
        "loss": loss.item(), "tied": model.lm_head.weight is wte,
        "wte_std": wte.detach().cpu().std().item(),
        "ln_weight_mean": model.transformer.h[1].ln_1.weight.detach().cpu().mean().item(),
        "spec": spec}))
""")


def test_deferred_gpt2_materializes_per_unit_under_spmd():
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["deferred_before"] and not out["deferred_after"]
    assert out["tied"]
    assert 4.0 < out["loss"] < 6.0  # ~ln(128)=4.85 for a freshly initialized model
    assert abs(out["wte_std"] - 0.02) < 0.002  # GPT-2's initializer_range, replayed
    assert out["ln_weight_mean"] == 1.0
    assert "devices=[4" in out["spec"], out["spec"]  # dim 0 split over the 4 devices
