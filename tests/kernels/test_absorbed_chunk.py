"""Chunk prefill after cached tokens through the absorbed paged kernel (ExecPlan.absorbed_chunk_tokens):
the same prompt logprobs and greedy tokens as the expanded path, and the block-table widths it takes."""
import dataclasses

import numpy as np

from kimi_jax import ops
from kimi_jax.config import preset
from kimi_jax.engine import shapes
from kimi_jax.engine.sampling import SamplingParams
from kimi_jax.entrypoints.llm import LLM
from pallas_kernels.mla import decode as md

# the kernel's tiles need A and R powers of two >= 16 (the tiny preset's R = 8 would take the XLA path)
CFG = preset("tiny").replace(qk_rope_head_dim=16)
PLAN = ops.ExecPlan(impl="pallas", layer_loop="unroll", layer_weights="per_layer")


def test_absorbed_chunks_match_the_expanded_path(monkeypatch):
    """Prompts of 21 and 30 tokens in chunks of 8: every chunk after the first follows cached tokens.
    float32 on both paths; they differ in the order of summation and in where W_UK / W_UV are applied
    (before or after the softmax), so logprobs agree to ~1e-5 (tolerance 1e-4)."""
    rows = []
    real = md.mla_paged_attention
    monkeypatch.setattr(md, "mla_paged_attention", lambda q, *a, **k: rows.append(q.shape[1]) or real(q, *a, **k))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, CFG.vocab_size, n).tolist() for n in (21, 30)]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    outs = []
    for tokens in (0, 16):
        llm = LLM(CFG, dtype="float32", max_num_seqs=2, block_size=16, num_gpu_blocks_override=16, prefill_chunk=8,
                  max_prefill_tokens=16, exec_plan=dataclasses.replace(PLAN, absorbed_chunk_tokens=tokens))
        outs.append(llm.generate(prompts, [sp, sp]))
    assert 16 in rows and rows.count(16) >= 2             # the chunks after cached tokens ran in the kernel
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in (a, b)]
        np.testing.assert_allclose(lp[0], lp[1], rtol=0, atol=1e-4)


def test_absorbed_chunks_take_the_decode_width():
    s = shapes.Shapes.of(4096, 16, 2048, rank_pages=300, pallas=True, absorbed_chunk=64)
    assert s.tables("prefill", 64) == [256] == s.tables("decode")
    assert s.tables("prefill", 128) == [16, 32, 64, 128, 256]           # wider chunks gather their tables
    assert s.prefill_fits(8, 64, 200, fresh=False)                       # nothing gathered: no page cap
    assert not s.prefill_fits(8, 128, 200, fresh=False)
    assert shapes.Shapes.of(4096, 16, 2048, absorbed_chunk=64).tables("prefill", 64) == [16, 32, 64, 128, 256]
