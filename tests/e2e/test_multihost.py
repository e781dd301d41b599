"""Two processes x 4 CPU devices (jax.distributed on loopback, gloo collectives) produce the same
tokens as one process with 8 devices."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from checkpoints.synthetic import write_checkpoint
from kimi_jax import LLM, SamplingParams
from kimi_jax.config import preset

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_two_processes_match_one(tmp_path):
    cfg = preset("tiny").replace(num_attention_heads=8, n_routed_experts=16, n_group=1, topk_group=1,
                                 num_experts_per_tok=3)
    ckpt = str(tmp_path / "ckpt")
    write_checkpoint(ckpt, cfg, seed=2, std=0.08)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    outs = [str(tmp_path / f"out{i}.json") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py"), ckpt, str(port),
                               str(i), outs[i]], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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
    assert got[0] == ref and got[1] == ref
