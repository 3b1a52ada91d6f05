"""checkpoint_all_but_last="fit" ([Note: keep what fits] in xla_fsdp/memory/fit.py): the first
step recomputes every block and measures what each would keep; the next keeps as many of the
last blocks as the device's memory figures leave room for, with unchanged gradients."""
import json
import logging

import pytest
import torch

import xla_fsdp
from xla_fsdp import FSDP
from xla_fsdp.memory import device_figures, fit, kept_bytes
from xla_fsdp.runtime import environment
from xla_fsdp.unit_state import state_of
from parity_cases import batch, build_model, gpt2_config, loss_fn

torch_xla = pytest.importorskip("torch_xla")
GIB = 2 ** 30


def test_keep_count_takes_the_last_units_that_fit_and_never_all():
    # room 0.95 * 100 - 50 = 45 bytes; a unit costs its measured bytes times SAVED_TO_KEPT
    cost = lambda n: [n / fit.SAVED_TO_KEPT] * 4  # noqa: E731
    assert fit.keep_count(cost(20), peak=50, limit=100) == 2
    assert fit.keep_count(cost(20), peak=50, limit=10 ** 9) == 3  # the first always recomputes
    assert fit.keep_count(cost(20), peak=95, limit=100) == 0
    assert fit.keep_count([x / fit.SAVED_TO_KEPT for x in (10, 10, 100, 10)], peak=0, limit=40) == 1  # stops at the first that does not fit


def test_the_last_unit_fits_over_time_where_the_peak_lies_deeper_in_the_backward():
    # [Note: keep what fits, over time]: the 2B on two v4-8 slices, in GB: every unit recomputed peaks at 25.45 (its
    # curve at 24.91) with 14.40 held before the backward; a kept block measures 8.46; the usable HBM is 33.02
    two_slices = {"peak": 25.45e9, "curve_peak": 24.91e9, "before_backward": 14.40e9}
    room_by_peak = fit.HEADROOM * 33.02e9 - two_slices["peak"]
    assert fit.keep_count([8.46e9 / fit.SAVED_TO_KEPT] * 18, two_slices["peak"], 33.02e9) == 0 < room_by_peak
    assert fit.last_unit_fits_over_time(8.46e9 / fit.SAVED_TO_KEPT, two_slices, 33.02e9)
    # held before the backward: what the step holds there, libtpu's slack beyond the curve, and the unit's bytes
    assert not fit.last_unit_fits_over_time(17.0e9 / fit.SAVED_TO_KEPT, two_slices, 33.02e9)  # 14.94 + 17 > 31.37
    assert not fit.last_unit_fits_over_time(8.46e9 / fit.SAVED_TO_KEPT, dict(two_slices, curve_peak=16.0e9), 33.02e9)


def test_the_check_prints_the_hint_only_where_it_holds():
    from xla_fsdp.aot import report

    first = {"memory": {"peak": 25.45e9}, "projection": {"projected_seconds": 3.6}}
    shown = {"count": 0, "units": 18, "every_unit_recomputed": first}
    assert len(report._render_fit(shown)) == 1
    lines = report._render_fit(dict(shown, last_unit_fits_over_time=True))
    assert len(lines) == 2 and "checkpoint_all_but_last=1" in lines[1], lines


def test_bad_memory_figures_are_refused(monkeypatch):
    monkeypatch.setenv(device_figures.MEMORY_ENV, "30GiB")
    with pytest.raises(ValueError, match=r"XLA_FSDP_FIT_MEMORY='30GiB': give the device's memory as JSON"):
        device_figures.figures(device_figures.Before())
    monkeypatch.setenv(device_figures.MEMORY_ENV, json.dumps({"peak": 1, "limit": 0}))
    with pytest.raises(ValueError, match=r"need limit > 0"):
        device_figures.figures(device_figures.Before())


def _model(depth: int = 4):
    from transformers import GPT2LMHeadModel

    config = gpt2_config()
    config.n_layer = depth
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _step(model, step: int):
    """One SGD step; the gradients it applied."""
    dev = torch_xla.device()
    x, y = batch("gpt2", step)
    opt = model.__dict__.setdefault("_test_opt", torch.optim.SGD(model.parameters(), lr=0.1))
    opt.zero_grad(set_to_none=True)
    loss = loss_fn("gpt2", model, x.to(dev), y.to(dev))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    torch_xla.sync()
    return {n: g.cpu() for n, g in grads.items()}


def _kept(model):
    return [state_of(b).keeps_activations for b in model.transformer.h]


def test_fit_measures_then_keeps_the_last_blocks_that_fit(monkeypatch, tmp_path):
    ref_model = FSDP(_model(), auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]))
    ref = [_step(ref_model, s) for s in range(3)]  # nothing recomputed
    reference_block = _model().transformer.h[0].to(torch_xla.device())
    ids, _ = batch("gpt2", 0)
    x = torch.randn(*ids.shape, ref_model.config.n_embd, device=torch_xla.device())
    with kept_bytes.saved_bytes(reference_block) as plain:  # what one block keeps without checkpointing
        reference_block(x)

    model = FSDP(_model(), auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
                 activation_checkpointing=True, checkpoint_all_but_last="fit")
    report = tmp_path / "fit.json"
    monkeypatch.setenv(environment.AOT, json.dumps({"fit_report": str(report)}))
    got = [_step(model, 0)]
    assert _kept(model) == [False] * 4  # the first step recomputes every block and measures them
    plan = state_of(model).fit_plan
    saved = [plan.saved[id(b)] for b in model.transformer.h]
    # each recomputation saved what the plain block saves (its weights left out), and beside it
    # no more than the first layer norm's input and statistics (the plain block's input needs no grad)
    x_bytes = x.numel() * x.element_size()
    assert len(set(saved)) == 1 and plain["bytes"] <= saved[0] <= plain["bytes"] + 1.1 * x_bytes, (saved, plain)
    # room for two and a half blocks at the assumed kept share: the last two keep theirs
    peak = 10 * GIB
    limit = int((peak + 2.5 * fit.SAVED_TO_KEPT * saved[0]) / fit.HEADROOM)
    monkeypatch.setenv(device_figures.MEMORY_ENV, json.dumps({"peak": peak, "limit": limit}))
    got += [_step(model, 1), _step(model, 2)]
    assert _kept(model) == [False, False, True, True]
    assert json.loads(report.read_text())["count"] == 2
    for want, have in zip(ref, got):
        for name in want:
            torch.testing.assert_close(have[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    monkeypatch.setenv(device_figures.MEMORY_ENV, json.dumps({"peak": peak, "limit": 10 * limit}))
    _step(model, 3)
    assert _kept(model) == [False, False, True, True]  # decided once: one program from then on


def test_fit_without_memory_figures_recomputes_every_block_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv(device_figures.MEMORY_ENV, raising=False)
    model = FSDP(_model(2), auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
                 activation_checkpointing=True, checkpoint_all_but_last="fit")
    with caplog.at_level(logging.WARNING, logger="xla_fsdp"):
        _step(model, 0)
        _step(model, 1)
    assert _kept(model) == [False, False]
    assert "no memory figures for this device" in caplog.text


def test_fit_needs_checkpointed_blocks_and_the_word():
    model = FSDP(_model(2), auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
                 checkpoint_all_but_last="fit")
    x, _ = batch("gpt2", 0)
    with pytest.raises(ValueError, match=r"checkpoint_all_but_last=\"fit\", but no unit is checkpointed"):
        model(x.to(torch_xla.device()))
    with pytest.raises(ValueError, match=r"or \"fit\""):
        FSDP(build_model("gpt2"), checkpoint_all_but_last="most")


def test_a_restarted_job_keeps_the_count_its_first_run_chose(monkeypatch, tmp_path):
    """A restart's first step loads from the persistent compilation cache and compiles nothing,
    so libtpu logs no figures for it: the count the first run chose from the device's own
    figures is kept beside the cache and used again (same units, same bytes, same devices)."""
    monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", str(tmp_path))
    monkeypatch.delenv(device_figures.MEMORY_ENV, raising=False)
    units = [object(), object(), object()]
    step = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    def first_step(plan, size, read=None):
        plan.resolve(units, read=read)
        for u in units:
            plan.record(u, size)
        assert plan.resolve(units, read=read) == 0  # a micro-batch: no optimizer step yet
        step.step()

    plan = fit.FitPlan()
    first_step(plan, 100, read=lambda: {"peak_bytes_used": 10, "bytes_limit": 1000, "bytes_used": 5})
    # the first step ran: peak 300 of 1000, nothing more held; room 0.95 * 1000 - 300 = 650
    assert plan.resolve(units, read=lambda: {"peak_bytes_used": 300, "bytes_limit": 1000, "bytes_used": 5}) == 2
    again = fit.FitPlan()
    first_step(again, 100)
    assert again.resolve(units) == 2  # no figures on XLA:CPU: the stored count
    other = fit.FitPlan()
    first_step(other, 101)  # another batch or model: not this job's count
    assert other.resolve(units) == 0


def test_fit_policies_spend_the_room_on_matmuls_before_whole_blocks():
    """[Note: a policy per block]: from the last unit backwards, the richest policy the room holds;
    then units with "minimal" keep everything while a whole unit's rest fits; never the first."""
    roles = [{"qkv": 3, "out": 1, "mlp": 8}] * 4  # minimal 12, save_dot_except_mlp 4, save_qkv_proj 3
    saved = [20] * 4  # a kept unit: 8 more than minimal
    k = fit.SAVED_TO_KEPT
    assert fit.fit_policies(saved, roles, 0) == ["full"] * 4
    assert fit.fit_policies(saved, roles, 7 * k) == ["full", "full", "save_qkv_proj", "save_dot_except_mlp"]
    assert fit.fit_policies(saved, roles, 48 * k) == ["minimal"] * 4
    assert fit.fit_policies(saved, roles, 64 * k) == ["minimal", "minimal", "none", "none"]
    assert fit.fit_policies(saved, roles, 10 ** 6) == ["minimal", "none", "none", "none"]  # the first recomputes


def test_remat_policy_fit_measures_then_gives_each_block_a_policy(monkeypatch):
    """remat_policy="fit" on GPT-2's blocks: the first step recomputes every block and measures its
    matmul outputs by role; with room for every block's matmuls and one whole block, the last keeps
    everything and the others save every matmul; the gradients stay those of no recomputation."""
    from xla_fsdp.memory.remat_policy import policy_of

    ref_model = FSDP(_model(3), auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]))
    ref = [_step(ref_model, s) for s in range(3)]
    model = FSDP(_model(3), auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
                 activation_checkpointing=True, remat_policy="fit")
    got = [_step(model, 0)]
    plan = state_of(model).fit_plan
    blocks = list(model.transformer.h)
    roles = [plan.roles[id(b)] for b in blocks]
    saved = [plan.saved[id(b)] for b in blocks]
    # GPT-2 names its fused q/k/v c_attn, its output projections c_proj (attn's: "out"; mlp's: not saved)
    assert set(roles[0]) == {"qkv", "out", "mlp", "mlp_out"} and roles[0]["qkv"] == 3 * roles[0]["out"], roles
    minimal = sum(roles[0][r] for r in ("qkv", "out", "mlp"))
    room = fit.SAVED_TO_KEPT * (3 * minimal + (saved[2] - minimal)) + 4096  # all minimal, then the last whole
    peak = 10 * GIB
    monkeypatch.setenv(device_figures.MEMORY_ENV, json.dumps({"peak": peak, "limit": int((peak + room) / fit.HEADROOM)}))
    got += [_step(model, 1), _step(model, 2)]
    assert [policy_of(b).name for b in blocks[:2]] == ["minimal", "minimal"] and _kept(model) == [False, False, True]
    for want, have in zip(ref, got):
        for name in want:
            torch.testing.assert_close(have[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_remat_policy_fit_is_refused_where_it_cannot_choose():
    model = FSDP(_model(2), auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
                 activation_checkpointing=True, remat_policy="fit", checkpoint_all_but_last=1)
    x, _ = batch("gpt2", 0)
    with pytest.raises(ValueError, match=r"remat_policy=\"fit\" chooses .* drop checkpoint_all_but_last"):
        model(x.to(torch_xla.device()))
