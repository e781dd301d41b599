"""Every console script as a vLLM user runs it (the entry points of pyproject.toml, in this process
through the `cli` fixture): --help prints the tool's own flags and exits 0, flag names take vLLM's
dash spelling too, a usage error is one line on stderr with exit status 2; kimi-make-synthetic's
--model; kimi-convert keeps the tokenizer and template files (its output generates the same text);
the persistent compilation cache and the progress lines."""
import filecmp
import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from kimi_jax.entrypoints import compilation_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _f:
    SCRIPTS = tomllib.load(_f)["project"]["scripts"]

# one flag (or suite) of each tool's own that its --help must show
OWN = {"kimi-generate": "--max-tokens", "kimi-bench": "throughput", "kimi-batch": "--default-max-tokens",
       "kimi-plan": "--hardware", "kimi-profile": "--compile-only", "kimi-convert": "--verify",
       "kimi-make-synthetic": "--num-layers", "kimi-serve": "--served-model-name",
       "kimi-bench-serve": "--max-concurrency"}


def _module(script: str) -> str:
    module, func = SCRIPTS[script].split(":")
    assert func == "run", SCRIPTS[script]
    return module


def test_every_console_script_is_covered():
    assert set(OWN) == set(SCRIPTS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_prints_the_tools_own_flags_and_exits_0(cli, script):
    for arg in ("--help", "-h"):
        r = cli(_module(script), arg)
        assert r.returncode == 0, r
        assert OWN[script] in r.stdout, r.stdout[:2000]
        assert "--helpfull" in r.stdout or script == "kimi-bench"      # kimi-bench has suites, not flags
        assert "Try --helpfull" not in r.stdout + r.stderr and r.stderr == ""


def test_dash_spelling_is_the_same_flag(cli):
    """--tensor-parallel-size == --tensor_parallel_size, --no-engine-artifacts == --noengine_artifacts."""
    common = ["--model=tiny", "--hardware=h200", "--batch=2", "--context=64"]
    a = cli("launch.plan", *common, "--tensor_parallel_size=2", "--noengine_artifacts")
    b = cli("launch.plan", *common, "--tensor-parallel-size", "2", "--no-engine-artifacts")
    assert a.returncode == b.returncode == 0, (a, b)
    assert a.stdout == b.stdout and "TP2" in a.stdout
    from launch import common as launch_common
    assert launch_common.normalize_argv(["--no-xla-perf", "--max-prefill-tokens=3", "--prefill-chunk", "4",
                                         "--no-such-flag", "-v", "--", "--tensor-parallel-size"]) == [
        "--noxla_perf", "--max_prefill_tokens=3", "--prefill_chunk", "4", "--no_such_flag", "-v", "--",
        "--tensor-parallel-size"]


@pytest.mark.parametrize("module,args", [
    ("launch.plan", ["--bogus"]),
    ("launch.plan", ["--model=nosuch"]),
    ("launch.plan", ["--hardware=nosuch"]),
    ("launch.plan", ["--hardware=/no/such/calibration.json"]),
    ("launch.plan", ["--tensor_parallel_size=3"]),
    ("launch.plan", ["--model=tiny", "--config_override=nosuch=1"]),
    ("launch.profile", ["--model=nosuch"]),
    ("launch.profile", ["--model=tiny", "--config_override=hidden_size"]),
    ("launch.profile", ["--model=tiny", "--tensor-parallel-size=3", "--compile_only"]),
    ("launch.make_synthetic", ["--model=nosuch", "--out=/tmp/kimi_never_written"]),
    ("launch.make_synthetic", ["--num-layers=2"]),                     # no --out
    ("launch.make_synthetic", ["--noweights", "--out=/tmp/kimi_never_written"]),   # nothing to write
    ("launch.make_synthetic", ["--model=tiny", "--noweights", "--synthetic_tokenizer",  # vocab too small
                               "--out=/tmp/kimi_never_written"]),
    ("launch.convert", ["--model=/no/such/checkpoint", "--out=/tmp/kimi_never_written"]),
    ("launch.batch", ["--output=/tmp/kimi_never_written.jsonl"]),     # no --input
    ("launch.bench", ["int4", "--bogus"]),
    ("launch.bench", ["throughput", "--batches"]),                   # a flag without its value
    ("launch.generate", ["--step_layout=flat"]),
    ("launch.generate", ["--step_layout=ragged", "--max_num_batched_tokens=0"]),
    ("launch.batch", ["--input=/dev/null", "--output=/tmp/kimi_never_written.jsonl",
                      "--long_prefill_token_threshold=-1"]),
])
def test_usage_errors_are_one_line_and_exit_2(cli, module, args):
    r = cli(module, *args)
    lines = r.stderr.strip().splitlines()
    prog = {"launch.bench": f"kimi-bench {args[0]}", "launch.make_synthetic": "kimi-make-synthetic"}.get(
        module, "kimi-" + module.split(".")[1])
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), r
    assert "Traceback" not in r.stderr


def _digest(path: str) -> dict:
    return {f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest() for f in sorted(os.listdir(path))}


def test_make_synthetic_takes_model_and_keeps_preset_as_its_alias(cli, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    args = ["--num-layers=2", "--num-experts=8", "--vocab-size=512", "--seed=3"]
    ra = cli("launch.make_synthetic", "--model=tiny", f"--out={a}", *args)
    rb = cli("launch.make_synthetic", "--preset=tiny", f"--out={b}", *args)
    assert ra.returncode == rb.returncode == 0, (ra, rb)
    assert _digest(a) == _digest(b) and "model.safetensors" in _digest(a)
    cfg = json.load(open(os.path.join(a, "config.json")))
    assert cfg["num_hidden_layers"] == 2 and cfg["n_routed_experts"] == 8 and cfg["vocab_size"] == 512


def test_make_synthetic_writes_a_kimi_shaped_tokenizer_a_preset_serves_grammars_with(cli, tmp_path):
    """--noweights --synthetic_tokenizer: only the tokenizer files, of the model's vocabulary (its
    ranks, then Kimi's specials at their offsets, as the real tokenizer); text round-trips through
    them, the same flags write the same bytes, and a preset given that tokenizer (kimi-serve --model
    PRESET --tokenizer DIR) takes a json_schema request whose output validates."""
    import jsonschema
    from kimi_jax.config import preset
    from kimi_jax.engine.sampling import SamplingParams
    from kimi_jax.engine.structured_params import StructuredOutputsParams
    from kimi_jax.entrypoints.inputs import load_tokenizer
    from kimi_jax.entrypoints.llm import LLM
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    args = ["--model=tiny", "--vocab-size=8192", "--noweights", "--synthetic_tokenizer"]
    ra, rb = cli("launch.make_synthetic", *args, f"--out={a}"), cli("launch.make_synthetic", *args, f"--out={b}")
    assert ra.returncode == rb.returncode == 0, (ra, rb)
    assert _digest(a) == _digest(b) and set(_digest(a)) == {"tiktoken.model", "tokenizer_config.json",
                                                            "chat_template.jinja"}
    tok = load_tokenizer(a, None)
    assert tok.num_base_tokens == 8192 - 256 and tok.encode("[BOS]", allow_special=True) == [8192 - 256]
    text = 'Some text, {"key": [1, 2]} and 汉字\n'
    assert tok.decode(tok.encode(text)) == text
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    llm = LLM(preset("tiny").replace(vocab_size=8192), tokenizer=a, dtype="float32", max_num_seqs=2,
              max_model_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=24,
                        structured_outputs=StructuredOutputsParams(json=schema))
    out = llm.generate(["A number:"], sp)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), schema)


def test_convert_keeps_tokenizer_and_template_files_and_its_output_generates_the_same_text(cli, tmp_path):
    """kimi-convert of the demo model: every file beside the weights is copied unchanged (config.json,
    tokenizer_config.json, tiktoken.model, chat_template.jinja, ...), and greedy text from the orbax
    output equals the text from the source (float32 both: the same weights, bit for bit)."""
    from kimi_jax.entrypoints.llm import demo_model_path
    demo, out = demo_model_path(), str(tmp_path / "orbax")
    assert demo is not None
    r = cli("launch.convert", f"--model={demo}", f"--out={out}", "--dtype=float32")
    assert r.returncode == 0, r
    side = [f for f in os.listdir(demo) if not f.endswith(".safetensors")]
    assert {"config.json", "tokenizer_config.json", "tiktoken.model", "chat_template.jinja"} <= set(side)
    for f in side:
        assert filecmp.cmp(os.path.join(demo, f), os.path.join(out, f), shallow=False), f
    gen = ["--max-tokens=6", "--temperature=0", "--dtype=float32", "--prompt=The with statement"]
    src, conv = cli("launch.generate", f"--model={demo}", *gen), cli("launch.generate", f"--model={out}", *gen)
    assert src.returncode == conv.returncode == 0, (src, conv)
    assert conv.stdout == src.stdout and len(src.stdout.strip()) > len("The with statement")


def test_generate_reports_loading_on_stderr_and_nothing_else(cli):
    """stderr (not a terminal here) gets one line per finished phase: the weights' load and any
    compilation of 0.5 s or more; no absl or JAX backend lines."""
    r = cli("launch.generate", "--max-tokens=2", "--temperature=0")
    assert r.returncode == 0, r
    lines = r.stderr.strip().splitlines()
    assert any(re.fullmatch(r"loading weights \.\.\. \d+\.\d s", x) for x in lines), lines
    phase = r"(loading weights|compiling .+|loading compiled .+ from the cache) \.\.\. \d+\.\d s"
    assert all(re.fullmatch(phase, x) for x in lines), lines
    quiet = cli("launch.generate", "--max-tokens=2", "--temperature=0", "--no-progress")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == r.stdout


@pytest.mark.parametrize("module,args", [("launch.generate", []), ("launch.serve", []),
                                         ("launch.batch", ["--input=/dev/null", "--output=OUT"])])
def test_enable_prefix_caching_flag_reaches_the_engine(cli, monkeypatch, tmp_path, module, args):
    """--enable-prefix-caching (default on) / --no-enable-prefix-caching is EngineConfig.enable_prefix_caching;
    the Frontend every launcher loads the model through is stopped before it loads anything (a
    ValueError: the launchers' one-line exit 2)."""
    from kimi_jax.entrypoints.frontend import Frontend
    seen = []

    def spy(cls, engine_config):
        seen.append(engine_config.enable_prefix_caching)
        raise ValueError("stopped by the test")
    monkeypatch.setattr(Frontend, "from_config", classmethod(spy))
    for flag, want in (([], True), (["--no-enable-prefix-caching"], False), (["--enable_prefix_caching"], True)):
        r = cli(module, "--model=tiny", *[a.replace("OUT", str(tmp_path / "out.jsonl")) for a in args], *flag)
        assert r.returncode == 2 and "stopped by the test" in r.stderr, r
        assert seen.pop() is want



@pytest.mark.parametrize("module,args", [("launch.generate", []), ("launch.serve", []),
                                         ("launch.batch", ["--input=/dev/null", "--output=OUT"])])
def test_batch_invariant_flag_reaches_the_engine(cli, monkeypatch, tmp_path, module, args):
    """--batch-invariant / --no-batch-invariant is EngineConfig.batch_invariant; without the flag
    VLLM_BATCH_INVARIANT=1 turns it on (the Frontend is stopped before it loads anything)."""
    from kimi_jax.entrypoints.frontend import Frontend
    seen = []

    def spy(cls, engine_config):
        seen.append(engine_config.batch_invariant)
        raise ValueError("stopped by the test")
    monkeypatch.setattr(Frontend, "from_config", classmethod(spy))
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    for env, flag, want in ((None, [], False), (None, ["--batch-invariant"], True),
                            ("1", [], True), ("1", ["--no-batch_invariant"], False)):
        if env:
            monkeypatch.setenv("VLLM_BATCH_INVARIANT", env)
        r = cli(module, "--model=tiny", *[a.replace("OUT", str(tmp_path / "out.jsonl")) for a in args], *flag)
        assert r.returncode == 2 and "stopped by the test" in r.stderr, r
        assert seen.pop() is want

def test_vllm_launch_flags_are_accepted_with_their_meaning_here(cli, monkeypatch, tmp_path):
    """kimi-serve takes vLLM's --trust-remote-code / --enable-auto-tool-choice / --tool-call-parser
    kimi_k2 / --reasoning-parser kimi_k2 (another parser: one line, exit 2, before any loading);
    kimi-batch takes run-batch's -i / -o."""
    from launch import common as launch_common
    from kimi_jax.entrypoints.frontend import Frontend
    seen = []

    def spy(cls, engine_config):
        seen.append((engine_config.trust_remote_code, launch_common.FLAGS["input"].value
                     if "input" in launch_common.FLAGS else None))
        raise ValueError("stopped by the test")
    monkeypatch.setattr(Frontend, "from_config", classmethod(spy))
    r = cli("launch.serve", "--model=tiny", "--trust-remote-code", "--enable-auto-tool-choice",
            "--tool-call-parser", "kimi_k2", "--reasoning-parser=kimi_k2")
    assert r.returncode == 2 and "stopped by the test" in r.stderr and seen.pop() == (True, None), r
    for flag in ("--tool-call-parser=hermes", "--reasoning-parser=deepseek_r1"):
        r = cli("launch.serve", "--model=tiny", flag)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and not seen, r
        assert lines[0].startswith("kimi-serve: error: " + flag.split("=")[0]), r
        assert "kimi_k2" in lines[0], r
    r = cli("launch.batch", "--model=tiny", "-i", "/dev/null", "-o", str(tmp_path / "out.jsonl"))
    assert r.returncode == 2 and "stopped by the test" in r.stderr, r
    assert seen.pop() == (False, "/dev/null")


def test_serve_runs_the_ragged_layout_compiled_before_ready_by_default(cli, monkeypatch):
    """kimi-serve's defaults: step_layout 'ragged' and precompile on; --enforce-eager turns the
    precompile off, --speculative-config keeps both (drafts are verified in the ragged step) and
    the padded layout compiles on first use unless --precompile; given flags win
    (LLM's own defaults are padded and lazy: not changed here)."""
    from kimi_jax.engine.args import EngineConfig
    from kimi_jax.entrypoints.frontend import Frontend
    seen = []

    def spy(cls, engine_config):
        seen.append((engine_config.step_layout, engine_config.precompile))
        raise ValueError("stopped by the test")
    monkeypatch.setattr(Frontend, "from_config", classmethod(spy))
    spec = '--speculative-config={"method": "ngram", "num_speculative_tokens": 2}'
    for flags_, want in (([], ("ragged", True)), (["--enforce-eager"], ("ragged", False)),
                         ([spec], ("ragged", True)), (["--step_layout=padded"], ("padded", False)),
                         (["--step_layout=padded", "--precompile"], ("padded", True)),
                         (["--noprecompile"], ("ragged", False))):
        r = cli("launch.serve", "--model=tiny", *flags_)
        assert r.returncode == 2 and "stopped by the test" in r.stderr, (flags_, r)
        assert seen.pop() == want, flags_
    defaults = EngineConfig()
    assert (defaults.step_layout, defaults.precompile) == ("padded", False)


def test_precompile_and_enforce_eager_together_are_one_line_naming_both(cli):
    r = cli("launch.serve", "--model=tiny", "--precompile", "--enforce-eager")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("kimi-serve: error: "), r
    assert "--enforce_eager" in lines[0] and "--precompile" in lines[0], r


def test_vllm_llm_keywords_and_a_max_model_len_past_the_model(cli, caplog):
    """LLM(trust_remote_code=True, enforce_eager=True) builds (one warning: no checkpoint code);
    a max_model_len past the model's positions is refused naming both, from LLM and kimi-serve."""
    import logging

    from kimi_jax import LLM
    from kimi_jax.config import preset
    cfg = preset("tiny").replace(num_hidden_layers=1, vocab_size=256)
    with caplog.at_level(logging.WARNING, logger="kimi_jax.entrypoints.frontend"):
        llm = LLM(cfg, dtype="float32", max_num_seqs=1, max_model_len=32, trust_remote_code=True,
                  enforce_eager=True)
    assert llm.max_model_len == 32
    warned = [r.getMessage() for r in caplog.records if "trust_remote_code" in r.getMessage()]
    assert len(warned) == 1 and "no code from the checkpoint" in warned[0], warned
    with pytest.raises(ValueError) as e:
        LLM(cfg, dtype="float32", max_num_seqs=1, max_model_len=4096)
    assert str(e.value) == "max_model_len=4096 exceeds the model's max_position_embeddings (256)"
    r = cli("launch.serve", "--max-model-len", "4096")       # the demo model: 1024 positions
    assert r.returncode == 2 and "max_model_len=4096" in r.stderr and "(1024)" in r.stderr, r


# ---- the persistent compilation cache ----------------------------------------------------------------
class _Config:
    """The part of jax.config that compilation_cache.enable reads and sets."""

    def __init__(self, **kw):
        self.jax_enable_compilation_cache = True
        self.jax_compilation_cache_dir = None
        self.jax_persistent_cache_min_compile_time_secs = 1.0
        self.__dict__.update(kw)

    def update(self, name, value):
        setattr(self, name, value)


def test_compilation_cache_location_and_switches(tmp_path, monkeypatch):
    monkeypatch.delenv(compilation_cache.ENV, raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    c = _Config()
    assert compilation_cache.enable(config=c) == str(tmp_path / "xdg" / "kimi_jax" / "xla")
    assert c.jax_compilation_cache_dir == str(tmp_path / "xdg" / "kimi_jax" / "xla") and os.path.isdir(
        c.jax_compilation_cache_dir)
    assert c.jax_persistent_cache_min_compile_time_secs == 0.0        # every program is cached
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compilation_cache.default_dir() == str(tmp_path / "home" / ".cache" / "kimi_jax" / "xla")
    # the environment variable moves it or turns it off
    monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "moved"))
    assert compilation_cache.enable(config=_Config()) == str(tmp_path / "moved")
    monkeypatch.setenv(compilation_cache.ENV, "none")
    c = _Config()
    assert compilation_cache.enable(config=c) is None and c.jax_enable_compilation_cache is False
    assert c.jax_compilation_cache_dir is None
    # a cache the user configured through JAX is kept; an explicit path (the flag) wins over both
    monkeypatch.delenv(compilation_cache.ENV)
    c = _Config(jax_compilation_cache_dir="/theirs")
    assert compilation_cache.enable(config=c) == "/theirs" and c.jax_persistent_cache_min_compile_time_secs == 1.0
    assert compilation_cache.enable(config=_Config(jax_enable_compilation_cache=False)) is None
    c = _Config(jax_compilation_cache_dir="/theirs")
    assert compilation_cache.enable("none", config=c) is None and c.jax_enable_compilation_cache is False
    assert compilation_cache.enable(str(tmp_path / "flag"), config=c) == str(tmp_path / "flag")


def test_llm_fills_the_default_cache_directory(tmp_path):
    """A fresh interpreter with no JAX cache configured: creating an LLM (random weights of a one-layer
    tiny model: its initializer is compiled) writes compiled programs under $XDG_CACHE_HOME/kimi_jax/xla."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", compilation_cache.ENV)
           and not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=ROOT)
    code = ("from kimi_jax import LLM; from kimi_jax.config import preset; "
            "LLM(preset('tiny').replace(num_hidden_layers=1, vocab_size=256), dtype='float32', max_num_seqs=1, "
            "max_model_len=32)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert os.listdir(tmp_path / "kimi_jax" / "xla")


def test_command_buffer_update_mode_reaches_xla_flags_only_where_xla_knows_it():
    """--command_buffer_update_mode becomes one XLA_FLAGS entry on jaxlib >= 0.11.2 (where the skip modes were
    measured); 'always' and older jaxlibs leave XLA's own setting, and 'auto' is COMMAND_BUFFER_AUTO."""
    from launch import common as launch_common
    flag = launch_common.command_buffer_xla_flag
    assert flag("skip_profiled", "0.11.2") == "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"
    assert flag("skip_temp", "0.12.0rc1") == "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    assert flag("skip_temp", "0.10.2") is flag("skip_profiled", "0.11.1") is flag("skip_temp", None) is None
    assert flag("always", "0.11.2") is None
    assert flag("auto", "0.11.2") == flag(launch_common.COMMAND_BUFFER_AUTO, "0.11.2")


def test_jaxlib_0_10_aborts_on_a_skip_update_mode():
    """Why the gate above exists: jaxlib 0.10.2's XLA has no SKIP_* update modes and rejects XLA_FLAGS naming
    one (the process fails at its first computation)."""
    import importlib.metadata
    import subprocess
    import sys
    if not importlib.metadata.version("jaxlib").startswith("0.10."):
        pytest.skip("the rejected value is jaxlib 0.10's")
    env = dict(os.environ, XLA_FLAGS="--xla_gpu_command_buffer_update_mode=SKIP_PROFILED")
    done = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(2).sum()))"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "2.0" not in done.stdout
