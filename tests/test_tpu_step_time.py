"""The step-time projection walked over a scheduled (TPU-optimized style) program.

A hand-written scheduled module, in the syntax libtpu prints its optimized
programs in: one matmul fusion, an all-gather that is either asynchronous
(start, the fusion, done) or synchronous, and a synchronous all-reduce.
Expected times are computed here from the chip's published figures and the
cost rules `xla_fsdp.tpu.step_time` states (roofline compute, ring bytes at
two links, a latency per collective), so a change in either the parser or
the clock walk fails a test.
"""
from __future__ import annotations

import pytest

from xla_fsdp.tpu import chips, optimized_hlo as oh, step_time as st

N = 4  # devices in the replica group
M, K, SHARD = 256, 512, 128
BF16 = 2


def program(asynchronous: bool) -> str:
    gather = (f"  %ags = (bf16[{SHARD},{K}]{{1,0}}, bf16[{K},{K}]{{1,0}}) all-gather-start(%s), "
              f"replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}\n"
              f"  %f = bf16[{M},{K}]{{1,0}} fusion(%x, %w), kind=kOutput, calls=%fused_dot\n"
              f"  %g = bf16[{K},{K}]{{1,0}} all-gather-done(%ags)\n") if asynchronous else (
              f"  %g = bf16[{K},{K}]{{1,0}} all-gather(%s), replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}\n"
              f"  %f = bf16[{M},{K}]{{1,0}} fusion(%x, %w), kind=kOutput, calls=%fused_dot\n")
    return f"""HloModule scheduled, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%fused_dot (p0: bf16[{M},{K}], p1: bf16[{K},{K}]) -> bf16[{M},{K}] {{
  %p0 = bf16[{M},{K}]{{1,0}} parameter(0)
  %p1 = bf16[{K},{K}]{{1,0}} parameter(1)
  ROOT %d = bf16[{M},{K}]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

ENTRY %main (x: bf16[{M},{K}], w: bf16[{K},{K}], s: bf16[{SHARD},{K}]) -> (bf16[{M},{K}], bf16[{K},{K}]) {{
  %x = bf16[{M},{K}]{{1,0}} parameter(0)
  %w = bf16[{K},{K}]{{1,0}} parameter(1)
  %s = bf16[{SHARD},{K}]{{1,0}} parameter(2)
{gather}  %r = bf16[{M},{K}]{{1,0}} all-reduce(%f), replica_groups={{{{0,1,2,3}}}}, to_apply=%add
  ROOT %t = (bf16[{M},{K}]{{1,0}}, bf16[{K},{K}]{{1,0}}) tuple(%r, %g)
}}
"""


CHIP = chips.CHIPS["v4"]
FUSION_FLOPS = 2.0 * M * K * K
FUSION_BYTES = (M * K + K * K + M * K) * BF16           # both operands read, the result written
FUSION_S = max(FUSION_FLOPS / CHIP.peak_bf16_flops, FUSION_BYTES / CHIP.hbm_bytes_per_s)
GATHER_SENT = (N - 1) / N * K * K * BF16                # (n-1)/n of the gathered result
REDUCE_SENT = 2 * (N - 1) / N * M * K * BF16            # 2(n-1)/n of the operand
LINK = st.RING_LINKS * CHIP.ici_link_one_way
GATHER_S = st.COLLECTIVE_LATENCY_S + GATHER_SENT / LINK
REDUCE_S = st.COLLECTIVE_LATENCY_S + REDUCE_SENT / LINK


def test_collectives_are_read_with_their_group_and_what_runs_beside_them():
    found = oh.collectives(program(asynchronous=True))
    assert [(c.kind, c.asynchronous, c.group_size) for c in found] == \
        [("all-gather", True, N), ("all-reduce", False, N)]
    gather = found[0]
    assert gather.beside == 1 and gather.beside_matmuls == 1 and gather.done_position == gather.position + 2
    assert gather.beside_compute == 1
    summary = oh.summarize(found, devices=8)  # the group (4), not the program's devices, sets the ring
    assert summary["sent_per_chip"] == pytest.approx(GATHER_SENT + REDUCE_SENT)
    assert summary["sent_async_with_matmul_fraction"] == pytest.approx(GATHER_SENT / (GATHER_SENT + REDUCE_SENT))
    assert summary["sent_async_with_compute_fraction"] == pytest.approx(GATHER_SENT / (GATHER_SENT + REDUCE_SENT))


def test_compute_beside_a_collective_counts_fusions_but_not_copies_or_other_collectives():
    """An elementwise fusion between start and done is compute beside the gather (not a matmul);
    a copy or another collective's start is not."""
    elementwise = program(asynchronous=True).replace(
        "kind=kOutput, calls=%fused_dot\n  %g", "kind=kLoop, calls=%fused_add\n  %g").replace(
        "ENTRY", "%fused_add (p0: bf16[256,512], p1: bf16[512,512]) -> bf16[256,512] {\n"
        "  %p0 = bf16[256,512]{1,0} parameter(0)\n  ROOT %n = bf16[256,512]{1,0} negate(%p0)\n}\n\nENTRY")
    gather = oh.collectives(elementwise)[0]
    assert (gather.beside, gather.beside_matmuls, gather.beside_compute) == (1, 0, 1)
    copying = program(asynchronous=True).replace(
        "fusion(%x, %w), kind=kOutput, calls=%fused_dot\n  %g", "copy(%x)\n  %g")
    gather = oh.collectives(copying)[0]
    assert (gather.beside_matmuls, gather.beside_compute) == (0, 0)


def test_synchronous_collectives_block_the_core():
    e = st.estimate(program(asynchronous=False), CHIP, devices=N)
    assert e.flops == pytest.approx(FUSION_FLOPS) and e.hbm_bytes == pytest.approx(FUSION_BYTES)
    assert e.compute_seconds == pytest.approx(FUSION_S)
    assert e.sync_collective_seconds == pytest.approx(GATHER_S + REDUCE_S)
    assert e.seconds == pytest.approx(FUSION_S + GATHER_S + REDUCE_S)
    assert e.async_collective_seconds == 0 and e.exposed_async_seconds == 0


def test_an_asynchronous_collective_hides_the_compute_between_start_and_done():
    e = st.estimate(program(asynchronous=True), CHIP, devices=N)
    assert e.async_collective_seconds == pytest.approx(GATHER_S)
    assert e.sync_collective_seconds == pytest.approx(REDUCE_S)
    # the gather outlasts the fusion beside it: the core waits the difference at the done
    assert e.exposed_async_seconds == pytest.approx(GATHER_S - FUSION_S)
    assert e.seconds == pytest.approx(max(GATHER_S, FUSION_S) + REDUCE_S)
    sync = st.estimate(program(asynchronous=False), CHIP, devices=N)
    assert sync.seconds - e.seconds == pytest.approx(FUSION_S)
    assert e.as_dict()["label"] == "projection"


def test_calibration_scales_by_the_reference_ratio():
    ratio, scaled = st.calibrated(2.0, reference_projected=4.0, reference_measured=5.0)
    assert ratio == pytest.approx(1.25) and scaled == pytest.approx(2.5)


def test_calibration_point_is_the_blogs_program():
    """The shipped ratio is the blog's 4.191 s over the recorded projection of the program the blog
    ran (FSDPv1 2B v4-8 with eager attention), and the bench tables calibrate by that row only: an
    FSDPv1 row with SDPA attention (a program the blog never ran) must not calibrate."""
    import json
    import os

    from bench_modules import BENCH, load

    with open(os.path.join(BENCH, "results", "calibration_2b_v4-8_2026-11-27.json")) as f:
        rows = json.load(f)  # the blog's program compiled under today's model
    eager = [r for r in rows if (r["engine"], r["model"], r["tpu"], r["attn"]) == ("fsdpv1", "2b", "v4-8", "eager")]
    assert len(eager) == 1
    assert st.CALIBRATION_RATIO == pytest.approx(4.191 / eager[0]["projected_s"], rel=1e-4)

    table = load("tpu_perf_table")
    sdpa = dict(eager[0], attn=table.DEFAULT_ATTN, projected_s=4.048)
    ratio, source = table.calibrate([sdpa])
    assert ratio == st.CALIBRATION_RATIO and "step_time" in source
    ratio, source = table.calibrate([sdpa, dict(eager[0], projected_s=4.0)])
    assert ratio == pytest.approx(4.191 / 4.0) and "this run" in source
    # the fused output loss is not the blog's program either: its FSDPv1 eager row does not calibrate
    ratio, source = table.calibrate([dict(eager[0], projected_s=4.0, loss="fused")])
    assert ratio == st.CALIBRATION_RATIO and "step_time" in source
    assert table.loss_of(eager[0]) == "transformers"  # rows from before --loss: transformers' loss


@pytest.mark.parametrize("lhs,rhs,out,window,labels,flops", [
    # a batched matmul (768 = batch x heads) written as a convolution whose window spans the batch,
    # dilated so that each output reads one position: 768 x [1024,1024] @ [1024,128]
    ("bf16[768,1024,1024]", "bf16[768,128,1024]", "f32[768,1024,128]", "size=768 stride=767 lhs_dilate=768",
     "0bf_0oi->0bf", 2 * 768 * 1024 * 128 * 1024),
    # an outer-product-like one: the lhs's second spatial extent is 1, the rest of the window padding
    ("bf16[32,1024,128,1]", "bf16[1,128,128,24]", "bf16[32,1024,24,128]", "size=1x24 pad=0_0x23_23",
     "0bf1_1oi0->0b1f", 2 * 32 * 1024 * 24 * 128 * 128),
    # a plain matmul with no window
    ("bf16[512,256]", "bf16[256,64]", "bf16[512,64]", "", "bf_io->bf", 2 * 512 * 64 * 256),
])
def test_convolution_flops_count_only_the_windows_real_inputs(lhs, rhs, out, window, labels, flops):
    win = f", window={{{window}}}" if window else ""
    ins = oh.Instruction("c", out, "convolution", f"%a, %b){win}, dim_labels={labels}")
    assert st._matmul_flops(ins, {"a": lhs, "b": rhs}) == flops


def test_a_collective_over_a_whole_torus_sends_on_two_links_per_wrapped_axis():
    """[Note: links per collective]: on a torus (v4-128 and up: 3 wrapped axes) a collective over
    every device runs on 6 links, one over part of the slice (here 4 of 8 devices) on 2; a mesh
    (torus_axes=0) charges 2 links for both."""
    whole = st.estimate(program(asynchronous=False), CHIP, devices=N, torus_axes=3)
    torus_link = 3 * st.RING_LINKS * CHIP.ici_link_one_way
    want = [st.COLLECTIVE_LATENCY_S + sent / torus_link for sent in (GATHER_SENT, REDUCE_SENT)]
    assert whole.sync_collective_seconds == pytest.approx(sum(want))
    assert whole.seconds == pytest.approx(FUSION_S + sum(want))
    part = st.estimate(program(asynchronous=False), CHIP, devices=2 * N, torus_axes=3)
    assert part.sync_collective_seconds == pytest.approx(GATHER_S + REDUCE_S)
    mesh = st.estimate(program(asynchronous=False), CHIP, devices=N, torus_axes=0)
    assert mesh.sync_collective_seconds == pytest.approx(GATHER_S + REDUCE_S)


@pytest.mark.parametrize("name,axes", [("v4-8", 0), ("v4-64", 0), ("v4-128", 3), ("v4-256", 3), ("v4-512", 3),
                                       ("v5e-8", 0), ("v5e-256", 0)])
def test_slices_of_whole_v4_cubes_are_tori(name, axes):
    from xla_fsdp.tpu import topology

    assert topology.parse_accelerator_type(name).torus_axes == axes


def test_a_permute_on_a_torus_keeps_two_links():
    """A collective-permute sends to one neighbour: no more links on a torus."""
    permute = oh.Collective(kind="collective-permute", name="cp", bytes=1 << 20, asynchronous=False, position=0)
    assert st.links(permute, 64, torus_axes=3) == st.RING_LINKS
    gather = oh.Collective(kind="all-gather", name="ag", bytes=1 << 20, asynchronous=False, position=0)
    assert st.links(gather, 64, torus_axes=3) == 3 * st.RING_LINKS


def test_memory_space_prefetches_cost_the_core_nothing():
    """[Note: prefetches off the core]: libtpu's sliced prefetches (slice-start/slice-done into S(3))
    and copies (copy-start/copy-done) are DMAs beside the core; a plain slice still costs its bytes."""
    base = program(asynchronous=False)
    prefetch = ("  %ss = ((bf16[{K},{K}]{{1,0}}), bf16[64,{K}]{{1,0:S(3)}}, s32[]{{:S(2)}}) slice-start(%w), "
                "slice={{[0:64], [0:{K}]}}\n  %sd = bf16[64,{K}]{{1,0:S(3)}} slice-done(%ss)\n"
                "  %cs = (bf16[{K},{K}]{{1,0:S(3)}}, bf16[{K},{K}]{{1,0}}, u32[]{{:S(2)}}) copy-start(%w)\n"
                "  %cd = bf16[{K},{K}]{{1,0:S(3)}} copy-done(%cs)\n").format(K=K)
    anchor = f"  %g = bf16[{K},{K}]{{1,0}} all-gather(%s)"
    assert anchor in base
    e = st.estimate(base.replace(anchor, prefetch + anchor), CHIP, devices=N)
    plain = st.estimate(base, CHIP, devices=N)
    assert e.seconds == pytest.approx(plain.seconds) and e.hbm_bytes == pytest.approx(plain.hbm_bytes)
    # the same region taken by a synchronous slice is charged on the core
    sliced = f"  %sl = bf16[64,{K}]{{1,0}} slice(%w), slice={{[0:64], [0:{K}]}}\n"
    assert st.estimate(base.replace(anchor, sliced + anchor), CHIP, devices=N).seconds > plain.seconds


SCANNED = """HloModule scanned, num_partitions=4

%cond (p: (u32[], f32[8,16])) -> pred[] {
  %p = (u32[], f32[8,16]) parameter(0)
  %gte = u32[] get-tuple-element(%p), index=0
  %c = u32[] constant(3)
  ROOT %lt = pred[] compare(%gte, %c), direction=LT
}

%body (q: (u32[], f32[8,16])) -> (u32[], f32[8,16]) {
  %q = (u32[], f32[8,16]) parameter(0)
  %i = u32[] get-tuple-element(%q), index=0
  %x = f32[8,16] get-tuple-element(%q), index=1
  %ag = f32[32,16] all-gather(%x), dimensions={0}, replica_groups={{0,1,2,3}}
  %one = u32[] constant(1)
  %j = u32[] add(%i, %one)
  %s = f32[8,16] slice(%ag), slice={[0:8], [0:16]}
  ROOT %t = (u32[], f32[8,16]) tuple(%j, %s)
}

ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16] parameter(0)
  %z = u32[] constant(0)
  %init = (u32[], f32[8,16]) tuple(%z, %a)
  %w = (u32[], f32[8,16]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8,16] get-tuple-element(%w), index=1
}
"""


def test_a_while_body_counts_once_per_trip():
    """scan_layers' loop: torch_xla writes no known_trip_count; the condition's bound is the count
    ([Note: collectives inside While loops])."""
    assert [(l["name"], l["trip_count"]) for l in oh.while_loops(SCANNED)] == [("w", 3)]
    assert oh.collectives(SCANNED) == []  # the entry itself holds none
    found = oh.all_collectives(SCANNED)
    assert [c.kind for c in found] == ["all-gather"] * 3 and all(not c.asynchronous for c in found)
    chip = chips.CHIPS["v4"]
    one = st.collective_seconds(found[0], 4, chip)
    est = st.estimate(SCANNED, chip, 4)
    assert est.sync_collective_seconds == pytest.approx(3 * one)
    assert est.seconds >= 3 * one
    unknown = SCANNED.replace("direction=LT", "direction=NE")
    assert oh.while_loops(unknown)[0]["trip_count"] is None and len(oh.all_collectives(unknown)) == 1


def _stack_reader(inner: str) -> str:
    """An entry fusion reading one layer of a (18, 64, 128) f32 stack through a fusion nested in
    it (`inner`: the nested computation's body), as a scanned backward's recompute reads its saved
    layer input, then a matmul with a (128, 128) weight."""
    return f"""HloModule nested, is_scheduled=true

%inner (s: f32[18,64,128], i: s32[]) -> f32[64,128] {{
  %s = f32[18,64,128]{{2,1,0}} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
{inner}
}}

%outer (stack: f32[18,64,128], w: f32[128,128], k: s32[]) -> f32[64,128] {{
  %stack = f32[18,64,128]{{2,1,0}} parameter(0)
  %w = f32[128,128]{{1,0}} parameter(1)
  %k = s32[] parameter(2)
  %layer = f32[64,128]{{1,0}} fusion(%stack, %k), kind=kLoop, calls=%inner
  ROOT %d = f32[64,128]{{1,0}} dot(%layer, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

ENTRY %main (a: f32[18,64,128], b: f32[128,128], c: s32[]) -> f32[64,128] {{
  %a = f32[18,64,128]{{2,1,0}} parameter(0)
  %b = f32[128,128]{{1,0}} parameter(1)
  %c = s32[] parameter(2)
  ROOT %f = f32[64,128]{{1,0}} fusion(%a, %b, %c), kind=kOutput, calls=%outer
}}
"""


def test_a_slice_taken_inside_a_nested_fusion_reads_only_the_slice():
    """A scanned layer's saved input is a dynamic-slice of the stack of every layer's, fused into
    a fusion inside the matmul's: the matmul reads one layer, not 18 (before: 18, which made the
    collectives engine's scanned 2B project 1.08x the unscanned step instead of 1.015x)."""
    f32 = 4
    layer, weight, out, index = 64 * 128 * f32, 128 * 128 * f32, 64 * 128 * f32, 4
    sliced = _stack_reader("  ROOT %ds = f32[1,64,128]{2,1,0} dynamic-slice(%s, %i, %z, %z), "
                           "dynamic_slice_sizes={1,64,128}")
    assert st.estimate(sliced, CHIP).hbm_bytes == pytest.approx(layer + weight + index + out)
    # the same nested fusion reading the whole stack (a sum over the layers) is charged all of it
    whole = _stack_reader("  %zero = f32[] constant(0)\n  ROOT %sum = f32[64,128]{1,0} reduce(%s, %zero), "
                          "dimensions={0}, to_apply=%add")
    whole = whole.replace("%inner (", "%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n"
                          "  %y = f32[] parameter(1)\n  ROOT %xy = f32[] add(%x, %y)\n}\n\n%inner (", 1)
    assert st.estimate(whole, CHIP).hbm_bytes == pytest.approx(18 * layer + weight + index + out)


def test_an_unwritten_buffer_costs_nothing_and_zeros_cost_their_write():
    """[Note: the loop's output buffers]: libtpu's AllocateBuffer writes nothing; a broadcast of
    zeros of the same shape is charged its bytes."""
    shape = "bf16[18,32,1024,64]{3,2,1,0}"
    allocate = oh.Instruction("buf", shape, "custom-call", '%seed), custom_call_target="AllocateBuffer"')
    zeros = oh.Instruction("buf", shape, "broadcast", "%zero), dimensions={}")
    shapes = {"seed": "bf16[]", "zero": "bf16[]"}
    assert st._compute_cost(allocate, shapes, {}, CHIP) == (0.0, 0.0, 0.0)
    seconds, _, moved = st._compute_cost(zeros, shapes, {}, CHIP)
    assert moved >= 18 * 32 * 1024 * 64 * 2 and seconds > 0
