"""EngineConfig: every field checked when the config is made, one line naming the field; the one dtype
rule; max_logprobs against a request's logprobs."""
import json

import pytest

from kimi_jax.engine.args import EngineConfig
from kimi_jax.engine.sampling import SamplingParams
from kimi_jax.engine.speculative import SpeculativeConfig


@pytest.mark.parametrize("kw,field", [
    (dict(model="no/such/dir"), "model"), (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(data_parallel_size=1.5), "data_parallel_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_model_len=0), "max_model_len"), (dict(block_size=0), "block_size"),
    (dict(num_gpu_blocks_override=1), "num_gpu_blocks_override"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"), (dict(prefill_chunk=0), "prefill_chunk"),
    (dict(max_prefill_tokens=0), "max_prefill_tokens"), (dict(dtype="float16"), "dtype"),
    (dict(speculative_config="{"), "speculative_config"), (dict(speculative_config={"bogus": 1}), "speculative_config"),
    (dict(overlap_scheduling="yes"), "overlap_scheduling"), (dict(seed="7"), "seed"),
    (dict(max_logprobs=-2), "max_logprobs"), (dict(precompile=1), "precompile"),
    (dict(trust_remote_code=1), "trust_remote_code"),
    (dict(enforce_eager=True, precompile=True), "enforce_eager"),
    (dict(step_layout="flat"), "step_layout"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(step_layout="ragged", max_num_seqs=64, max_num_batched_tokens=32),
     "max_num_batched_tokens"),
])
def test_bad_field_is_one_line_naming_it(kw, field):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kw)
    msg = str(e.value)
    assert msg.startswith(field) and "\n" not in msg, msg


def test_config_is_frozen_and_parses_speculation():
    cfg = EngineConfig("tiny", speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 2}))
    assert isinstance(cfg.speculative_config, SpeculativeConfig) and cfg.speculative_config.num_speculative_tokens == 2
    with pytest.raises(AttributeError):
        cfg.max_num_seqs = 3
    assert cfg.replace(max_num_seqs=3).max_num_seqs == 3 and cfg.model_path is None


def test_one_dtype_rule(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert EngineConfig().resolve_dtype("cpu") == "float32"
    assert EngineConfig(str(tmp_path)).resolve_dtype("gpu") == "float32"          # the checkpoint's
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"torch_dtype": "float16"}}))
    assert EngineConfig(str(tmp_path)).resolve_dtype("gpu") == "bfloat16"         # unsupported: bfloat16
    assert EngineConfig("tiny").resolve_dtype("gpu") == "bfloat16"
    assert EngineConfig(dtype="bfloat16").resolve_dtype("cpu") == "bfloat16"


def test_max_logprobs_caps_logprobs_and_prompt_logprobs():
    SamplingParams(logprobs=20, prompt_logprobs=20).validate(vocab_size=512, max_logprobs=20)
    SamplingParams(logprobs=300).validate(vocab_size=512, max_logprobs=-1)
    with pytest.raises(ValueError, match="^logprobs 25 exceeds max_logprobs 20$"):
        SamplingParams(logprobs=25).validate(vocab_size=512, max_logprobs=20)
    with pytest.raises(ValueError, match="^prompt_logprobs 21 exceeds max_logprobs 20$"):
        SamplingParams(prompt_logprobs=21).validate(vocab_size=512, max_logprobs=20)


def test_the_token_budget_defaults_to_the_prefill_budget():
    assert EngineConfig().batched_tokens() == 2048 and EngineConfig().step_layout == "padded"
    assert EngineConfig(max_num_seqs=4096).batched_tokens() == 4096
    assert EngineConfig(step_layout="ragged", max_num_batched_tokens=512).batched_tokens() == 512
