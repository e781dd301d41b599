"""Rows with a grammar or multi-token bad words keep overlap scheduling: their decode steps split into a
forward half (dispatched before the previous token is read) and a sampling half (laid out once the
grammars have advanced). The demo model in float32, one batch mixing constrained and unconstrained rows:
every row's tokens equal the synchronous path's (overlap off) exactly, greedy and seeded sampling alike,
through a grammar that ends mid-batch, rows that finish, a row admitted and a row aborted mid-run, and
every json_schema output validates (jsonschema). Both step layouts (the ragged step splits the same way)."""
import json

import jsonschema
import pytest

from kimi_jax.engine.sampling import SamplingParams
from kimi_jax.engine.structured_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPTS = ["Tell me about a person:", "The sky is", "JSON please:", "Once upon a time", "A list of",
           "def main():"]


# the ragged layout: its steps (decode rows and prompt chunks together) split as the decode step is
LAYOUTS = {"padded": {}, "ragged": dict(step_layout="ragged", max_num_batched_tokens=64)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def llm(request):
    from kimi_jax.entrypoints.llm import LLM
    return LLM(None, dtype="float32", max_num_seqs=8, max_model_len=256, enable_prefix_caching=False,
               **LAYOUTS[request.param])


def _passes(llm) -> str:
    """The stat counting the steps that can overlap: decode passes, or every ragged step."""
    return "ragged_passes" if llm.engine_config.step_layout == "ragged" else "decode_passes"


def _json(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


def _run(llm, params, overlap: bool):
    """Every prompt with its params through a fresh core: (output ids per row, the core's stats)."""
    core = llm.frontend.make_core(overlap_scheduling=overlap)
    groups = [core.add_request(str(i), llm.inputs.token_ids(p), sp, seed=i)
              for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    core.run()
    assert core.scheduler.pool.num_free == core.scheduler.pool.num_pages    # every page came back
    return [g[0].output_ids for g in groups], core.stats


def _check_json(llm, ids):
    jsonschema.validate(json.loads(llm.tokenizer.decode(ids)), SCHEMA)


def test_a_mixed_batch_keeps_overlap_and_the_synchronous_tokens(llm):
    params = [_json(temperature=0.0), SamplingParams(temperature=0.0, max_tokens=30),
              _json(temperature=0.9, seed=5), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=2),
              SamplingParams(temperature=0.0, max_tokens=3),                    # finishes early
              SamplingParams(temperature=0.0, max_tokens=12,                   # a one-word choice, done at once
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))]
    got, stats = _run(llm, params, overlap=True)
    ref, ref_stats = _run(llm, params, overlap=False)
    assert got == ref
    assert ref_stats["overlapped_steps"] == 0 and stats["overlapped_steps"] > stats[_passes(llm)] // 2
    for i in (0, 2):
        _check_json(llm, got[i])
    assert llm.tokenizer.decode(got[5]) in ("yes", "no")


def test_multi_token_bad_words_keep_overlap(llm):
    words = ["the sky", " of the", "is a"]
    params = [SamplingParams(temperature=0.0, max_tokens=24, bad_words=words) if i % 2 == 0
              else SamplingParams(temperature=0.0, max_tokens=24) for i in range(len(PROMPTS))]
    got, stats = _run(llm, params, overlap=True)
    ref, _ = _run(llm, params, overlap=False)
    assert got == ref and stats["overlapped_steps"] > 0
    for i in range(0, len(PROMPTS), 2):
        text = llm.tokenizer.decode(got[i])
        assert not any(w in text for w in words)


def test_admission_and_abort_during_overlap(llm):
    """A constrained row and an unconstrained one decode overlapped; another constrained request is
    admitted mid-run and the unconstrained one is aborted mid-run: the constrained outputs equal
    their runs alone on the synchronous path."""
    def alone(i, sp):
        core = llm.frontend.make_core(overlap_scheduling=False)
        [r] = core.add_request("a", llm.inputs.token_ids(PROMPTS[i]), sp, seed=i)
        core.run()
        return r.output_ids

    core = llm.frontend.make_core(overlap_scheduling=True)
    [a] = core.add_request("a", llm.inputs.token_ids(PROMPTS[0]), _json(temperature=0.0), seed=0)
    [b] = core.add_request("b", llm.inputs.token_ids(PROMPTS[1]), SamplingParams(temperature=0.0, max_tokens=60),
                           seed=1)
    for _ in range(6):
        core.step()
    assert core.stats["overlapped_steps"] > 0 and core.runner.inflight is not None
    [c] = core.add_request("c", llm.inputs.token_ids(PROMPTS[2]), _json(temperature=0.9, seed=7), seed=2)
    for _ in range(3):
        core.step()
    assert core.abort("b") is b and b.finish_reason == "abort" and b.pages == []
    core.run()
    assert core.scheduler.pool.num_free == core.scheduler.pool.num_pages
    assert a.output_ids == alone(0, _json(temperature=0.0))
    assert c.output_ids == alone(2, _json(temperature=0.9, seed=7))
    _check_json(llm, a.output_ids), _check_json(llm, c.output_ids)
