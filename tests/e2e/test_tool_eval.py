"""launch.tool_eval through the server (the official `openai` client against an in-process server on a
free 127.0.0.1 port) and through kimi-batch's job, on the demo model (which follows no instruction):
sampled json_schema outputs and tool_choice "required" calls all validate, and both paths report in
one format. The 50 + 50 acceptance run is BENCHMARKS.md's ("Structured outputs")."""
import json

import pytest

pytest.importorskip("openai")
pytest.importorskip("jsonschema")

# one engine configuration for the server and the batch job, so the job's programs come from the
# compilation cache: one prefill chunk per prompt and no prefix caching (no cached-prefix programs)
ENGINE = ["--max-num-seqs=4", "--max-model-len=1024", "--prefill-chunk=512", "--no-enable-prefix-caching"]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server():
    from kimi_jax.entrypoints.llm import LLM
    from kimi_jax.entrypoints.openai.server import OpenAIServer
    from tests.e2e.serving import serving
    llm = LLM(None, dtype="float32", max_num_seqs=4, max_model_len=1024, prefill_chunk=512,
              enable_prefix_caching=False)
    with serving(OpenAIServer(llm.frontend, served_model_name="kimi-jax-demo")) as url:
        yield url


def _report(cli, tmp_path, requests_file, *args):
    out = tmp_path / "report.json"
    r = cli("launch.tool_eval", f"--requests={requests_file}", f"--max-tokens={MAX_TOKENS}", f"--out={out}",
            "--no-progress", *args)
    assert r.returncode == 0, r
    report = json.loads(out.read_text())
    assert json.loads(r.stdout) == report["summary"]
    return report


def _check(report, path):
    s = report["summary"]
    assert s["path"] == path and s["requests"] == 4 and s["errors"] == 0, s
    assert s["json_schema_requests"] == s["json_parsed"] == s["json_valid"] == 2, report
    assert s["forced_requests"] == s["forced_with_valid_calls"] == s["finish_reason_tool_calls"] == 2, report
    assert s["tool_calls"] >= 2 and s["calls_parsed"] == s["calls_valid"] == s["tool_calls"], report
    assert s["schema_accuracy"] == 1.0 and s["all_valid"] is True


def test_server_and_batch_paths_validate(cli, server, tmp_path):
    # two json_schema requests (two schemas), two tool_choice "required" ones (one tool, two tools)
    requests_file = str(tmp_path / "req.jsonl")
    r = cli("launch.tool_eval", f"--make-sample={requests_file}", "--n=2", "--kinds=json_schema,required")
    assert r.returncode == 0, r
    reqs = [json.loads(line) for line in open(requests_file)]
    assert [("response_format" in q, q.get("tool_choice")) for q in reqs] == [
        (True, None), (True, None), (False, "required"), (False, "required")]
    assert len({q["seed"] for q in reqs}) == 4 and all(q["temperature"] > 0 for q in reqs)
    by_server = _report(cli, tmp_path, requests_file, "--path=server", f"--base-url={server}/v1",
                        "--concurrency=4", "--timeout-s=120")
    _check(by_server, "server")
    by_batch = _report(cli, tmp_path, requests_file, "--path=batch", f"--batch-dir={tmp_path / 'job'}", *ENGINE)
    _check(by_batch, "batch")
    assert (tmp_path / "job" / "batch_output.jsonl").exists()
    # one report format: the same keys, every response an OpenAI chat-completion body
    assert set(by_server["summary"]) == set(by_batch["summary"])
    for rep in (by_server, by_batch):
        assert all(b["object"] == "chat.completion" and b["choices"][0]["message"]["role"] == "assistant"
                   for b in rep["responses"])


@pytest.mark.parametrize("args,words", [
    (["--requests=/dev/null", "--path=server"], "needs --base_url"),
    (["--requests=/dev/null", "--base-url=http://10.1.2.3:8000/v1"], "not a loopback address"),
    (["--requests=/dev/null", "--path=llm", "--base-url=http://127.0.0.1:1/v1"], "--path=server"),
    (["--make-sample=/dev/null", "--kinds=json_schema,nosuch"], "nosuch"),
    (["--requests=/dev/null", "--max-requests=0"], "--max_requests must be >= 1, got 0"),
])
def test_usage_errors_are_one_line(cli, args, words):
    r = cli("launch.tool_eval", *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("tool_eval: error: "), r
    assert words in lines[0], lines


def test_help_lists_the_paths(cli):
    r = cli("launch.tool_eval", "--help")
    assert r.returncode == 0 and "--base-url" in r.stdout and "--batch-cli" in r.stdout, r


def test_jsonschema_is_a_dependency_checked_before_any_request(cli, tmp_path, monkeypatch):
    import sys
    import tomllib
    with open("pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert "jsonschema" in [d.split(">")[0].split("=")[0].strip() for d in deps]
    monkeypatch.setitem(sys.modules, "jsonschema", None)        # an install without it
    requests_file = tmp_path / "req.jsonl"
    assert cli("launch.tool_eval", f"--make-sample={requests_file}", "--n=1").returncode == 0
    r = cli("launch.tool_eval", f"--requests={requests_file}", "--path=server",
            "--base-url=http://127.0.0.1:1/v1")
    assert r.returncode == 2, r
    assert r.stderr.strip() == ("tool_eval: error: the scoring needs the jsonschema package "
                                "(pip install jsonschema)"), r


def test_max_requests_takes_the_first_requests_of_a_longer_file(cli, server, tmp_path):
    requests_file = tmp_path / "req.jsonl"
    r = cli("launch.tool_eval", f"--make-sample={requests_file}", "--n=2", "--kinds=json_schema,required")
    assert r.returncode == 0, r
    lines = requests_file.read_text().splitlines()
    requests_file.write_text("\n".join(lines + ["not json"]) + "\n")     # never read
    report = _report(cli, tmp_path, requests_file, "--path=server", f"--base-url={server}/v1",
                     "--max-requests=2", "--timeout-s=120")
    s = report["summary"]     # the file's first two: its json_schema requests, no tool_choice ones
    assert s["requests"] == len(report["responses"]) == 2 and s["errors"] == 0, s
    assert s["json_schema_requests"] == 2 and "tool_requests" not in s, s
