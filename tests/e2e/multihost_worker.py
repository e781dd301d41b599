"""One process of the multi-host test: 4 CPU devices here, 8 across the two processes."""
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def main():
    ckpt, port, pid, out, bad = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    from kimi_jax.parallel.distributed import initialize
    initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    assert jax.device_count() == 8, jax.device_count()
    from checkpoints.safetensors_io import CheckpointError
    from kimi_jax import LLM, SamplingParams
    try:            # a NaN in a tensor only the other process reads: both refuse it, neither hangs
        LLM(bad, dtype="float32", data_parallel_size=2, tensor_parallel_size=4, enable_expert_parallel=True)
        refused = None
    except CheckpointError as e:
        refused = str(e)
    llm = LLM(ckpt, dtype="float32", data_parallel_size=2, tensor_parallel_size=4, enable_expert_parallel=True)
    outs = llm.generate([[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]],
                        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    with open(out, "w") as f:
        json.dump({"tokens": [o.outputs[0].token_ids for o in outs], "refused": refused}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
