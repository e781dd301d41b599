"""A load reads config.json and the weights' index (model.safetensors.index.json) once each: the
preflight's parse of them is what the loader reads the weights through. Counted over every open()
while LLM loads the shipped demo checkpoint (one model.safetensors) and a sharded synthetic one."""
import builtins
import collections
import io
import os

import numpy as np

from checkpoints import synthetic
from checkpoints.safetensors_io import INDEX_FILE
from kimi_jax import LLM, SamplingParams
from kimi_jax.config import preset
from kimi_jax.entrypoints.llm import demo_model_path


def _count_opens(monkeypatch) -> collections.Counter:
    """Opens by file name from now on (builtins.open and io.open are the same function)."""
    counts: collections.Counter = collections.Counter()
    real = builtins.open

    def counting(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)):
            counts[os.path.basename(os.fsdecode(file))] += 1
        return real(file, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", counting)
    monkeypatch.setattr(io, "open", counting)
    return counts


def test_demo_load_reads_config_json_once(monkeypatch):
    demo = demo_model_path()
    assert demo is not None and not os.path.exists(os.path.join(demo, INDEX_FILE))
    counts = _count_opens(monkeypatch)
    llm = LLM(demo, dtype="float32", max_num_seqs=1)
    assert llm.config.vocab_size > 0
    assert counts["config.json"] == 1, counts
    assert counts["tokenizer_config.json"] >= 1      # the count sees the load's reads


def test_sharded_load_reads_config_json_and_the_index_once(monkeypatch, tmp_path):
    path = str(tmp_path / "ck")
    cfg = synthetic.write_checkpoint(path, preset("tiny").replace(num_hidden_layers=2), seed=0,
                                     num_shards=3)
    assert os.path.isfile(os.path.join(path, INDEX_FILE))
    counts = _count_opens(monkeypatch)
    llm = LLM(path, dtype="float32", max_num_seqs=1)
    assert (counts["config.json"], counts[INDEX_FILE]) == (1, 1), counts
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2, temperature=0.0, logprobs=0),
                       use_tqdm=False)
    assert llm.config.num_hidden_layers == cfg.num_hidden_layers == 2
    assert len(out[0].outputs[0].token_ids) == 2 and np.isfinite(out[0].outputs[0].cumulative_logprob)
