"""launch/generate.py (`kimi-generate`) as a user runs it (its console-script entry point, in this
process through the `cli` fixture; the CPU)."""
import json

import pytest


@pytest.fixture
def _run(cli):
    return lambda *args: cli("launch.generate", *args)


def test_default_prints_a_continuation(_run, tool_module):
    DEFAULT_PROMPT = tool_module("launch.generate").DEFAULT_PROMPT
    r = _run("--max_tokens", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(DEFAULT_PROMPT)
    assert len(r.stdout.strip()) > len(DEFAULT_PROMPT), r.stdout


def test_prompt_prefilled_in_small_chunks_gives_the_same_text(_run):
    """--prefill_chunk 4: the default prompt (more than 4 tokens) is prefilled over several steps, each
    chunk attending to the cached ones; greedy float32 text equals the one-step prefill's."""
    base = _run("--max_tokens", "8", "--temperature", "0")
    small = _run("--max_tokens", "8", "--temperature", "0", "--prefill_chunk", "4", "--max_prefill_tokens", "4")
    assert base.returncode == 0 and small.returncode == 0, (base.stderr[-1000:], small.stderr[-1000:])
    assert small.stdout == base.stdout and base.stdout.strip()


def test_chat_messages_stream(_run):
    msgs = json.dumps([{"role": "user", "content": "What does json.dumps do?"}])
    r = _run("--messages", msgs, "--max_tokens", "8", "--temperature", "0", "--stream")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip(), r.stdout


@pytest.mark.parametrize("args", [
    ("--no_such_flag",),
    ("--max_tokens", "many"),
    ("--top_p", "2"),
    ("--dtype", "int3"),
    ("--model", "/no/such/checkpoint"),
    ("--messages", "not json"),
    ("--prompt", "x", "--messages", "[]"),
    ("--tensor_parallel_size", "16"),         # 8 simulated CPU devices here
    ("--max-tokens", "many"),                 # vLLM's spelling, same flag
    ("--prefill_chunk", "0"),
    ("positional",),
])
def test_bad_flags_exit_2_with_one_line(_run, args):
    r = _run(*args)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kimi-generate: error:"), r.stderr
    assert r.stdout == ""
