"""kimi-batch against hostile input: every bad line becomes its own error (a 400 with the API's error body
when refused as it is read, a 500 when it fails while running), the good lines' results equal a clean run's, the job exits 0 and a rerun adds nothing;
output paths it cannot use are one-line errors with exit status 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.e2e.test_batch_cli import ROOT, env, message, stable

# A request whose first prompt token is POISON fails inside the engine's bookkeeping (a stand-in for
# any failure that only surfaces while a batch runs); the job must keep every other line.
POISON = 77
_POISONED_RUN = f"""
import sys
from kimi_jax.engine import scheduler
append = scheduler.Scheduler._append
def _append(self, r, t, out=None, b=0):
    if r.prompt_ids[0] == {POISON}:
        raise RuntimeError("poisoned request")
    return append(self, r, t, out, b)
scheduler.Scheduler._append = _append
from launch.batch import run
sys.argv = ["kimi-batch"] + sys.argv[1:]
run()
"""

GOOD = {
    "g0": {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
    "g1": {"prompt": [9, 10], "max_tokens": 5, "temperature": 0.8, "seed": 3},
    "g2": {"prompt": [11, 12, 13, 14], "max_tokens": 3, "temperature": 0},
    "g3": {"prompt": [20, 21], "max_tokens": 6, "temperature": 0.7, "seed": 2 ** 63 - 1},
    "g4": {"prompt": [30], "max_tokens": 4, "temperature": 0, "logprobs": 3},
    "g5": {"prompt": [40, 41, 42], "max_tokens": 4, "temperature": 0.9, "seed": 8, "top_k": 2 ** 31},
}
# what a clean run is given for the same ids (top_k at or above the vocabulary is "off")
CLEAN = {**GOOD, "g5": {**GOOD["g5"], "top_k": -1}}

BAD = {   # custom_id -> (body, words the error message must contain)
    "prompt-number": ({"prompt": 5}, ["prompt"]),
    "prompt-null": ({"prompt": None}, ["prompt"]),
    "prompt-object": ({"prompt": {"a": 1}}, ["prompt"]),
    "prompt-bool-id": ({"prompt": [3, True]}, ["'prompt'", "token ids"]),
    "prompt-float-id": ({"prompt": [3, 2.5]}, ["'prompt'", "token ids"]),
    "prompt-id-outside": ({"prompt": [3, 512]}, ["token id 512", "vocabulary"]),
    "seed-string": ({"prompt": [3], "seed": "abc"}, ["seed", "integer"]),
    "seed-2^64": ({"prompt": [3], "seed": 2 ** 64}, ["'seed'", "must be in"]),
    "seed-float": ({"prompt": [3], "seed": 1.5}, ["seed"]),
    "logprobs-too-many": ({"prompt": [3], "logprobs": 100000}, ["'logprobs'", "must be in"]),
    "top-logprobs-on-completions": ({"prompt": [3], "logprobs": 2, "top_logprobs": 2}, ["top_logprobs"]),
    "temperature-string": ({"prompt": [3], "temperature": "hot"}, ["temperature"]),
    "temperature-inf": ({"prompt": [3], "temperature": float("inf")}, ["temperature", "finite"]),
    "top-k-float": ({"prompt": [3], "top_k": 2.5}, ["top_k"]),
    "max-tokens-bool": ({"prompt": [3], "max_tokens": True}, ["max_tokens"]),
    "stop-ids-string": ({"prompt": [3], "stop_token_ids": ["a"]}, ["stop_token_ids"]),
    "chat-no-tokenizer": ({"messages": [{"role": "user", "content": "hi"}]}, ["tokenizer"]),
    "poisoned": ({"prompt": [POISON, 5, 6], "max_tokens": 4, "temperature": 0},
                 ["failed while running", "poisoned request"]),
}


def _differ(a, b, path="") -> str:
    """Where two output lines differ ("" when they do not): logprobs may differ in float32 rounding, as
    the same request is computed in batches of other shapes (the clean run has no failed step to rerun);
    1e-5 is far above that rounding (~1e-7 relative on logits of size ~1) and far below any change of
    token."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(a)} != {sorted(b)}"
        return next((d for k in a if (d := _differ(a[k], b[k], f"{path}.{k}"))), "")
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} != {len(b)} items"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _differ(x, y, f"{path}[{i}]"))), "")
    if isinstance(a, float) and isinstance(b, float):
        return "" if abs(a - b) <= 1e-5 else f"{path}: {a} != {b}"
    return "" if a == b else f"{path}: {a!r} != {b!r}"


def _write(path, bodies):
    with open(path, "w") as f:
        for cid, body in bodies.items():
            f.write(json.dumps({"custom_id": cid, "body": body}) + "\n")


def _run(args, poisoned=False, timeout=300):
    head = [sys.executable, "-c", _POISONED_RUN] if poisoned else [sys.executable, "-m", "launch.batch"]
    return subprocess.run(head + args, cwd=ROOT, env=env(), capture_output=True, timeout=timeout)


def _args(inp, out):
    return ["--input", inp, "--output", out, "--model", "tiny", "--max_num_seqs", "2", "--noprogress"]


def _results(path):
    return {r["custom_id"]: r for r in map(json.loads, open(path))}


def test_bad_lines_fail_alone_and_a_rerun_adds_nothing(tmp_path):
    mixed, clean = str(tmp_path / "mixed.jsonl"), str(tmp_path / "clean.jsonl")
    # bad lines interleaved with good ones, so that the poisoned request shares batches with good ones
    order = {}
    bad = iter(BAD.items())
    for cid, body in GOOD.items():
        order[cid] = body
        for _ in range(3):
            k, (b, _) = next(bad, (None, (None, None)))
            if k is not None:
                order[k] = b
    order.update({k: b for k, (b, _) in bad})
    _write(mixed, order)
    _write(clean, CLEAN)
    out, ref = str(tmp_path / "out.jsonl"), str(tmp_path / "ref.jsonl")
    p = _run(_args(mixed, out), poisoned=True)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    r = _run(_args(clean, ref))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    got, want = _results(out), _results(ref)
    assert set(got) == set(GOOD) | set(BAD)
    for cid in GOOD:                                  # nothing good was lost
        assert not _differ(stable(got[cid]), stable(want[cid])), (cid, _differ(stable(got[cid]), stable(want[cid])))
    for cid, (_, words) in BAD.items():
        msg, res = message(got[cid]), got[cid]["response"]
        assert got[cid]["error"] is None and res["status_code"] == (500 if cid == "poisoned" else 400), cid
        assert set(res["body"]["error"]) == {"message", "type", "param", "code"}, cid
        assert "\n" not in msg and all(w in msg for w in words), (cid, msg)
    # a rerun finds every line done: nothing new, nothing repeated
    before = open(out).read()
    p2 = _run(_args(mixed, out), poisoned=True)
    assert p2.returncode == 0, p2.stderr.decode()[-3000:]
    assert open(out).read() == before


def _one_line_failure(p, *words):
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2, p.stderr.decode()[-2000:]
    assert len(err) == 1 and err[0].startswith("kimi-batch: error:") and all(w in err[0] for w in words), err


def test_output_paths_it_cannot_use(tmp_path):
    inp = str(tmp_path / "in.jsonl")
    _write(inp, {"a": {"prompt": [3, 4]}})
    size = os.path.getsize(inp)
    # the input itself as output (also through another name): refused, the input untouched
    os.link(inp, str(tmp_path / "alias.jsonl"))
    for out in (inp, str(tmp_path / "alias.jsonl")):
        _one_line_failure(_run(_args(inp, out)), "--output", "input file")
        assert os.path.getsize(inp) == size
    # a directory, and a path in a directory that does not exist
    _one_line_failure(_run(_args(inp, str(tmp_path))), "--output", str(tmp_path))
    _one_line_failure(_run(_args(inp, str(tmp_path / "no" / "out.jsonl"))), "--output", "cannot write")
    # an existing file that is not kimi-batch output: refused, left as it was
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text('{"custom_id": "x", "note": 1}\nplain text\n')
    _one_line_failure(_run(_args(inp, str(foreign))), f"{foreign}:1", "not a kimi-batch result")
    assert foreign.read_text() == '{"custom_id": "x", "note": 1}\nplain text\n'
