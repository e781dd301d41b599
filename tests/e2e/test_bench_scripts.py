"""kimi-bench's suites, run as a user runs them (`kimi-bench SUITE ...`, in this process through the
`cli` fixture; CPU dry runs on tiny shapes or a tiny real-format checkpoint): the options that change
what they load and delete, their one-line errors, and the suite list."""
import json
import os

import pytest

from checkpoints.synthetic import write_checkpoint
from kimi_jax.config import preset


def test_kimi_bench_lists_its_suites_and_refuses_an_unknown_one(cli):
    r = cli("launch.bench", "--help")
    assert r.returncode == 0
    for suite in ("int4", "mla", "engine", "throughput", "spec", "loading", "prefix_cache", "program_costs",
                  "full_depth", "gemv", "small_ops", "structured", "dtype", "lowering", "step_layout",
                  "layout_depth", "program_set", "invariance"):
        assert f"\n  {suite} " in r.stdout, suite
    assert cli("launch.bench").stdout == r.stdout                # no suite: the list
    bad = cli("launch.bench", "nosuch")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "kimi-bench: error: unknown suite 'nosuch' (suites: int4, mla, engine, throughput, spec, loading, "
        "prefix_cache, program_costs, full_depth, gemv, small_ops, constrained, structured, dtype, lowering, "
        "step_layout, invariance, layout_depth, program_set)"]
    # a suite's --help: its own flags, exit 0
    r = cli("launch.bench", "loading", "--help")
    assert r.returncode == 0 and "--orbax-dir" in r.stdout and "--raw-workers" in r.stdout


def test_load_bench_deletes_the_source_only_when_asked_and_says_where_it_loads(tmp_path, cli):
    """--delete_source removes the safetensors checkpoint after the load rounds and the orbax copy is
    still written and restored from the model in memory; the run names the device it loaded onto."""
    src, orbax, report = str(tmp_path / "ck"), str(tmp_path / "orbax"), str(tmp_path / "load.md")
    write_checkpoint(src, preset("tiny"), seed=1)
    r = cli("launch.bench", "loading", "--model", src, "--orbax_dir", orbax, "--rounds", "1", "--nodrop_caches",
             "--delete_source", "--keep", "--report", report)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not os.path.exists(src)
    assert "-> " in r.stdout and "cpu" in r.stdout.lower().split("-> ")[1].split("\n")[0].lower()
    res = json.load(open(report.replace(".md", ".json")))
    assert res["orbax_restore"]["bytes"] == res["orbax_save"]["bytes"] > 0
    assert os.path.isfile(os.path.join(orbax, "config.json"))   # written from the config, source gone


def test_load_bench_times_the_finite_check_both_ways_in_alternating_order(tmp_path, cli):
    src, report = str(tmp_path / "ck"), str(tmp_path / "load.md")
    write_checkpoint(src, preset("tiny"), seed=1)
    r = cli("launch.bench", "loading", "--model", src, "--rounds", "2", "--nodrop_caches", "--finite_check",
            "both", "--report", report)
    assert r.returncode == 0, r.stderr[-2000:]
    out = [line for line in r.stdout.splitlines() if line.startswith("round ") and "load_model" in line]
    assert ["without" in line for line in out] == [True, False, False, True], out   # nocheck first, then last
    res = json.load(open(report.replace(".md", ".json")))
    for row in res["rounds"]:
        assert row["nocheck_s"] > 0 and row["load_s"] > 0 and row["check_cost"] == row["load_s"] / row["nocheck_s"] - 1
    costs = [1 + row["check_cost"] for row in res["rounds"]]
    assert abs(1 + res["check_cost"] - (costs[0] * costs[1]) ** 0.5) < 1e-9
    assert "the check costs" in r.stdout


def test_bench_engine_loads_a_checkpoint_under_each_layout(tmp_path, cli):
    """--checkpoint streams a real-format checkpoint onto every layout's devices (the first 2 devices)
    instead of making random weights; each row is also appended as it finishes."""
    src, out = str(tmp_path / "ck"), str(tmp_path / "out")
    write_checkpoint(src, preset("tiny"), seed=2)
    r = cli("launch.bench", "engine", "--checkpoint", src, "--tiny", "--layouts", "single,tp2_ep",
             "--batches", "1", "--multi_batches", "2", "--steps", "1", "--mixed", "3:40:5", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count(f"loaded from {src}") == 2
    rows = [json.loads(line) for line in open(os.path.join(out, "engine_rows.partial.jsonl"))]
    assert [(x["layout"], x["batch"]) for x in rows] == [("TP1", 1), ("TP2+EP", 2)]
    # --mixed: the engine's decode step on one long row among short ones, first layout only (on CPU
    # the XLA path runs, so the engine keeps the rows schedule: chosen None)
    mixed = json.load(open(os.path.join(out, "engine_rows.json")))["mixed"]
    assert [(m["layout"], m["mixed"], m["chosen"]) for m in mixed] == [("TP1", "3:40:5", None)]
    assert all(m["engine_ms"] > 0 and m["rows_ms"] > 0 for m in mixed)


def test_throughput_agreement(tool_module):
    """throughput.agreement: identical requests, first differing positions, common-prefix share."""
    agreement = tool_module("launch.bench.throughput").agreement
    got = agreement([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]], [[1, 2, 3, 4], [5, 6, 0, 0], [1, 9]])
    assert got == dict(identical=1, requests=3, first_token_equal=2, first_difference=[None, 2, 0],
                       mean_prefix=(1.0 + 0.5 + 0.0) / 3)


@pytest.mark.slow
def test_throughput_rows_per_prefill_chunk(tool_module):
    """throughput_rows at two prefill_chunk values on one model: the default resolves to LLM's (256
    on CPU), both give the same greedy tokens, smaller chunks take more steps, and the latency columns
    are filled (TTFT p50 <= max; every request has several tokens, so TPOT too)."""
    tp = tool_module("launch.bench.throughput")
    format_rows, throughput_rows = tp.format_rows, tp.throughput_rows
    rows = throughput_rows("tiny", [2], gen_tokens=4, dtype="float32", min_prompt=20, max_prompt=60,
                           prefill_chunks=(8, None), num_gpu_blocks_override=64)
    assert [r["prefill_chunk"] for r in rows] == [8, 256]
    assert rows[0]["outputs"] == rows[1]["outputs"] and rows[0]["steps"] > rows[1]["steps"]
    for r in rows:
        assert 0 < r["ttft_p50_ms"] <= r["ttft_max_ms"] and 0 < r["tpot_p50_ms"] <= r["tpot_max_ms"]
    assert "TTFT p50/max ms" in format_rows(rows)


def test_bench_mla_profile_lists_each_cases_device_ops(tmp_path, cli):
    """--profile traces a few calls of the engine's op per case and writes each op's device time per
    call with the call's span and the GPU's clock / power while it ran (the CPU run exercises the script:
    interpret-mode kernels, no nvidia-smi); a malformed case is a one-line error naming it."""
    out = str(tmp_path / "out")
    r = cli("launch.bench", "mla", "--dry", "--profile=2:256:8:triton", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]
    prof = [x for x in rows if x.get("section") == "profile"]
    assert [(x["B"], x["ctx"], x["N"], x["kernel"]) for x in prof] == [(2, 256, 8, "triton")]
    assert prof[0]["ops_us"] and prof[0]["busy_us"] > 0 and prof[0]["span_us"] > 0
    assert "profile B=2 ctx=256 N=8 kernel=triton: span" in r.stdout
    # the table divides by the copy measured by device time in the same run
    dev_copy = [x for x in rows if x.get("section") == "copy_device"]
    assert len(dev_copy) == 1 and dev_copy[0]["copy_bps"] > 0
    table = open(os.path.join(out, "profile_table.md")).read()
    assert table.startswith("copy by device time") and "| 2 | 256 | 8 | triton | " in table
    # the GPU's clock / power while each case ran (kimi_jax.tools.telemetry): none on a CPU machine
    assert table.splitlines()[2].endswith("| SM clock, power while timed |") and table.rstrip().endswith("| - |")
    assert prof[0]["gpu"] == {}
    bad = cli("launch.bench", "mla", "--dry", "--profile=2:256", "--out", out)
    assert bad.returncode != 0 and "--profile=2:256: want B:context:heads[:kernel]" in bad.stderr
    bad = cli("launch.bench", "mla", "--dry", "--profile=2:256:8:cuda", "--out", out)
    assert bad.returncode != 0 and "--profile=2:256:8:cuda: kernel one of auto, triton" in bad.stderr


def test_bench_mla_decode_times_each_page_order_against_the_higher_copy(tmp_path, cli):
    """The decode section runs each case once per --table_orders entry, measures the copy ceiling at
    the start and the end and divides by the higher of the two; an unknown order fails before any
    work, in one line naming it. (CPU, --dry: this checks the script, not the speed.)"""
    out = str(tmp_path / "out")
    r = cli("launch.bench", "mla", "--dry", "--noprefill", "--heads=8", "--batches=2", "--contexts=64",
             "--check_cases=8:1:16", "--table_orders=sequential,interleaved", "--layer_loop=scan", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]
    copies = [x for x in rows if x.get("section") == "copy"]
    assert [x["when"] for x in copies] == ["start", "end"]
    dec = [x for x in rows if x.get("section") == "decode"]
    assert [x["table_order"] for x in dec] == ["sequential", "interleaved"]
    table = open(os.path.join(out, "table.md")).read()
    assert f"copy {max(x['copy_bps'] for x in copies) / 1e9:.0f} GB/s" in table
    assert "| 2 | 64 | 8 | 16 | sequential |" in table and "| 2 | 64 | 8 | 16 | interleaved |" in table
    bad = cli("launch.bench", "mla", "--dry", "--table_orders=zigzag", "--out", out)
    assert bad.returncode != 0 and "--table_orders: 'zigzag' is not random" in bad.stderr
    assert "copy (start)" not in bad.stdout


def test_bench_mla_tables_are_row_orders(tool_module):
    """_table: distinct pages; sequential = one run per row; interleaved = page j of row b is j B + b."""
    import jax
    import numpy as np
    bench_mla = tool_module("launch.bench.mla")
    for order in ("random", "sequential", "interleaved"):
        t = np.asarray(bench_mla._table(jax.random.PRNGKey(0), 3, 4, 20, order))
        assert t.shape == (3, 4) and len(set(t.ravel())) == 12 and t.max() < 20
    np.testing.assert_array_equal(bench_mla._table(None, 2, 3, 6, "sequential"), [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(bench_mla._table(None, 2, 3, 6, "interleaved"), [[0, 2, 4], [1, 3, 5]])


def test_bench_int4_bad_sweep_layout_is_a_one_line_error(tmp_path, cli):
    """--sweep_layouts takes i16 / i32 only and says so before any section runs (exit 2, one line)."""
    bad = cli("launch.bench", "--suite=int4", "--dry", "--sweep_layouts=i32,i4", "--out", str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "kimi-bench int4: error: --sweep_layouts: 'i4' is not i16 or i32"]
    assert "== section" not in bad.stdout


@pytest.mark.parametrize("suite,spec,msg", [
    ("mla", "8:4096:64", "is not B:long:short:heads (four integers)"),
    ("mla", "1:4096:64:8", "needs B >= 2, 0 <= short <= long, heads >= 1"),
    ("engine", "8:100:200", "needs B >= 2 and 0 <= short <= long"),
    ("engine", "8:x:1", "is not B:long:short (three integers)"),
])
def test_bad_mixed_case_is_a_one_line_error_before_any_work(tmp_path, cli, suite, spec, msg):
    """--mixed cases are checked before any section / engine starts, and the error names the case."""
    extra = ["--dry", "--noprefill"] if suite == "mla" else ["--tiny"]
    bad = cli("launch.bench", suite, *extra, f"--mixed={spec}", "--out", str(tmp_path))
    assert bad.returncode != 0 and f"--mixed: {spec!r} {msg}" in bad.stderr, bad.stderr[-500:]
    assert "copy (start)" not in bad.stdout and "device:" not in bad.stdout


def test_bench_mla_prefill_only_times_chunks_after_cached_tokens(tmp_path, cli):
    """--prefill_only: the fresh-prefill rows and the chunk-after-cached-tokens rows (einsum path vs the
    masked call; on CPU the cuDNN request falls back to einsums with a warning), nothing else."""
    r = cli("launch.bench", "mla", "--dry", "--prefill_only", "--reps=1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "prefill chunk B=3 prefix=64 T=16 einsum" in out and "prefill chunk B=3 prefix=64 T=16 cudnn" in out
    assert "decode page" not in out and "check N=" not in out


def test_bench_sweep_tables_build(tool_module):
    """Every config list of the int4 suite's two sweep tables is built when any one is asked for, so one
    entry with a field its config class lacks breaks the whole table: both tables build and hold their
    config classes."""
    from pallas_kernels.int4.matmul import Int4MatmulConfig as D
    from pallas_kernels.int4.moe_gmm import MoeGmmConfig as M
    bench = tool_module("launch.bench.int4")
    assert all(c is None or isinstance(c, D) for _, c in bench.dense_sweep("default"))
    assert all(c is None or isinstance(c, M) for _, c in bench.moe_sweep("t1_device"))


def _int4_bench_rows(cli, out, *args):
    """Run `kimi-bench int4 --dry` with args (CPU); its results.jsonl rows."""
    r = cli("launch.bench", "int4", "--dry", "--reps=1", "--nobaselines", *args, "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]


@pytest.mark.slow
def test_bench_moe_profile_records_device_time_per_kernel(tmp_path, cli):
    """bench --moe_profile (dry shapes, CPU): each timed i32 config gets a moe_profile record with its
    ops' device time per call (positive), their sum and the span; i16 timings are not profiled."""
    rows = _int4_bench_rows(cli, str(tmp_path / "mp"), "--sections=moe", "--batches=1", "--moe_configs=small",
                            "--rotations=2", "--moe_profile")
    prof = [x for x in rows if x.get("section") == "moe_profile"]
    timed = [x for x in rows if x.get("section") == "moe" and "t" in x]
    assert [x["layout"] for x in timed] == ["i16", "i32"] and len(prof) == 1
    # each timed row carries the GPU's clock / power while it ran (none on a CPU machine), and so
    # does the table's last column
    assert all(x["gpu"] == {} for x in timed)
    table = open(os.path.join(str(tmp_path / "mp"), "table.md")).read().splitlines()
    assert table[0].endswith("| SM clock, power while timed |") and table[2].endswith("| - |")
    p = prof[0]
    assert p["case"] == "moe T=1" and p["ops_us"] and all(v > 0 for v in p["ops_us"].values())
    assert p["busy_us"] == pytest.approx(sum(p["ops_us"].values())) and p["span_us"] > 0


def test_bench_rejects_fewer_experts_than_top_k(tmp_path, cli):
    """--moe_experts below top-8 (and --moe_held_pairs above it) is a one-line usage error naming the flag,
    before any section runs."""
    r = cli("launch.bench", "int4", "--moe_experts=4", "--out", str(tmp_path))
    assert r.returncode != 0 and "--moe_experts=4: fewer routed experts than top-8" in r.stderr
    r = cli("launch.bench", "int4", "--moe_held_pairs=9", "--out", str(tmp_path))
    assert r.returncode != 0 and "--moe_held_pairs=9: not between 0 (all) and 8" in r.stderr
    assert not os.path.exists(tmp_path / "results.jsonl")


def test_bench_moe_held_pairs_times_the_expert_parallel_share(tmp_path, cli):
    """--moe_held_pairs=1 (EP8 at batch 1): each token keeps one held pair, the others get the skipped id,
    so one expert per token is touched and the roofline counts only its bytes; baselines are skipped."""
    rows = _int4_bench_rows(cli, str(tmp_path / "ep"), "--sections=moe", "--batches=2", "--moe_configs=small",
                            "--rotations=2", "--moe_held_pairs=1", "--sweep_layouts=i32", "--baselines")
    timed = [x for x in rows if x.get("section") == "moe" and "t" in x]
    assert {x["case"] for x in timed} == {"moe T=2 held=1/8"} and {x["impl"] for x in timed} == {"pallas"}
    assert all(1 <= x["touched"] <= 2 for x in timed)          # 2 tokens, one held expert each


def test_bench_dense_profile_records_device_time_per_call(tmp_path, cli):
    """bench --dense_profile (dry shapes, CPU): each timed i32 dense config gets a dense_profile record
    (per-op device time, the span per call), and so do each shape's same-size copy and read (the floor
    of any op moving those bytes); the i16 timings are not profiled."""
    rows = _int4_bench_rows(cli, str(tmp_path / "dp"), "--sections=dense", "--ms=1", "--dense_configs=small",
                            "--num_mats=2", "--dense_profile")
    prof = [x for x in rows if x.get("section") == "dense_profile"]
    assert [(x["case"], x["config"]) for x in prof] == [
        ("dense gate_up", "copy_same_size"), ("dense gate_up", "read_same_size"), ("dense gate_up M=1", "default"),
        ("dense down", "copy_same_size"), ("dense down", "read_same_size"), ("dense down M=1", "default")]
    assert all(x["ops_us"] and x["span_us"] > 0 for x in prof)
    assert [x["impl"] for x in rows if x.get("section") == "dense" and x.get("impl", "").endswith("_size")] == [
        "copy_same_size", "read_same_size"] * 2


def test_bench_throughput_cli_compares_prefill_chunks(tmp_path, cli):
    """kimi-bench throughput --prefill_chunks: one table row per chunk size with the latency columns,
    and each later size's greedy tokens compared with the first's (identical on CPU in float32)."""
    r = cli("launch.bench", "throughput", "--model=tiny", "--num_layers=2", "--dtype=float32",
            "--batches=2", "--gen-tokens=3", "--min_prompt=20", "--max_prompt=60", "--max_model_len=80",
            "--num_pages=64", "--prefill-chunks=8,32", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TTFT p50/max ms" in r.stdout
    assert "batch 2 overlap True prefill_chunk 32 vs 8: {'identical': 8, 'requests': 8" in r.stdout


def test_prefix_cache_bench_computes_only_the_uncached_tokens(tmp_path, cli):
    """kimi-bench prefix_cache on a tiny workload: with caching on the shared-prefix requests compute
    only what is not cached, the distinct ones hit nothing, and on / off give the same tokens."""
    out = str(tmp_path / "pc.json")
    r = cli("launch.bench", "prefix_cache", "--requests", "3", "--prefix", "32", "--question", "8",
            "--gen_tokens", "2", "--max_num_seqs", "4", "--repeats", "1", "--json_out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {(x["workload"], x["caching"]): x for x in json.load(open(out))}
    assert rows["shared", False]["prefill_tokens_computed"] == rows["shared", False]["prompt_tokens"] == 3 * 40
    # the first request computes its 40 tokens; the others find the 32-token prefix (2 pages of 16)
    assert rows["shared", True]["cache_hit_tokens"] == 2 * 32
    assert rows["shared", True]["prefill_tokens_computed"] == 3 * 40 - 2 * 32
    assert rows["distinct", True]["cache_hit_tokens"] == 0
    assert rows["shared", True]["tokens_equal_off"] and rows["distinct", True]["tokens_equal_off"]
    assert rows["shared", True]["cache_s"] > 0 and rows["shared", False]["cache_s"] is None


@pytest.mark.slow
def test_bench_mla_check_schedules_runs_the_mosaic_gpu_op_on_both_schedules(tmp_path, cli):
    """--check_schedules (CPU: the Mosaic GPU interpreter, --dry's small batch): the served config on
    the rows and balanced schedules and one row alone under serving_config(1), each against the
    reference, one results.jsonl row per case; no copy measurement."""
    from pallas_kernels.mla import decode_mgpu as mg
    if mg.plgpu is None:
        pytest.skip("no jax.experimental.pallas.mosaic_gpu")
    r = cli("launch.bench", "mla", "--dry", "--check_schedules", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert [x["case"] for x in rows] == ["page=16 T=1 rows serving", "page=16 T=1 balanced serving",
                                         "page=16 T=1 row 1 (length 37) alone serving_config(1)"]
    assert all(x["ok"] and x["err"] < 3e-2 for x in rows)
    assert "schedules ALL OK" in r.stdout and "copy (start)" not in r.stdout


def test_bench_gemv_dry_times_every_projection_and_its_copy(tmp_path, cli):
    """kimi-bench gemv --dry (CPU, 1/16 of every dimension): one row per projection with the matmul's
    and the copy's kernel time (device time from a profiler trace), appended as it is measured."""
    r = cli("launch.bench", "gemv", "--dry", "--rows=1", "--max_copies=2", "--reps=1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "gemv_rows.jsonl")]
    assert len(rows) == 9 and rows[0]["case"] == "q_a 7168->1536" and rows[-1]["case"] == "shared down shard 256->7168"
    first = rows[0]
    assert (first["M"], first["N"], first["K"], first["copies"]) == (1, 1536 // 16, 7168 // 16, 2)
    assert all(x["gemv_kernels"] >= 1 and x["copy_kernels"] >= 1 for x in rows)
    assert "%copy span" in r.stdout


def test_bench_small_ops_smoke_times_each_variant_beside_xla(tmp_path, cli):
    """kimi-bench small_ops --smoke (CPU, tiny shapes, kernels interpreted): per T, the three routers and
    both norms' two variants, each with its kernels per call, device time, copy row and its difference
    from the XLA variant (none in the ids, float32 rounding in the weights, none in the norms here)."""
    r = cli("launch.bench", "small_ops", "--smoke", "--ops=router,add_rms_norm", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "small_ops_rows.jsonl")]
    assert [(x["op"], x["variant"], x["T"]) for x in rows] == [
        (op, v, T) for T in (1, 5) for op, vs in (("router", ("xla", "pallas", "pallas_gemv")),
                                                   ("add_rms_norm", ("xla", "pallas"))) for v in vs]
    assert all(x["kernels"] >= 1 and x["kernel_us"] > 0 and x["copy_kernel_us"] > 0 for x in rows)
    assert all(x["idx_diff"] == 0 and x["err"] <= 1e-6 for x in rows)
    assert "kernel us" in r.stdout


def test_bench_structured_dry_times_the_grammar_the_sampler_and_the_decode_step(tmp_path, cli):
    """kimi-bench structured --dry (the demo vocabulary only, no xgrammar): llguidance's compile per
    schema and mask fill per batch, the sampler with and without the mask, the decode step with and
    without a mask; the JSON result under --out."""
    r = cli("launch.bench", "structured", "--dry", "--batches=1,2", "--steps=1", "--reps=1", "--noxgrammar",
            "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.load(open(tmp_path / "structured.json"))
    ll = res["llguidance_demo_4096"]
    assert set(ll["compile_ms"]) == {"enum_flat", "nested", "arrays", "anyof_required"}
    assert set(ll["mask_ms"]) == {"1", "2"}
    assert set(res["sampling_step_ms"]) == {"V=4096,B=1", "V=4096,B=2"}
    assert set(res["decode_step_ms"]) == {"demo_4096,B=1", "demo_4096,B=2"}
    assert not any(k.startswith(("xgrammar", "llguidance_kimi")) for k in res)


def test_bench_dtype_rows(tmp_path, cli):
    """kimi-bench dtype: tokens/s end to end and the jitted step alone per dtype and batch, as JSON."""
    r = cli("launch.bench", "dtype", "--dtypes=float32", "--batches=2", "--tokens=3", "--prompt=4", "--reps=1",
            "--step_reps=1", "--out", str(tmp_path / "d.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.load(open(tmp_path / "d.json"))["rows"]
    assert [(x["dtype"], x["batch"]) for x in rows] == [("float32", 2)]
    assert rows[0]["tok_s"] > 0 and rows[0]["step_ms"] > 0


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_bench_spec_compares_speculation_off_and_on(tmp_path, cli, layout):
    """kimi-bench spec on a 2-layer tiny model (random weights, random prompts): one row per workload
    with speculation off and on, the same greedy tokens both ways, as JSON under --out; in either
    step layout."""
    r = cli("launch.bench", "spec", "--model=tiny", "--num_layers=2", "--batches=2", "--gen_tokens=4", "--reps=1",
            "--dtype=float32", "--max_model_len=256", f"--step_layout={layout}", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.load(open(tmp_path / "spec_rows.json"))["rows"]
    assert [(x["batch"], x["workload"], x["step_layout"]) for x in rows] == [
        (2, "repetitive", layout), (2, "non-repetitive", layout)]
    assert all(x["identical"] and x["tok_s_off"] > 0 and x["tok_s_on"] > 0 for x in rows)
    assert "| 2 | repetitive |" in r.stdout


def test_bench_lowering_tiny_lowers_each_program_over_shapes(tmp_path, cli):
    """kimi-bench lowering --tiny (CPU): one row per program and depth, trace and lowering seconds > 0."""
    r = cli("launch.bench", "lowering", "--tiny", "--layers=1,3", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "lowering_rows.jsonl")]
    assert [(x["program"], x["layers"]) for x in rows] == [(p, n) for n in (1, 3) for p in ("decode", "prefill", "chunk")]
    assert all(x["trace_s"] > 0 and x["lower_s"] > 0 and x["layer_weights"] == "per_layer" for x in rows)


def test_bench_program_set_counts_each_layout_and_rejects_a_bad_entry(tmp_path, cli):
    """kimi-bench program_set (no device work): the padded set grows with max_model_len and the
    prefill chunk, the ragged set with the token budget only; a malformed entry is one line."""
    r = cli("launch.bench", "program_set", "--limits=8:2048:16:128,8:8192:d:128", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {(x["plan"], x["max_model_len"]): x for x in json.load(open(tmp_path / "program_set.json"))["rows"]}
    gpu = rows["gpu", 2048]
    assert (gpu["padded"]["programs"], gpu["padded"]["whole"], gpu["ragged"]["programs"]) == (40, 28, 12)
    assert gpu["ragged"]["widths"] == [4, 8, 16, 32, 64, 128] and gpu["ragged"]["kinds"] == {
        "ragged forward": 8, "ragged sample": 4}
    assert rows["gpu", 8192]["prefill_chunk"] == 2048 and rows["cpu", 8192]["prefill_chunk"] == 256
    for plan in ("gpu", "cpu"):
        assert rows[plan, 8192]["padded"]["programs"] > rows[plan, 2048]["padded"]["programs"]
        assert rows[plan, 8192]["ragged"] == rows[plan, 2048]["ragged"]
    bad = cli("launch.bench", "program_set", "--limits=8:x", "--out", str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "kimi-bench program_set: error: --limits entry '8:x': expected SEQS:LEN[:CHUNK[:TOKENS]] of "
        "integers (CHUNK 'd': the default)"]


def test_bench_step_layout_dry_decodes_the_same_tokens_in_both_layouts(tmp_path, cli):
    """kimi-bench step_layout --child=decode --dry (the demo model, in this process): each case's
    steps and rates per layout, and the ragged step's greedy tokens equal the padded step's."""
    rows = {}
    for layout in ("padded", "ragged"):
        r = cli("launch.bench", "step_layout", "--child=decode", f"--layout={layout}", "--dry",
                "--seqs=2", "--model_len=128", "--out", str(tmp_path))
        assert r.returncode == 0, r.stderr[-2000:]
        rows[layout] = json.loads(r.stdout.strip().splitlines()[-1])
    for layout, row in rows.items():
        assert [c["case"] for c in row["cases"]] == ["batch 1", "batch 2", "mixed"]
        assert all(c["steps"] >= 4 and c["ms_per_step"] > 0 and c["out_tok_s"] > 0 for c in row["cases"])
        assert [c["output_tokens"] for c in row["cases"]] == [4, 8, 8]
    assert [c["tokens"] for c in rows["padded"]["cases"]] == [c["tokens"] for c in rows["ragged"]["cases"]]
    bad = cli("launch.bench", "step_layout", "--parts=first,nosuch", "--out", str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "kimi-bench step_layout: error: --parts: 'nosuch' is not one of first, precompile, generate, "
        "decode, serve"]


def test_bench_program_costs_tiny_times_every_case_with_its_compile(tmp_path, cli):
    """kimi-bench program_costs --tiny (CPU, tiny preset): one row per program case, each with its compile
    seconds and a positive step time; decode rows at every table width and each sampler variant."""
    r = cli("launch.bench", "program_costs", "--tiny", "--batches=1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "program_costs_rows.jsonl")]
    decode = [x for x in rows if x["kind"] == "decode"]
    assert {x["table"] for x in decode} == {16, 32}
    assert {(x.get("sampled", False), x.get("logprobs")) for x in decode} == {(False, None), (True, None), (True, 20)}
    assert any(x.get("fresh") for x in rows) and len(rows) == 7           # 4 decode, 2 chunk prefill, 1 fresh
    assert all(x["ms"] > 0 and x["compile_s"] > 0 for x in rows)


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_bench_constrained_splits_the_step_and_keeps_the_tokens(tmp_path, cli, layout):
    """kimi-bench constrained's CPU dry run, either step layout: the constrained batch overlaps
    every timed step (its steps split) and its tokens equal the synchronous path's; the bad-words
    rows overlap too."""
    r = cli("launch.bench", "constrained", "--tiny", "--batches=2", "--constrained=1", "--context=256",
            "--steps=3", "--repeats=1", f"--step_layout={layout}", "--out", str(tmp_path))
    assert r.returncode == 0, r
    rows = {row["mode"]: row for row in json.loads((tmp_path / "constrained.json").read_text())}
    assert set(rows) == {"unconstrained", "overlap", "sync", "bad_words"}
    assert rows["overlap"]["same_tokens"] and rows["overlap"]["overlapped_steps"] == 3
    assert rows["sync"]["overlapped_steps"] == 0 and rows["bad_words"]["overlapped_steps"] == 3


def test_bench_layout_depth_times_both_layouts_and_lists_their_kernels(tmp_path, cli):
    """kimi-bench layout_depth's CPU dry run: a row per layout and batch with its ms a step and
    its profiler census, `+invariant` with the switch on; a malformed layout is one line before any
    work."""
    r = cli("launch.bench", "layout_depth", "--tiny", "--layers=2", "--context=256", "--batches=1,2",
            "--steps=3", "--profile_steps=2", "--layouts=padded,ragged:balanced+invariant", "--out",
            str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [x for x in json.loads((tmp_path / "layout_depth.json").read_text()) if x["kind"] == "step"]
    assert [(x["layout"], x["batch"], x["batch_invariant"]) for x in rows] == [
        ("padded", 1, False), ("padded", 2, False), ("ragged:balanced+invariant", 1, True),
        ("ragged:balanced+invariant", 2, True)]
    for x in rows:
        assert x["ms_per_step"] > 0 and x["engine_steps"] >= 3 and x["kernels_per_step"] > 0
        assert x["top"] and x["busy_ms_per_step"] > 0
    for spec in ("padded:rows", "ragged+fast"):
        bad = cli("launch.bench", "layout_depth", "--tiny", f"--layouts={spec}")
        assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
            f"kimi-bench layout_depth: error: --layouts: {spec!r} is not padded, ragged or "
            "ragged:SCHEDULE, each with an optional +invariant"], bad.stderr


def test_bench_invariance_finds_no_mismatch_with_the_switch(tmp_path, cli, tiny_ckpt):
    """kimi-bench invariance's CPU dry run: with batch_invariant on, every request (greedy and
    seeded samples, alone and then in random batches with prefix-cache hits) gives the same bits;
    a row with its tokens/s."""
    r = cli("launch.bench", "invariance", "--model", tiny_ckpt, "--requests=5", "--max_tokens=3",
            "--max_num_seqs=3", "--max_prompt=24", "--settings=on", "--noprecompile", "--out",
            str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads((tmp_path / "invariance.json").read_text())
    assert row["batch_invariant"] and row["requests"] == 5 and row["batches"] >= 2
    assert row["mismatched"] == 0 and row["first_mismatch"] is None
    assert row["alone_tok_s"] > 0 and row["batched_tok_s"] > 0
