"""Fixtures shared by the end-to-end tests: the tiny checkpoint on a small page pool, and a word
tokenizer for it."""
import pytest


@pytest.fixture(scope="module")
def pool_slots():
    """`pool_llm`'s max_num_seqs (a module overrides this fixture for another count)."""
    return 4


@pytest.fixture(scope="module")
def pool_llm(tiny_ckpt, pool_slots):
    """The tiny checkpoint under pressure, one engine per module (its tests share the compiled programs;
    they set its attributes): `pool_slots` slots (requests join as others finish), prompt chunks of 16
    (long prompts span several steps), 24 pages of 4 tokens (fewer than the longest sequences need at
    once: preemption and recompute)."""
    from kimi_jax import LLM
    return LLM(tiny_ckpt, dtype="float32", max_num_seqs=pool_slots, block_size=4, num_gpu_blocks_override=24, prefill_chunk=16,
               max_prefill_tokens=24)


class WordTokenizer:
    """Token i is the word 'w{i}': enough for stop strings and bad words (the tiny checkpoint has no
    tokenizer)."""
    stop_token_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" w{i}" for i in ids)

    def encode(self, text, allow_special=False):
        return [int(w[1:]) for w in text.split()]


@pytest.fixture
def word_tokenizer():
    """A WordTokenizer (token i is the word 'w{i}')."""
    return WordTokenizer()
