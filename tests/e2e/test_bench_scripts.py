"""The benchmark launchers' options that change what they load and delete, run as a user runs them
(fresh processes on the CPU, a tiny real-format checkpoint)."""
import json
import os
import subprocess
import sys

import pytest

from checkpoints.synthetic import write_checkpoint
from kimi_jax.config import preset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(module, *args, devices=1, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_load_bench_deletes_the_source_only_when_asked_and_says_where_it_loads(tmp_path):
    """--delete_source removes the safetensors checkpoint after the load rounds and the orbax copy is
    still written and restored from the model in memory; the run names the device it loaded onto."""
    src, orbax, report = str(tmp_path / "ck"), str(tmp_path / "orbax"), str(tmp_path / "load.md")
    write_checkpoint(src, preset("tiny"), seed=1)
    r = _run("launch.load_bench", "--model", src, "--orbax_dir", orbax, "--rounds", "1", "--nodrop_caches",
             "--delete_source", "--keep", "--report", report)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not os.path.exists(src)
    assert "-> " in r.stdout and "cpu" in r.stdout.lower().split("-> ")[1].split("\n")[0].lower()
    res = json.load(open(report.replace(".md", ".json")))
    assert res["orbax_restore"]["bytes"] == res["orbax_save"]["bytes"] > 0
    assert os.path.isfile(os.path.join(orbax, "config.json"))   # written from the config, source gone


def test_bench_engine_loads_a_checkpoint_under_each_layout(tmp_path):
    """--checkpoint streams a real-format checkpoint onto every layout's devices (2 simulated devices)
    instead of making random weights; each row is also appended as it finishes."""
    src, out = str(tmp_path / "ck"), str(tmp_path / "out")
    write_checkpoint(src, preset("tiny"), seed=2)
    r = _run("launch.bench_engine", "--checkpoint", src, "--tiny", "--layouts", "single,tp2_ep",
             "--batches", "1", "--multi_batches", "2", "--steps", "1", "--mixed", "3:40:5", "--out", out,
             devices=2)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count(f"loaded from {src}") == 2
    rows = [json.loads(line) for line in open(os.path.join(out, "engine_rows.partial.jsonl"))]
    assert [(x["layout"], x["batch"]) for x in rows] == [("TP1", 1), ("TP2+EP", 2)]
    # --mixed: the engine's decode step on one long row among short ones, first layout only (on CPU
    # the XLA path runs, so the engine keeps the rows schedule: chosen None)
    mixed = json.load(open(os.path.join(out, "engine_rows.json")))["mixed"]
    assert [(m["layout"], m["mixed"], m["chosen"]) for m in mixed] == [("TP1", "3:40:5", None)]
    assert all(m["engine_ms"] > 0 and m["rows_ms"] > 0 for m in mixed)


def test_throughput_agreement():
    """bench_throughput.agreement: identical requests, first differing positions, common-prefix share."""
    from launch.bench_throughput import agreement
    got = agreement([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]], [[1, 2, 3, 4], [5, 6, 0, 0], [1, 9]])
    assert got == dict(identical=1, requests=3, first_token_equal=2, first_difference=[None, 2, 0],
                       mean_prefix=(1.0 + 0.5 + 0.0) / 3)


def test_throughput_rows_per_prefill_chunk():
    """bench_throughput at two prefill_chunk values on one model: the default resolves to LLM's (256
    on CPU), both give the same greedy tokens, smaller chunks take more steps, and the latency columns
    are filled (TTFT p50 <= max; every request has several tokens, so TPOT too)."""
    from launch.bench_throughput import format_rows, throughput_rows
    rows = throughput_rows("tiny", [2], gen_tokens=4, dtype="float32", min_prompt=20, max_prompt=60,
                           prefill_chunks=(8, None), num_pages=64)
    assert [r["prefill_chunk"] for r in rows] == [8, 256]
    assert rows[0]["outputs"] == rows[1]["outputs"] and rows[0]["steps"] > rows[1]["steps"]
    for r in rows:
        assert 0 < r["ttft_p50_ms"] <= r["ttft_max_ms"] and 0 < r["tpot_p50_ms"] <= r["tpot_max_ms"]
    assert "TTFT p50/max ms" in format_rows(rows)


def test_bench_mla_profile_lists_each_cases_device_ops(tmp_path):
    """--profile traces a few calls of the engine's op per case and writes each op's device time per
    call with the call's span and the GPU's clock / power while it ran (the CPU run exercises the script:
    interpret-mode kernels, no nvidia-smi); a malformed case is a one-line error naming it."""
    out = str(tmp_path / "out")
    r = _run("launch.bench_mla", "--dry", "--profile=2:256:8:triton", "--out", out)
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
    bad = _run("launch.bench_mla", "--dry", "--profile=2:256", "--out", out)
    assert bad.returncode != 0 and "--profile=2:256: want B:context:heads[:kernel]" in bad.stderr
    bad = _run("launch.bench_mla", "--dry", "--profile=2:256:8:cuda", "--out", out)
    assert bad.returncode != 0 and "--profile=2:256:8:cuda: kernel one of auto, triton" in bad.stderr


def test_bench_mla_decode_times_each_page_order_against_the_higher_copy(tmp_path):
    """The decode section runs each case once per --table_orders entry, measures the copy ceiling at
    the start and the end and divides by the higher of the two; an unknown order fails before any
    work, in one line naming it. (CPU, --dry: this checks the script, not the speed.)"""
    out = str(tmp_path / "out")
    r = _run("launch.bench_mla", "--dry", "--noprefill", "--heads=8", "--batches=2", "--contexts=64",
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
    bad = _run("launch.bench_mla", "--dry", "--table_orders=zigzag", "--out", out)
    assert bad.returncode != 0 and "--table_orders: 'zigzag' is not random" in bad.stderr
    assert "copy (start)" not in bad.stdout


def test_bench_mla_tables_are_row_orders():
    """_table: distinct pages; sequential = one run per row; interleaved = page j of row b is j B + b."""
    import jax
    import numpy as np
    from launch import bench_mla
    for order in ("random", "sequential", "interleaved"):
        t = np.asarray(bench_mla._table(jax.random.PRNGKey(0), 3, 4, 20, order))
        assert t.shape == (3, 4) and len(set(t.ravel())) == 12 and t.max() < 20
    np.testing.assert_array_equal(bench_mla._table(None, 2, 3, 6, "sequential"), [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(bench_mla._table(None, 2, 3, 6, "interleaved"), [[0, 2, 4], [1, 3, 5]])


def test_bench_int4_bad_sweep_layout_is_a_one_line_error(tmp_path):
    """--sweep_layouts takes i16 / i32 only and says so before any section runs."""
    bad = _run("launch.bench", "--suite=int4", "--dry", "--sweep_layouts=i32,i4", "--out", str(tmp_path))
    assert bad.returncode != 0 and "--sweep_layouts: 'i4' is not i16 or i32" in bad.stderr
    assert "== section" not in bad.stdout


@pytest.mark.parametrize("module,spec,msg", [
    ("launch.bench_mla", "8:4096:64", "is not B:long:short:heads (four integers)"),
    ("launch.bench_mla", "1:4096:64:8", "needs B >= 2, 0 <= short <= long, heads >= 1"),
    ("launch.bench_engine", "8:100:200", "needs B >= 2 and 0 <= short <= long"),
    ("launch.bench_engine", "8:x:1", "is not B:long:short (three integers)"),
])
def test_bad_mixed_case_is_a_one_line_error_before_any_work(tmp_path, module, spec, msg):
    """--mixed cases are checked before any section / engine starts, and the error names the case."""
    extra = ["--dry", "--noprefill"] if module.endswith("mla") else ["--tiny"]
    bad = _run(module, *extra, f"--mixed={spec}", "--out", str(tmp_path))
    assert bad.returncode != 0 and f"--mixed: {spec!r} {msg}" in bad.stderr, bad.stderr[-500:]
    assert "copy (start)" not in bad.stdout and "device:" not in bad.stdout


def test_bench_mla_prefill_only_times_chunks_after_cached_tokens(tmp_path):
    """--prefill_only: the fresh-prefill rows and the chunk-after-cached-tokens rows (einsum path vs the
    masked call; on CPU the cuDNN request falls back to einsums with a warning), nothing else."""
    r = _run("launch.bench_mla", "--dry", "--prefill_only", "--reps=1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "prefill chunk B=3 prefix=64 T=16 einsum" in out and "prefill chunk B=3 prefix=64 T=16 cudnn" in out
    assert "decode page" not in out and "check N=" not in out


def test_check_prefill_tiny_runs_every_path_and_the_ttft_section(tmp_path):
    """`check_prefill --tiny` (CPU: jax.nn.dot_product_attention's 'xla' stands in for cuDNN): the op
    checks pass, the model step runs the fresh paths and the later chunk three ways (einsum, masked,
    split) with one first token per prompt, and the time-to-first-token section prefills one prompt
    at two chunk sizes with the same first token; the JSON records all of it."""
    # every section must run: no wall-clock budget (its 100 s default cut the second TTFT chunk when the
    # suite ran two test processes on the 2-core CI machine; the run takes ~63 s alone)
    r = _run("launch.check_prefill", "--tiny", "--budget_s=100000", "--out", str(tmp_path), timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.load(open(tmp_path / "check_prefill.json"))
    assert res["ok"] and all(row["ok"] for row in res["ops"])
    model = res["model"]
    assert {"t_chunk_einsum", "t_chunk_xla", "t_chunk_xla_split"} <= set(model)
    assert all(model[k] for k in ("t_chunk_einsum", "t_chunk_xla", "t_chunk_xla_split"))
    toks = model["tokens"]
    assert toks["chunk_einsum"] == toks["chunk_xla"] == toks["chunk_xla_split"]
    assert toks["paged"] == toks["fresh_einsum"] == toks["fresh_xla"]
    ttft = res["ttft"]
    assert ttft["agree"] and len(ttft["chunks"]) == 2 and all(ttft["chunks"].values())
    assert "first tokens agree: True" in r.stdout


def test_bench_sweep_tables_build():
    """Every config list of launch/bench.py's two sweep tables is built when any one is asked for, so one
    entry with a field its config class lacks breaks the whole table (it once broke the dense and
    check sections): both tables build and hold their config classes. (A fresh process: launchers
    define absl flags, and two launchers in one process clash.)"""
    code = ("from launch import bench\n"
            "from pallas_kernels.int4.matmul import Int4MatmulConfig as D\n"
            "from pallas_kernels.int4.moe_gmm import MoeGmmConfig as M\n"
            "assert all(c is None or isinstance(c, D) for _, c in bench.dense_sweep('default'))\n"
            "assert all(c is None or isinstance(c, M) for _, c in bench.moe_sweep('t1_device'))\n"
            "print('tables ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "tables ok" in r.stdout, r.stderr[-2000:]


def test_check_chunking_float32_agrees_and_rejects_bad_settings(tmp_path):
    """launch.check_chunking in float32 on the tiny preset: whole prompts, 16-token chunks through the
    einsum and the split path, and 7-token chunks with 20-token steps (several rows per step) give the
    same first-token log-probabilities (it exits 1 otherwise; a 1% error in the split path's merge made
    it fail when tried); a malformed setting is a one-line usage error naming it.
    --reference runs one setting again in a float32 engine over the first engine's weights: with routing
    pinned (pin_routing edits the weights after they are made) it must give every setting's numbers
    (<= 1e-4); a reference built from its own freshly made weights would route differently and fail."""
    out = str(tmp_path / "cc")
    r = _run("launch.check_chunking", "--model=tiny", "--num_layers=2", "--dtype=float32", "--requests=4",
             "--min_prompt=20", "--max_prompt=90", "--max_num_seqs=3", "--fixed_routing",
             "--settings=256:1024:auto,16:64:einsum,16:64:xla_split,7:20:xla_split", "--reference=16:64:einsum",
             f"--out={out}")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.load(open(os.path.join(out, "check_chunking.json")))
    assert got["ok"] and len(got["rows"]) == 4
    assert all(row["flips"] == [] and row["max_diff"] <= 1e-4 for row in got["rows"][1:])
    assert got["reference"]["setting"] == "float32 16:64:einsum" and len(got["reference"]["top"]) == 4
    for row in got["rows"]:
        assert row["vs_reference"]["flips"] == [] and row["vs_reference"]["max_diff"] <= 1e-4, row
    bad = _run("launch.check_chunking", "--model=tiny", "--settings=256:1024:auto,16:x:einsum", f"--out={out}")
    assert bad.returncode != 0 and "16:x:einsum" in bad.stderr


def _int4_bench_rows(out, *args):
    """Run `bench --suite=int4 --dry` with args (CPU); its results.jsonl rows."""
    r = _run("launch.bench", "--suite=int4", "--dry", "--reps=1", "--nobaselines", *args, "--out", out, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]


def test_bench_moe_profile_records_device_time_per_kernel(tmp_path):
    """bench --moe_profile (dry shapes, CPU): each timed i32 config gets a moe_profile record with its
    ops' device time per call (positive), their sum and the span; i16 timings are not profiled."""
    rows = _int4_bench_rows(str(tmp_path / "mp"), "--sections=moe", "--batches=1", "--moe_configs=small",
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


def test_bench_rejects_fewer_experts_than_top_k(tmp_path):
    """--moe_experts below top-8 (and --moe_held_pairs above it) is a one-line usage error naming the flag,
    before any section runs."""
    r = _run("launch.bench", "--suite=int4", "--moe_experts=4", "--out", str(tmp_path), timeout=120)
    assert r.returncode != 0 and "--moe_experts=4: fewer routed experts than top-8" in r.stderr
    r = _run("launch.bench", "--suite=int4", "--moe_held_pairs=9", "--out", str(tmp_path), timeout=120)
    assert r.returncode != 0 and "--moe_held_pairs=9: not between 0 (all) and 8" in r.stderr
    assert not os.path.exists(tmp_path / "results.jsonl")


def test_bench_moe_held_pairs_times_the_expert_parallel_share(tmp_path):
    """--moe_held_pairs=1 (EP8 at batch 1): each token keeps one held pair, the others get the skipped id,
    so one expert per token is touched and the roofline counts only its bytes; baselines are skipped."""
    rows = _int4_bench_rows(str(tmp_path / "ep"), "--sections=moe", "--batches=2", "--moe_configs=small",
                            "--rotations=2", "--moe_held_pairs=1", "--sweep_layouts=i32", "--baselines")
    timed = [x for x in rows if x.get("section") == "moe" and "t" in x]
    assert {x["case"] for x in timed} == {"moe T=2 held=1/8"} and {x["impl"] for x in timed} == {"pallas"}
    assert all(1 <= x["touched"] <= 2 for x in timed)          # 2 tokens, one held expert each


def test_bench_dense_profile_records_device_time_per_call(tmp_path):
    """bench --dense_profile (dry shapes, CPU): each timed i32 dense config gets a dense_profile record
    (per-op device time, the span per call), and so do each shape's same-size copy and read (the floor
    of any op moving those bytes); the i16 timings are not profiled."""
    rows = _int4_bench_rows(str(tmp_path / "dp"), "--sections=dense", "--ms=1", "--dense_configs=small",
                            "--num_mats=2", "--dense_profile")
    prof = [x for x in rows if x.get("section") == "dense_profile"]
    assert [(x["case"], x["config"]) for x in prof] == [
        ("dense gate_up", "copy_same_size"), ("dense gate_up", "read_same_size"), ("dense gate_up M=1", "default"),
        ("dense down", "copy_same_size"), ("dense down", "read_same_size"), ("dense down M=1", "default")]
    assert all(x["ops_us"] and x["span_us"] > 0 for x in prof)
    assert [x["impl"] for x in rows if x.get("section") == "dense" and x.get("impl", "").endswith("_size")] == [
        "copy_same_size", "read_same_size"] * 2


def test_bench_throughput_cli_compares_prefill_chunks(tmp_path):
    """bench --suite=throughput --tp_prefill_chunks: one table row per chunk size with the latency columns,
    and each later size's greedy tokens compared with the first's (identical on CPU in float32)."""
    r = _run("launch.bench", "--suite=throughput", "--model=tiny", "--num_layers=2", "--dtype=float32",
             "--tp_batches=2", "--gen_tokens=3", "--min_prompt=20", "--max_prompt=60", "--max_model_len=80",
             "--num_pages=64", "--tp_prefill_chunks=8,32", "--out", str(tmp_path), timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TTFT p50/max ms" in r.stdout
    assert "batch 2 overlap True prefill_chunk 32 vs 8: {'identical': 8, 'requests': 8" in r.stdout
