"""The server's HTTP layer and kimi-batch's reader against hostile input: integers beyond Python's
digit limit are a 400 / one error line (never a 500 or a lost line), and the server keeps serving."""
import io
import json
import sys

import pytest

from kimi_jax.entrypoints import batch as B
from tests.e2e.serving import serving
from tests.e2e.test_server import _http

NAME = "demo"
HUGE_INT = b"1" * (sys.get_int_max_str_digits() + 1)


@pytest.fixture(scope="module")
def server():
    from kimi_jax.entrypoints.llm import LLM
    from kimi_jax.entrypoints.openai.server import OpenAIServer
    llm = LLM(None, dtype="float32", max_num_seqs=4, max_model_len=256)
    srv = OpenAIServer(llm, served_model_name=NAME)
    with serving(srv) as url:
        yield srv, url


def _err(r):
    status, _, body = r
    assert "\n" not in body["error"]["message"]
    return status, body["error"]["param"], body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_an_integer_beyond_the_digit_limit_is_400(server, path):
    srv, url = server
    raw = b'{"model": "demo", "prompt": [5], "max_tokens": ' + HUGE_INT + b"}"
    status, _, message = _err(_http(url + path, raw))
    assert status == 400 and f"more than {sys.get_int_max_str_digits()} digits" in message
    assert _http(url + "/v1/completions", {"model": NAME, "prompt": [5], "max_tokens": 1})[0] == 200


def test_batch_answers_a_line_with_a_huge_integer_once_and_goes_on(tiny_ckpt, tmp_path):
    from kimi_jax import LLM
    llm = LLM(tiny_ckpt, dtype="float32", max_num_seqs=4, page_size=4, num_pages=32)
    good = [json.dumps({"custom_id": f"r{i}", "prompt": [5 + i, 6], "max_tokens": 1}).encode()
            for i in range(3)]
    bad = b'{"custom_id": "big", "prompt": [5], "max_tokens": ' + HUGE_INT + b"}"
    out = str(tmp_path / "o.jsonl")
    s = B.run_job(llm, io.BytesIO(b"\n".join([good[0], bad, good[1], good[2]]) + b"\n"),
                  B.ResultWriter(out), model_name="m", default_max_tokens=2, progress=False)
    with open(out, "rb") as f:
        records = [json.loads(x) for x in f.read().splitlines()]
    assert sorted(r["custom_id"] for r in records) == ["line-2", "r0", "r1", "r2"]
    err = next(r for r in records if r["custom_id"] == "line-2")["error"]
    assert "line 2" in err["message"] and "digits" in err["message"]
    assert s.counts["ok"] == 3 and s.counts["errors"] == 1
