"""kimi-batch against hostile files: every input line gets exactly one output line on the first run and
on every rerun (invalid UTF-8, nesting thousands deep, not an object, colliding ids), and output paths
that are full, pipes or taken fail fast or work, never hang or grow."""
from __future__ import annotations

import collections
import io
import json
import os
import subprocess
import sys

import pytest

from kimi_jax.entrypoints import batch as B
from tests.e2e.test_batch_cli import ROOT, env


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    from kimi_jax import LLM
    return LLM(tiny_ckpt, dtype="float32", max_num_seqs=16, block_size=4, num_gpu_blocks_override=96)


def _good(i: int) -> bytes:
    return json.dumps({"custom_id": f"r{i}", "prompt": [5 + i % 50, 6], "max_tokens": 1,
                       "temperature": 0}).encode()


def _run(llm, data: bytes, out: str) -> B.JobSummary:
    return B.run_job(llm.frontend, io.BytesIO(data), B.ResultWriter(out), model_name="m", default_max_tokens=2,
                     progress=False)


def _records(path: str) -> list[dict]:
    with open(path, "rb") as f:
        return [json.loads(x) for x in f.read().splitlines()]


def _hostile_input(n: int = 400) -> tuple[bytes, dict]:
    """n good lines with hostile lines put among them; returns the file and custom_id -> what the
    output line must say (None: a 200 result)."""
    lines = [_good(i) for i in range(n)]
    expect = {f"r{i}": None for i in range(n)}
    bad = {
        37: (b'{"custom_id": "r37", "prompt": "\xff\x80", "max_tokens": 1}', "r37", "UTF-8"),
        38: (b'{"custom_id": "\xc3(", "prompt": [1]}', "line-39", "UTF-8"),  # in the custom_id itself
        120: (b"[" * 5000 + b"]" * 5000, "line-121", "nested deeper"),
        121: (b'{"custom_id": "deep", "prompt": [1], "x": ' + b"[" * 200 + b"]" * 200 + b"}", "line-122",
              "nested deeper"),
        200: (b'"just a string"', "line-201", "JSON object"),
        201: (json.dumps({"custom_id": "line-1", "prompt": [1]}).encode(), "line-202", "automatic id"),
        202: (b'{"custom_id": "\\ud800", "prompt": "x"}', "\ud800", "tokenizer"),
        300: (b"\x00\x01\x02", "line-301", "malformed JSON"),
    }
    for i, (raw, cid, words) in bad.items():
        lines[i] = raw
        expect.pop(f"r{i}")
        expect[cid] = words
    return b"\n".join(lines) + b"\n", expect


def test_every_line_one_output_first_run_and_rerun(llm, tmp_path):
    data, expect = _hostile_input()
    out = str(tmp_path / "out.jsonl")
    s = _run(llm, data, out)
    recs = _records(out)
    assert len(recs) == len(data.splitlines()) == 400
    by_id = {r["custom_id"]: r for r in recs}
    assert set(by_id) == set(expect), set(by_id) ^ set(expect)
    for cid, words in expect.items():
        r = by_id[cid]
        if words is None:
            assert r["response"]["status_code"] == 200, r
        else:
            msg = r["error"]["message"] if r["error"] else r["response"]["body"]["error"]["message"]
            assert words in msg and "\n" not in msg, (cid, msg)
    assert s.counts["ok"] == 392 and s.counts["ok"] + s.counts["refused"] + s.counts["errors"] == 400
    before = open(out, "rb").read()
    s2 = _run(llm, data, out)
    assert open(out, "rb").read() == before and s2.counts["skipped"] == 400


def test_torn_tail_after_bad_line_is_finished_by_rerun(llm, tmp_path):
    data, expect = _hostile_input(310)
    out = str(tmp_path / "out.jsonl")
    _run(llm, data, out)
    full = open(out, "rb").read()
    cut = full[: full.index(b"\n", len(full) // 2) + 20]       # kill -9 mid-line, half the job done
    with open(out, "wb") as f:
        f.write(cut)
    _run(llm, data, out)
    ids = [r["custom_id"] for r in _records(out)]
    assert len(ids) == 310 and collections.Counter(ids).most_common(1)[0][1] == 1


def test_dev_full_fails_at_once(llm):
    w = B.ResultWriter("/dev/full")
    with pytest.raises(B.OutputWriteError, match="No space left"):
        for i in range(10_000):
            w.write(B.error_line(f"x{i}", "m"))
    assert w.written == 0
    with pytest.raises(B.OutputWriteError):
        _run(llm, b"\n".join(_good(i) for i in range(50)), "/dev/full")


def test_second_writer_on_one_file_is_refused(tmp_path):
    out = str(tmp_path / "o.jsonl")
    w = B.ResultWriter(out)
    with pytest.raises(B.OutputFileError, match="another kimi-batch job"):
        B.ResultWriter(out)
    w.close()
    B.ResultWriter(out).close()


def test_output_that_is_not_results_names_file_and_line(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_bytes(b'{"custom_id": "a", "response": null, "error": null}\n' + b"[" * 100000 + b"\n")
    with pytest.raises(B.OutputFileError, match=r"o\.jsonl:2: .*not a kimi-batch result"):
        B.ResultWriter(str(out))


def _cli(inp, out_args, timeout=240, shell_tail=""):
    cmd = [sys.executable, "-m", "launch.batch", "--input", inp, *out_args, "--model", "tiny", "--noprogress"]
    return subprocess.run(" ".join(cmd) + shell_tail, shell=True, cwd=ROOT, env=env(), capture_output=True,
                          timeout=timeout)


def test_cli_dev_full_and_pipe(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"\n".join([_good(1), b"\xff", _good(2)]) + b"\n")
    p = _cli(str(inp), ["--output", "/dev/full"])
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and err[-1] == "kimi-batch: error: --output /dev/full: cannot write (No space left on device)"
    p = _cli(str(inp), ["--output", "/dev/stdout"], shell_tail=" | cat")
    assert p.returncode == 0, p.stderr[-2000:]
    recs = [json.loads(x) for x in p.stdout.splitlines()]
    assert sorted(r["custom_id"] for r in recs) == ["line-2", "r1", "r2"]


def test_a_line_beyond_the_limit_is_one_error_and_memory_stays_bounded(llm, tmp_path, monkeypatch):
    monkeypatch.setattr(B, "MAX_LINE_BYTES", 4096)
    huge = b'{"custom_id": "huge", "prompt": "' + b"a" * 100_000 + b'"}'
    data = b"\n".join([_good(1), huge, _good(2), b"x" * 5000]) + b"\n" + b"y" * 9000   # no final newline
    lines = list(B.input_lines(io.BytesIO(data), 4096))
    assert [n for n, _ in lines] == [1, 2, 3, 4, 5]
    assert [x.size for _, x in lines if isinstance(x, B.TooLong)] == [len(huge) + 1, 5001, 9000]
    out = str(tmp_path / "o.jsonl")
    _run(llm, data, out)
    by_id = {r["custom_id"]: r for r in _records(out)}
    assert set(by_id) == {"r1", "r2", "line-2", "line-4", "line-5"}
    assert "more than 4096" in by_id["line-2"]["error"]["message"]
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(data)
    assert B.count_lines(str(inp)) == 5
    inp.write_bytes(b"\n \n" + _good(1) + b"\n\t\n" + b" " * (3 << 20) + b"z" + b"\n\n")
    assert B.count_lines(str(inp)) == 2


def test_cli_input_from_a_pipe_loses_no_line(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"\n".join(_good(i) for i in range(5)) + b"\n")
    out = str(tmp_path / "o.jsonl")
    p = _cli("/dev/stdin", ["--output", out], shell_tail=f" < {inp}")
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(r["custom_id"] for r in _records(out)) == [f"r{i}" for i in range(5)]


def test_byte_order_mark_and_crlf_lines_are_read(llm, tmp_path):
    data = b"\xef\xbb\xbf" + b"\r\n".join(_good(i) for i in range(4)) + b"\r\n\r\n"
    out = str(tmp_path / "o.jsonl")
    s = _run(llm, data, out)
    assert s.counts["ok"] == 4 and sorted(r["custom_id"] for r in _records(out)) == [f"r{i}" for i in range(4)]


def test_an_input_without_newlines_ends_with_one_error(llm, tmp_path, monkeypatch):
    monkeypatch.setattr(B, "MAX_LINE_BYTES", 4096)
    monkeypatch.setattr(B, "MAX_RUN_ON", 1 << 20)
    with open("/dev/zero", "rb") as zero:
        lines = list(B.input_lines(zero, 4096))
    assert len(lines) == 1 and lines[0][1].endless
    out = str(tmp_path / "o.jsonl")
    with open("/dev/zero", "rb") as zero:
        s = B.run_job(llm.frontend, zero, B.ResultWriter(out), model_name="m", default_max_tokens=2, progress=False)
    (rec,) = _records(out)
    assert rec["custom_id"] == "line-1" and rec["error"]["code"] == "input_not_lines"
    assert f"more than {1 << 20} bytes without a newline" in rec["error"]["message"]
    assert s.counts["errors"] == 1


def test_cli_dev_zero_input_terminates(tmp_path):
    out = str(tmp_path / "o.jsonl")
    p = _cli("/dev/zero", ["--output", out], timeout=200)
    assert p.returncode == 0, p.stderr[-2000:]
    (rec,) = _records(out)
    assert "without a newline" in rec["error"]["message"]
