"""The calls vLLM's own example scripts make on LLM, its tokenizer and SamplingParams."""
import json

import pytest

from kimi_jax import LLM
from kimi_jax.entrypoints.llm import demo_model_path
from kimi_jax.sampling_params import SamplingParams, StructuredOutputsParams, generation_defaults

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def llm():
    path = demo_model_path()
    assert path is not None, "checkpoints/demo is missing: run `python -m launch.train_demo`"
    return LLM(path, dtype="float32", max_num_seqs=4, max_model_len=256, seed=0)


def test_tokenizer_has_the_transformers_calls_examples_make(llm):
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template(MSGS, tokenize=True, add_generation_prompt=True)
    assert ids == llm.encode_chat(MSGS)
    text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert text == llm.render_chat(MSGS) and "Name a colour." in text
    assert tok.apply_chat_template(MSGS, tokenize=False) != text      # no generation prompt by default
    assert tok.eos_token_id == tok.eos_id is not None and tok.bos_token_id == tok.bos_id
    assert tok.encode("a red hat", add_special_tokens=False) == tok.encode("a red hat")
    enc = tok("a red hat")
    assert enc.input_ids == enc["input_ids"] == tok.encode("a red hat")
    assert enc.attention_mask == [1] * len(enc.input_ids)
    assert tok(["a", "b c"])["input_ids"] == [tok.encode("a"), tok.encode("b c")]
    pieces = tok.convert_ids_to_tokens(tok.encode("a red hat") + [tok.eos_token_id])
    assert "".join(pieces[:-1]) == "a red hat" and pieces[-1] == tok.eos_token
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == tok.eos_token
    assert tok.decode([*tok.encode("hat"), tok.eos_token_id], skip_special_tokens=True) == "hat"
    sp = llm.get_default_sampling_params()
    assert sp == SamplingParams()      # the demo checkpoint has no generation_config.json
    sp.max_tokens, sp.temperature = 4, 0.0
    out = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and len(out.outputs[0].token_ids) <= 4


def test_generation_config_gives_the_default_sampling_params(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 32, "do_sample": True, "top_k": None}))
    assert SamplingParams(**generation_defaults(str(tmp_path))) == SamplingParams(
        temperature=0.6, top_p=0.95, max_tokens=32)
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="generation_config.json"):
        generation_defaults(str(tmp_path))
    assert generation_defaults(str(tmp_path / "absent")) == {} and generation_defaults(None) == {}


def test_sampling_params_are_mutable_and_checked_at_generate(llm):
    sp = SamplingParams(temperature=0.0, seed=3)
    sp.max_tokens = 3
    out = llm.generate(["a red"], sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 3
    sp.top_p = 1.5
    with pytest.raises(ValueError, match=r"request 0: top_p must be in \(0, 1\], got 1.5"):
        llm.generate(["a red"], sp, use_tqdm=False)
    sp.top_p, sp.max_tokens = 1.0, 0
    with pytest.raises(ValueError, match="max_tokens must be a positive integer, got 0"):
        llm.generate(["a red"], sp, use_tqdm=False)
    sp.max_tokens, sp.structured_outputs = 2, StructuredOutputsParams(choice=["yes", "no"])
    assert llm.generate(["a red"], sp, use_tqdm=False)[0].outputs[0].text in ("yes", "no")


@pytest.fixture(scope="module")
def url(llm):
    from kimi_jax.entrypoints.openai.server import OpenAIServer
    from tests.e2e.serving import serving
    with serving(OpenAIServer(llm.frontend, served_model_name="demo")) as u:
        yield u


def test_completion_top_logprobs_hold_the_sampled_token(url):
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    k = 3
    r = client.completions.create(model="demo", prompt="a red", max_tokens=24, temperature=1.5, seed=11,
                                  logprobs=k)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) > 0
    extra = 0
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == pytest.approx(tok_lp) and k <= len(top) <= k + 1
        extra += len(top) == k + 1
    assert extra > 0          # some sampled token was outside the top 3 and still listed
    chat = client.chat.completions.create(model="demo", messages=MSGS, max_tokens=8, temperature=1.5,
                                          seed=11, logprobs=True, top_logprobs=k)
    assert all(len(c.top_logprobs) == k for c in chat.choices[0].logprobs.content)


def test_readme_metric_names_are_exposed(url):
    import re
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        families = list(text_string_to_metric_families(r.read().decode()))
    exposed = {f.name for f in families} | {s.name for f in families for s in f.samples}
    with open("README.md", encoding="utf-8") as f:
        named = set(re.findall(r"`(kimi_jax:[a-z_]+)`", f.read()))
    assert "kimi_jax:compiled_programs_total" in named
    assert named <= exposed, sorted(named - exposed)


def _no_weights(monkeypatch):
    from kimi_jax.entrypoints import frontend

    def build(*a, **kw):
        raise AssertionError("the weights were loaded before the tokenizer was checked")
    monkeypatch.setattr(frontend, "load_model", build)
    monkeypatch.setattr(frontend, "random_model", build)


@pytest.mark.parametrize("drop,missing", [(["tiktoken.model"], "tiktoken.model"),
                                          (["tokenizer_config.json"], "tokenizer_config.json")])
def test_a_missing_tokenizer_file_fails_before_the_weights_load(tmp_path, monkeypatch, drop, missing):
    import shutil
    import time
    path = tmp_path / "ckpt"
    shutil.copytree(demo_model_path(), path, ignore=shutil.ignore_patterns(*drop))
    _no_weights(monkeypatch)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=missing) as e:
        LLM(str(path), dtype="float32")
    assert time.perf_counter() - t0 < 1.0 and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="tiktoken.model"):
        LLM(demo_model_path(), dtype="float32", tokenizer=str(tmp_path))


def test_a_checkpoint_without_a_tokenizer_warns_before_the_weights_load(tmp_path, monkeypatch, caplog):
    import logging
    import shutil
    path = tmp_path / "ckpt"
    shutil.copytree(demo_model_path(), path, ignore=shutil.ignore_patterns("tiktoken.model", "tokenizer_*"))
    _no_weights(monkeypatch)
    with caplog.at_level(logging.WARNING), pytest.raises(AssertionError, match="weights were loaded"):
        LLM(str(path), dtype="float32")
    assert any("has no tiktoken.model: prompts must be token ids" in r.getMessage() for r in caplog.records)


def test_serve_on_a_taken_port_fails_before_the_weights_load(cli, monkeypatch):
    from tests.e2e.serving import free_socket
    taken = free_socket()
    taken.listen(1)
    port = taken.getsockname()[1]
    _no_weights(monkeypatch)
    try:
        r = cli("launch.serve", f"--port={port}", "--dtype=float32")
    finally:
        taken.close()
    assert r.returncode == 2 and f"--port={port}: cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "weights were loaded" not in r.stderr and "listening on" not in r.stderr


def test_readme_kimi_profile_example_runs(cli, tmp_path):
    import re
    import shlex
    with open("README.md", encoding="utf-8") as f:
        (example,) = re.findall(r"`(kimi-profile --model=[^`]+)`", f.read())
    args = shlex.split(example.replace("\n", " "))[1:]
    r = cli("launch.profile", *args, "--compile_only", f"--out={tmp_path}")
    assert r.returncode == 0 and "all-reduce" in r.stdout, r
