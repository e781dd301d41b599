"""Two processes x 4 CPU devices (jax.distributed on loopback, gloo collectives) produce the same
tokens as one process with 8 devices, and both refuse a checkpoint whose NaN only one of them reads."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np

from checkpoints import layout
from checkpoints.safetensors_io import CheckpointReader
from checkpoints.synthetic import write_checkpoint, write_checkpoint_from_tensors
from kimi_jax import LLM, SamplingParams
from kimi_jax.config import preset

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_two_processes_match_one(tmp_path):
    cfg = preset("tiny").replace(num_attention_heads=8, n_routed_experts=16, n_group=1, topk_group=1,
                                 num_experts_per_tok=3)
    ckpt = str(tmp_path / "ckpt")
    write_checkpoint(ckpt, cfg, seed=2, std=0.08)
    # expert 15 lives on the last device under 8-way EP: only process 1 reads it
    nan_tensor = "model.layers.2.mlp.experts.15.down_proj.weight"
    with CheckpointReader(ckpt) as r:
        tensors = {n: np.array(r.read(n)) for n in r.validate(layout.expected_tensors(cfg))}
    tensors[nan_tensor].reshape(-1)[7] = np.nan
    bad = str(tmp_path / "bad")
    write_checkpoint_from_tensors(bad, cfg, tensors)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    outs = [str(tmp_path / f"out{i}.json") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py"), ckpt, str(port),
                               str(i), outs[i], bad], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=400)[0].decode(errors="replace"))
        finally:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(l[-3000:] for l in logs)
    got = [json.load(open(o)) for o in outs]

    llm = LLM(ckpt, dtype="float32", data_parallel_size=2, tensor_parallel_size=4, enable_expert_parallel=True)
    ref = llm.generate([[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]],
                       SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    ref = [o.outputs[0].token_ids for o in ref]
    assert got[0]["tokens"] == ref and got[1]["tokens"] == ref
    for g in got:
        assert g["refused"] == f"{bad}/model.safetensors: tensor '{nan_tensor}' holds NaN or Inf values " \
                               "(check_finite_weights=False / --nocheck_finite_weights loads it anyway)", g
