"""The Python API against careless callers: several threads calling LLM.generate on one LLM get the
results of calls made one after another (never an XLA "buffer donated" crash), and arguments of the
wrong type are TypeErrors naming the argument; numpy arrays of token ids are accepted."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kimi_jax.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    from kimi_jax import LLM
    return LLM(tiny_ckpt, dtype="float32", max_num_seqs=4, block_size=4, num_gpu_blocks_override=64)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _prompts(k: int) -> list[list[int]]:
    return [[3 + k, 4 + i, 5 + k * i % 7] for i in range(5)]


def test_threads_calling_generate_get_sequential_results(llm):
    want = {k: [o.outputs[0].token_ids for o in llm.generate(_prompts(k), GREEDY)] for k in range(4)}
    got, errors = {}, []

    def call(k):
        try:
            for _ in range(2):
                got.setdefault(k, []).append([o.outputs[0].token_ids for o in llm.generate(_prompts(k), GREEDY)])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
    threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert all(got[k] == [want[k], want[k]] for k in range(4))


@pytest.mark.parametrize("prompts,words", [
    (None, ["prompts must be", "NoneType"]),
    (5, ["prompts must be", "int"]),
    (b"\x01\x02", ["prompts must be", "bytes"]),
    (np.array([1.5, 2.5]), ["numpy array", "float64"]),
    (np.zeros((2, 2, 2), np.int32), ["numpy array", "1-D or 2-D"]),
])
def test_prompts_of_the_wrong_type_are_type_errors(llm, prompts, words):
    with pytest.raises(TypeError) as e:
        llm.generate(prompts, GREEDY)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("sp,words", [
    ({"temperature": 0.0, "max_tokens": 3}, ["sampling_params", "dict", "SamplingParams(**d)"]),
    ("greedy", ["sampling_params", "str"]),
    (0.5, ["sampling_params", "float"]),
])
def test_sampling_params_of_the_wrong_type_are_type_errors(llm, sp, words):
    with pytest.raises(TypeError) as e:
        llm.generate([[3, 4, 5]], sp)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_numpy_token_ids_are_accepted(llm):
    want = [o.outputs[0].token_ids for o in llm.generate([[3, 4, 5], [6, 7, 8]], GREEDY)]
    for prompts in (np.array([[3, 4, 5], [6, 7, 8]], np.int64), [np.array([3, 4, 5], np.int32), np.array([6, 7, 8])]):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
    one = llm.generate(np.array([3, 4, 5], np.uint16), GREEDY)
    assert len(one) == 1 and one[0].outputs[0].token_ids == want[0] and one[0].prompt_token_ids == [3, 4, 5]
    assert all(type(t) is int for t in one[0].prompt_token_ids)
