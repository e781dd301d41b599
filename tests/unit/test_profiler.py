"""The profiler on 8 simulated CPU devices: collectives counted from the compiled decode step (layer
loops x trip counts) match what the trace executes and what the planner's rules say for the layout."""
from __future__ import annotations

import json
import os
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.tools import planner
from kimi_jax.tools import profiling
from kimi_jax.config import preset
from kimi_jax.parallel.sharding import Layout

# 8 heads and 16 experts so tp=8 splits heads and EP over 8 devices holds 2 experts each; 4 layers
# (1 dense + 3 MoE) so that per-layer, per-MoE-layer and per-step collectives count differently
CFG = preset("tiny").replace(num_attention_heads=8, n_routed_experts=16, n_group=1, topk_group=1,
                             num_experts_per_tok=3, num_hidden_layers=4)
BATCH = 8


def rule(layout, batch=BATCH):
    return planner.collective_counts(planner.collective_plan(CFG, layout, batch, program="cpu"))


def wire_bytes(items, kind):
    """Bytes one step moves in `kind` collectives over groups of more than one device: count x bytes
    (planner specs) or executions x result bytes (compiled ops; for all-reduce and all-gather the
    result is the planner's buffer)."""
    total = 0
    for o in items:
        if o.kind == kind and not getattr(o, "trivial", False):
            total += (o.count if isinstance(o, planner.CollectiveSpec) else o.executions) * o.bytes
    return total


def png_rgb(path):
    """The pixels [h, w, 3] of an 8-bit RGB PNG without filters (what profiling writes); every chunk's CRC
    checked."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, header, idat = 8, None, b""
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(tag + body), tag
        if tag == b"IHDR":
            header = struct.unpack(">IIBB", body[:10])
        elif tag == b"IDAT":
            idat += body
        pos += 12 + n
    w, h, depth, colour = header
    assert (depth, colour) == (8, 2)
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    assert not rows[:, 0].any()                                   # filter 0 on every row
    return rows[:, 1:].reshape(h, w, 3)


def packed(img):
    """[h, w] uint32 0xRRGGBB of an [h, w, 3] image."""
    img = img.astype(np.uint32)
    return (img[..., 0] << 16) | (img[..., 1] << 8) | img[..., 2]


def is_colour(px, category):
    r, g, b = profiling.COLORS[category]
    return px == ((r << 16) | (g << 8) | b)


def colour_count(px, category):
    return int(is_colour(px, category).sum())


def test_chart_stacks_bars_in_proportion(tmp_path):
    """stacked_bar_png: each bar stacks its categories in CATEGORIES order, heights in proportion to the
    values (the legend swatches, drawn whatever the values, cancel against the same chart of empty bars).
    rel 3%: rectangles snap to whole pixel rows, at most one row of the ~80 a unit spans here, per rectangle."""
    bars = [("A", {"matmul": 3.0, "all-reduce": 1.0}), ("B", {"matmul": 1.0, "attention": 2.0})]
    full, empty = tmp_path / "full.png", tmp_path / "empty.png"
    full.write_bytes(profiling.stacked_bar_png(bars, "t"))
    empty.write_bytes(profiling.stacked_bar_png([(label, {}) for label, _ in bars], "t"))
    img, legend = packed(png_rgb(full)), packed(png_rgb(empty))
    area = {c: colour_count(img, c) - colour_count(legend, c) for c in profiling.CATEGORIES}
    totals = {c: sum(v.get(c, 0.0) for _, v in bars) for c in profiling.CATEGORIES}
    for c in profiling.CATEGORIES:
        assert area[c] == pytest.approx(area["all-reduce"] * totals[c] / totals["all-reduce"], rel=0.03), c
    # in bar A the all-reduce (earlier in CATEGORIES) sits below the matmul: larger row indices
    ar = is_colour(img, "all-reduce") & ~is_colour(legend, "all-reduce")
    mm = is_colour(img[:, np.flatnonzero(ar.any(0))], "matmul")
    assert np.flatnonzero(ar.any(1)).min() > np.flatnonzero(mm.any(1)).max()


@pytest.mark.parametrize("name,layout", [("tp8", Layout(8)), ("dp8_ep", Layout(1, 8, True))])
def test_profile_reports_the_compiled_collectives(tmp_path, name, layout):
    assert jax.device_count() >= 8
    engine = profiling.random_engine(CFG, layout, jnp.bfloat16)
    # the contiguous-cache reference step: the program the planner's CPU rule describes
    report = profiling.profile_decode(engine, layout, batch=BATCH, context=20, steps=2, out_dir=str(tmp_path),
                                      model_name="tiny8", warmup=1, paged=False)
    print("\n" + report.table())
    # the compiled program's counts, with the scan over layers unrolled by its trip count, are the planner's
    assert report.collectives_program == rule(layout)
    # and the trace executed exactly those ops (plus any over one-device groups) once per step and device
    for kind in profiling.COLLECTIVE_KINDS:
        expected = report.collectives_program[kind] + report.collectives_trivial[kind]
        assert report.collectives_trace[kind] == pytest.approx(expected), kind
    assert report.ms_per_step["matmul"] > 0 and report.ms_per_step["attention"] > 0
    assert sum(report.share.values()) == pytest.approx(1.0)
    assert len(report.per_step_ms) == 2
    # outputs: JSON, PNG, the HLO text and the raw trace for Perfetto
    data = json.load(open(tmp_path / "report.json"))
    assert data["collectives_program"] == report.collectives_program
    assert os.path.isfile(report.trace_file) and report.trace_dir.startswith(str(tmp_path))
    # the chart decodes to the size its header gives, and its busiest category has bars beside its legend
    # swatch: more of its colour than a category with no time (legend only)
    img = png_rgb(tmp_path / "breakdown.png")
    assert img.shape[1::-1] == profiling.read_png_size(str(tmp_path / "breakdown.png"))
    px = packed(img)
    busiest = max(report.ms_per_step, key=report.ms_per_step.get)
    idle = [c for c in profiling.CATEGORIES if not report.ms_per_step.get(c)]
    assert idle and colour_count(px, busiest) > colour_count(px, idle[0])
    ops = profiling.collectives_of_hlo(open(tmp_path / "decode_step.hlo.txt").read()).ops
    if name == "tp8":
        # the MoE layers' while loop (3 trips) holds the attention and MoE all-reduces: 2 ops, 6 executions
        in_loop = [o for o in ops if o.executions == CFG.num_moe_layers]
        assert sorted(o.kind for o in in_loop) == ["all-reduce", "all-reduce"]
        # 2 per layer + the embedding's; the logits are gathered once and sampled replicated (no sampler
        # collectives over a vocab-split array)
        assert report.collectives_program["all-reduce"] == 2 * 4 + 1
        assert report.collectives_program["all-gather"] == 1
        assert report.collectives_program["all-to-all"] == 0
        # bytes too: [B, D] partial sums (XLA:CPU sends the bf16 sums as f32) and the [B, V] f32 logits
        specs = planner.collective_plan(CFG, layout, BATCH, program="cpu")
        for kind in ("all-reduce", "all-gather"):
            assert wire_bytes(ops, kind) == wire_bytes(specs, kind), kind


@pytest.mark.parametrize("layout,batch", [(Layout(8, 1, True), BATCH), (Layout(4, 2, True), BATCH),
                                          (Layout(2, 4), BATCH), (Layout(8), 1)],
                         ids=lambda x: getattr(x, "name", x))
def test_compiled_counts_match_planner_rules(layout, batch):
    counts = profiling.count_decode_collectives(CFG, layout, batch, 32)
    assert counts.by_kind() == rule(layout, batch)
    specs = planner.collective_plan(CFG, layout, batch, program="cpu")
    assert wire_bytes(counts.ops, "all-reduce") == wire_bytes(specs, "all-reduce")
    if layout.enable_expert_parallel and layout.data_parallel_size == 1:
        # TP+EP with dp = 1: the MoE exchange skips the size-1 dp axis, so nothing runs over one-device groups
        assert counts.by_kind(trivial=True) == counts.by_kind()


HLO = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner_body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %ars = f32[4]{0} all-reduce-start(%x), replica_groups={{0,1}}, to_apply=%add
  %ard = f32[4]{0} all-reduce-done(%ars)
  ROOT %t = (s32[], f32[4]) tuple(%i, %ard)
}

%inner_cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %c = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%outer_body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %w = (s32[], f32[4]) while(%p), condition=%inner_cond, body=%inner_body
  %y = f32[4]{0} get-tuple-element(%w), index=1
  %ag = f32[8]{0} all-gather(%y), replica_groups=[4,2]<=[8], dimensions={0}
  ROOT %t = (s32[], f32[4]) tuple(%i, %y)
}

%outer_cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %w = (s32[], f32[4]) while(%init), condition=%outer_cond, body=%outer_body, \
backend_config={"known_trip_count":{"n":"3"}}
  %rs = bf16[2,7168]{1,0} reduce-scatter(%x), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %one = f32[4]{0} all-reduce(%x), replica_groups={{0},{1}}, to_apply=%add
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_hlo_parser_trip_counts_async_pairs_and_groups():
    counts = profiling.collectives_of_hlo(HLO)
    ops = {o.name: o for o in counts.ops}
    assert ops["ars"].executions == 15          # 3 outer trips (backend config) x 5 inner (condition constant)
    assert ops["ag"].executions == 3
    assert ops["rs"].executions == 1 and ops["rs"].bytes == 2 * 7168 * 2 and ops["rs"].group_size == 4
    assert ops["ag"].group_size == 2 and ops["ars"].group_size == 2
    assert "ard" not in ops                     # the -done half of an async pair is not a second op
    assert ops["one"].trivial                   # groups of one device move nothing
    assert counts.by_kind() == {"all-reduce": 15, "all-gather": 3, "reduce-scatter": 1, "all-to-all": 0,
                                "collective-permute": 0}
    assert counts.count("all-reduce", trivial=True) == 16


GPU_HLO = """HloModule jit__decode, is_scheduled=true

%fused_dot (p0: bf16[8,7168], p1: bf16[1024,7168]) -> bf16[8,1024] {
  %p0 = bf16[8,7168]{1,0} parameter(0)
  %p1 = bf16[1024,7168]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%fused_slice (p0: s32[60,64,7168,32]) -> s32[64,7168,32] {
  %p0 = s32[60,64,7168,32]{3,2,1,0} parameter(0)
  ROOT %ds = s32[64,7168,32]{2,1,0} dynamic-slice(%p0, %c, %c, %c, %c), dynamic_slice_sizes={1,64,7168,32}
}

ENTRY %main (x: bf16[8,7168]) -> bf16[8,1024] {
  %x = bf16[8,7168]{1,0} parameter(0)
  %gemm_fusion_dot.79 = bf16[8,1024]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %all-reduce.5 = f32[8,7168]{1,0} all-reduce(%y), replica_groups={{0,1}}, to_apply=%add
  %all-to-all.5 = f32[8,81920]{1,0} all-to-all(%z), replica_groups={{0,1}}, dimensions={1}
  %loop_dynamic_slice_fusion.32 = s32[64,7168,32]{2,1,0} fusion(%e), kind=kLoop, calls=%fused_slice
  ROOT %r = bf16[8,1024]{1,0} copy(%gemm_fusion_dot.79)
}
"""


def _gpu_trace(path, steps=2):
    """A trace shaped like JAX's on GPU (event names and args as seen on an H200): kernels on a stream
    of process /device:GPU:N, inside a CUDA-graph command buffer or not, plus stray input copies."""
    import gzip
    ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    t = 0.0
    for _ in range(steps):
        ev.append({"ph": "X", "pid": 1, "tid": 7, "ts": t, "dur": 2.0, "name": "MemcpyP2P",
                   "args": {"memcpy_details": "size:32"}})                               # no hlo_module: dropped
        for name, hlo_op, dur in (("gemm_fusion_dot_79", "command_buffer_6", 10.0),
                                  ("all_reduce_5_0_fusion_1", "all-reduce.5.0-fusion.1", 20.0),
                                  ("ncclDevKernel_SendRecv(x)", "all-to-all.5", 30.0),
                                  ("MemcpyD2D", "loop_dynamic_slice_fusion.32", 40.0),
                                  ("fusion_999", "command_buffer_6", 5.0)):
            t += 1.0
            ev.append({"ph": "X", "pid": 1, "tid": 8, "ts": t, "dur": dur, "name": name,
                       "args": {"hlo_module": "jit__decode", "hlo_op": hlo_op}})
            t += dur
        ev.append({"ph": "X", "pid": 2, "tid": 1, "ts": t, "dur": 5.0, "name": "host work", "args": {}})
        t += 1000.0                                                                        # the host waits
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return str(path)


def test_gpu_trace_events_map_to_instructions(tmp_path):
    module = profiling.parse_hlo(GPU_HLO)
    ms, per_step, coll, nd, top = profiling.analyze_trace(_gpu_trace(tmp_path / "t.trace.json.gz"), module, 2,
                                                          module_name="jit__decode")
    assert nd == 1 and len(per_step) == 2
    assert ms["matmul"] == pytest.approx(0.010)        # gemm_fusion_dot_79 -> gemm_fusion_dot.79 (a dot)
    assert ms["all-reduce"] == pytest.approx(0.020)    # the one-shot kernel names its all-reduce as a prefix
    assert ms["all-to-all"] == pytest.approx(0.030)
    assert ms["rest"] == pytest.approx(0.045)          # the per-layer weight copy and an unknown kernel
    assert coll == {"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 1, "collective-permute": 0}
    assert [round(sum(p.values()), 6) for p in per_step] == [0.105, 0.105]
    assert top[0]["op"] == "loop_dynamic_slice_fusion.32"


def test_profile_of_the_paged_serving_step(tmp_path):
    """The default profile times the step generation runs (paged cache). Under TP8 its collectives are
    the planner's; its trace executes exactly the compiled program's collectives; attention ops (the
    paged XLA path on CPU) are recognised as attention."""
    layout = Layout(8)
    engine = profiling.random_engine(CFG, layout, jnp.bfloat16)
    report = profiling.profile_decode(engine, layout, batch=BATCH, context=20, steps=2, out_dir=str(tmp_path),
                                      model_name="tiny8", warmup=1)
    assert report.notes[0].startswith("paged")
    assert report.collectives_program == rule(layout)
    for kind in profiling.COLLECTIVE_KINDS:
        assert report.collectives_trace[kind] == pytest.approx(
            report.collectives_program[kind] + report.collectives_trivial[kind]), kind
    assert report.ms_per_step["attention"] > 0 and report.ms_per_step["matmul"] > 0
