#!/usr/bin/env bash
# Full-size Kimi-K2.5 decode on 8 x H200 in TP8, TP8+EP8 and DP8+EP8, one command per
# layout (each well inside the device tool's 10-minute limit). Usage on the 8-GPU machine:
#   bash launch/run_8gpu.sh tp8_ep        (or tp8, dp8_ep)
# Weights: all 61 layers and 384 experts at the published shapes, random values placed directly on
# the devices (595 GB does not fit the machine's 235 GB disk as a synthetic checkpoint, so the loading
# path is measured separately on a slice: kimi-bench loading, BENCHMARKS.md "Checkpoint loading").
set -euo pipefail
layout=${1:?layout: tp8 | tp8_ep | dp8_ep}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
case "$layout" in dp*) batches=8,64,256,512 ;; *) batches=1,64,256 ;; esac   # dp needs batch % 8 == 0
python -m launch.bench.engine --layers 61 --layouts "$layout" \
    --multi_batches "$batches" --steps 5 --context 2048 --out "${OUT:-out}/8gpu_$layout"
python -m launch.plan --model kimi-k2.5 --hardware h200 --batch 1 --context 2048 \
    $(python - "$layout" <<'PY'
import sys
from launch.bench.engine import parse_layout
tp, dp, ep = parse_layout(sys.argv[1])
print(f"--tensor_parallel_size {tp} --data_parallel_size {dp} " + ("--enable_expert_parallel" if ep else ""))
PY
)
