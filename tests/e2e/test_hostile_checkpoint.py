"""Checkpoint directories that lie: a config.json asking for more than the weights hold, token ids
outside the vocabulary, tokenizer files that are incomplete or absurd, config.json files that are not
configs. Each is refused before anything is built, quickly, in one line naming the file and field;
no hostile field value gets past from_hf_dict as anything but a ConfigError."""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from kimi_jax.config import ConfigError, ModelConfig
from kimi_jax.entrypoints.weights import read_checkpoint_config

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "checkpoints", "demo")
# a refusal must come before any model is built: reading headers and small JSON files takes
# milliseconds; 5 s leaves room for a loaded machine (building 10^6 layers took minutes)
QUICK_S = 5.0


def _copy(src: str, dst, edit_config=None, edit_tok=None, drop=()) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    for name, edit in (("config.json", edit_config), ("tokenizer_config.json", edit_tok)):
        if edit is not None:
            f = os.path.join(dst, name)
            with open(f) as fh:
                d = json.load(fh)
            edit(d)
            with open(f, "w") as fh:
                json.dump(d, fh)
    for name in drop:
        os.remove(os.path.join(dst, name))
    return dst


def _refused(path: str, *words: str, exc=ValueError) -> str:
    t0 = time.perf_counter()
    with pytest.raises(exc) as e:
        read_checkpoint_config(path)
    took = time.perf_counter() - t0
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert took < QUICK_S, took
    return msg


@pytest.mark.parametrize("field,value,words", [
    ("num_hidden_layers", 10**6, ["num_hidden_layers", "config.json"]),
    ("num_hidden_layers", 5, ["num_hidden_layers=5", "layers 0..3"]),
    ("n_routed_experts", 10**6, ["n_routed_experts", "config.json"]),
    ("num_hidden_layers", 1e6, ["'num_hidden_layers'", "integer"]),
    ("bos_token_id", 4096, ["bos_token_id=4096", "vocab_size=4096"]),
    ("eos_token_id", [3841, 10**9], ["eos_token_id=1000000000", "vocab_size"]),
    ("pad_token_id", -1, ["'pad_token_id'"]),
])
def test_config_beyond_the_weights_or_vocab_is_refused_quickly(tmp_path, field, value, words):
    _refused(_copy(DEMO, tmp_path / "c", edit_config=lambda d: d.__setitem__(field, value)), *words)


def test_from_pretrained_only_parses_and_read_checkpoint_config_checks_the_files(tmp_path):
    path = _copy(DEMO, tmp_path / "c", edit_config=lambda d: d.update(num_hidden_layers=10**6))
    assert ModelConfig.from_pretrained(path).num_hidden_layers == 10**6
    _refused(path, "num_hidden_layers", "config.json")


def test_llm_refuses_a_million_layers_before_building(tmp_path):
    from kimi_jax import LLM
    path = _copy(DEMO, tmp_path / "c", edit_config=lambda d: d.__setitem__("num_hidden_layers", 10**6))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="num_hidden_layers"):
        LLM(path, dtype="float32")
    assert time.perf_counter() - t0 < QUICK_S


@pytest.mark.parametrize("edit,words", [
    (lambda d: d.__setitem__("num_reserved_special_tokens", 10**8), ["tokenizer_config.json", "num_reserved_special_tokens"]),
    (lambda d: d.__setitem__("num_reserved_special_tokens", "256"), ["num_reserved_special_tokens"]),
    (lambda d: d["added_tokens_decoder"].__setitem__("5000", {"content": "[EOS]"}) or
     d["added_tokens_decoder"].pop("3841"), ["eos_token", "5000", "vocab_size=4096"]),
])
def test_tokenizer_config_that_cannot_match_the_model_is_refused(tmp_path, edit, words):
    _refused(_copy(DEMO, tmp_path / "c", edit_tok=edit), *words)


def test_tokenizer_config_without_its_tiktoken_file_is_refused_at_load(tmp_path):
    path = _copy(DEMO, tmp_path / "c", drop=["tiktoken.model"])
    _refused(path, "tiktoken.model", "missing")
    from kimi_jax import LLM
    with pytest.raises(ValueError, match="tiktoken.model"):
        LLM(path, dtype="float32")


def test_a_tokenizer_config_that_is_not_json_names_the_file(tmp_path):
    path = _copy(DEMO, tmp_path / "c")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    _refused(path, "tokenizer_config.json")


@pytest.mark.parametrize("text,words", [
    ("[1, 2, 3]", ["config.json", "JSON object", "list"]),
    ("[" * 100_000 + "]" * 100_000, ["config.json", "nested too deeply"]),
    ("\"a string\"", ["config.json", "JSON object"]),
    ("{\"model_type\": \"kimi_k2\"", ["config.json", "not valid JSON"]),
    (b"\xff\xfe{}", ["config.json", "not valid JSON"]),
])
def test_config_json_that_is_not_a_config(tmp_path, text, words):
    path = _copy(DEMO, tmp_path / "c")
    with open(os.path.join(path, "config.json"), "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode())
    _refused(path, *words, exc=ConfigError)


HOSTILE_VALUES = [None, True, -1, 0, 1e308, float("nan"), "12", [], [1], {}, {"a": 1}, 2**70, [[[[]]]]]


def test_every_field_with_every_hostile_value_is_a_config_error():
    """Each config.json field of the demo model replaced by each hostile value: from_hf_dict
    accepts it or raises ConfigError (a ValueError) in one line; never TypeError, KeyError,
    AttributeError or OverflowError."""
    with open(os.path.join(DEMO, "config.json")) as f:
        base = json.load(f)
    fields = list(base) + ["text_config", "rope_parameters"]
    seen = 0
    for field in fields:
        for v in HOSTILE_VALUES:
            raw = json.loads(json.dumps(base))
            raw[field] = v
            try:
                ModelConfig.from_hf_dict(raw)
            except ConfigError as e:
                assert "\n" not in str(e)
                seen += 1
    for sub in ("rope_scaling", "quantization_config"):
        for key in list(base[sub]):
            for v in HOSTILE_VALUES:
                raw = json.loads(json.dumps(base))
                raw[sub][key] = v
                try:
                    ModelConfig.from_hf_dict(raw)
                except ConfigError:
                    seen += 1
    assert seen > 200           # most of them are refused (the rest are fields the math ignores)


def test_an_added_token_beyond_the_vocabulary_is_refused(tmp_path):
    edit = lambda d: d["added_tokens_decoder"].__setitem__("4096", {"content": "<|extra|>", "special": True})
    _refused(_copy(DEMO, tmp_path / "c", edit_tok=edit), "tokenizer_config.json", "'<|extra|>'", "id 4096",
             "vocab_size=4096")


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "directory", "dangling"])
def test_a_weights_file_that_is_not_a_regular_file_says_what_it_is(tmp_path, kind):
    from kimi_jax import LLM
    path = _copy(DEMO, tmp_path / "c", drop=["model.safetensors"])
    f = os.path.join(path, "model.safetensors")
    {"dev-zero": lambda: os.symlink("/dev/zero", f), "fifo": lambda: os.mkfifo(f),
     "directory": lambda: os.mkdir(f), "dangling": lambda: os.symlink(str(tmp_path / "gone"), f)}[kind]()
    want = {"dev-zero": "a symlink to /dev/zero, a character device", "fifo": "a FIFO",
            "directory": "a directory", "dangling": "cannot be opened"}[kind]
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        LLM(path, dtype="float32")
    assert "model.safetensors: not a regular file" in str(e.value) and want in str(e.value), e.value
    assert time.perf_counter() - t0 < QUICK_S


def test_a_chat_template_beyond_the_limit_is_refused_naming_the_file(tmp_path):
    from kimi_jax import LLM
    from kimi_jax.text.chat_template import MAX_TEMPLATE_BYTES
    path = _copy(DEMO, tmp_path / "c")
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("{{ messages[0].content }}" + "x" * (10 * 2**20))
    llm = LLM(path, dtype="float32", max_num_seqs=2, max_model_len=64)
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert "chat_template.jinja" in str(e.value) and f"MAX_TEMPLATE_BYTES={MAX_TEMPLATE_BYTES}" in str(e.value)
    assert time.perf_counter() - t0 < QUICK_S
