"""The runner's declared program set covers a mixed workload: after EngineCore.precompile no program
is built while greedy, sampled, penalised, logprobs 0 / 5 / 20, prompt-logprobs and json_schema requests
with prompts of 1 token up to max_model_len run concurrently (kimi_jax.engine.compiles counts every
jit cache miss)."""
import json

import jsonschema
import numpy as np

from kimi_jax.engine import compiles
from kimi_jax.engine.sampling import SamplingParams
from kimi_jax.engine.structured_params import StructuredOutputsParams
from kimi_jax.entrypoints.llm import LLM, demo_model_path

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
          "additionalProperties": False}


def test_no_program_is_built_after_precompile():
    compiles.install()
    llm = LLM(demo_model_path(), dtype="float32", max_num_seqs=2, max_model_len=64, block_size=16, prefill_chunk=16,
              max_prefill_tokens=32, enable_prefix_caching=False)
    core = llm.frontend.make_core()
    before = compiles.compile_count()
    n = core.precompile()
    # 18 whole-step programs and, under overlap scheduling, the split decode step's 6 halves (a forward
    # half per decode shape, a greedy and a sampling half per batch): the json_schema row takes them
    assert n == len(core.runner.programs(core.limits())) == len(core.programs()) <= 24
    assert compiles.compile_count() - before >= n          # each program lowered once (called or compiled ahead)
    built = compiles.compile_count()

    rng = np.random.default_rng(0)
    V = llm.config.vocab_size
    lens = [1, 5, 17, 40, 63, 9, 2, 30]
    params = [SamplingParams(temperature=0.0, max_tokens=4),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, seed=1),
              SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=8, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=1, logprobs=5),
              SamplingParams(temperature=0.7, max_tokens=3, logprobs=20, prompt_logprobs=3, seed=2),
              SamplingParams(temperature=0.0, max_tokens=20, logit_bias={7: 2.0}, min_tokens=2),
              SamplingParams(temperature=1.0, max_tokens=24, seed=3,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))]
    reqs = [r for i, (n, sp) in enumerate(zip(lens, params))
            for r in core.make_request(str(i), rng.integers(2, V, n).tolist(), sp, seed=i)]
    for r in reqs:
        core.add([r])
    core.run()
    assert all(r.finish_reason in ("stop", "length") for r in reqs)
    assert len(reqs[5].logprobs) == 3 and all(len(lp) >= 20 for lp in reqs[5].logprobs)
    assert len(reqs[5].prompt_logprobs) == lens[5]
    jsonschema.validate(json.loads(llm.tokenizer.decode(reqs[7].output_ids)), SCHEMA)
    assert compiles.compile_count() == built
