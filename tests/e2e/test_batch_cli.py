"""kimi-batch: every input line gets exactly one output line, across kill -9 and reruns; bad lines are
reported and the job goes on."""
from __future__ import annotations

import pytest
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 24


def write_input(path):
    lines = [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": [5 + i, 6, 7, 8 + i % 5], "max_tokens": 4 + i % 7, "temperature": 0}})
             for i in range(N)]
    lines.insert(5, "{this is not json")
    lines.insert(9, json.dumps({"custom_id": "bad-type", "body": {"prompt": [1, 2], "top_k": "many"}}))
    lines.insert(13, json.dumps({"custom_id": "too-long", "body": {"prompt": list(range(2, 400))}}))
    lines.insert(17, json.dumps({"custom_id": "neg-temp", "body": {"prompt": [3, 4], "temperature": -0.5}}))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return [f"req-{i}" for i in range(N)] + ["line-6", "bad-type", "too-long", "neg-temp"]


def command(inp, out):
    return [sys.executable, "-m", "launch.batch", "--input", inp, "--output", out, "--model", "tiny",
            "--max_num_seqs", "2", "--noprogress"]


def env():
    import jax
    e = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    e["PYTHONPATH"] = ROOT
    e["JAX_PLATFORMS"] = "cpu"
    # the five runs compile the same programs: share the test session's persistent cache
    e["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir or ""
    e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    e["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return e


def lines_in(path):
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def message(r) -> str:
    """The error message of an output line: the top-level error's or the API error body's (None: a result)."""
    if r["error"] is not None:
        return r["error"]["message"]
    body = r["response"]["body"]
    return body["error"]["message"] if r["response"]["status_code"] != 200 else None


def stable(r) -> dict:
    """An output line without its fresh ids and timestamp (what two runs of one input share)."""
    r = json.loads(json.dumps(r))
    r.pop("id")
    if r["response"] is not None:
        r["response"].pop("request_id")
        r["response"]["body"].pop("id", None)
        r["response"]["body"].pop("created", None)
    return r


@pytest.mark.slow
def test_kill9_and_resume_gives_each_id_once(tmp_path):
    inp, out, ref = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), str(tmp_path / "ref.jsonl")
    ids = write_input(inp)
    for kill_after in (2, 9, 17):        # kill -9 at different points of the job
        p = subprocess.Popen(command(inp, out), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while lines_in(out) < kill_after and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait()
    done = subprocess.run(command(inp, out), cwd=ROOT, env=env(), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    got = [json.loads(l) for l in open(out)]
    assert sorted(r["custom_id"] for r in got) == sorted(ids)          # each exactly once

    # the interrupted job's results equal an uninterrupted run's (greedy decoding)
    subprocess.run(command(inp, ref), cwd=ROOT, env=env(), capture_output=True, timeout=300, check=True)
    ref_by_id = {r["custom_id"]: r for r in map(json.loads, open(ref))}
    for r in got:
        assert stable(r) == stable(ref_by_id[r["custom_id"]])
    errors = {r["custom_id"]: message(r) for r in got if message(r)}
    assert set(errors) == {"line-6", "bad-type", "too-long", "neg-temp"}
    assert "malformed JSON" in errors["line-6"] and "top_k" in errors["bad-type"]
    assert "maximum context length" in errors["too-long"] and "temperature" in errors["neg-temp"]
    by_id = {r["custom_id"]: r for r in got}
    assert by_id["line-6"]["response"] is None                 # not a request: the top-level error
    for cid in ("bad-type", "too-long", "neg-temp"):      # refused requests: a 400 and its body
        assert by_id[cid]["error"] is None and by_id[cid]["response"]["status_code"] == 400
