"""Where does host memory go when a checkpoint is loaded onto a GPU? (issue 7: loading 35 GB onto an
H200 raised the process RSS by the model's size although every parameter went to the device.)

Prints RSS after every GB moved to the first local device, for three ways of staging the bytes:
  numpy      one reused np.empty buffer (measured on the H200: RSS +3.8 GB, then flat)
  loader     checkpoints.loader._HostBuffers (anonymous mmaps advised for huge pages), given back
             after each transfer as the loader does
  load_model checkpoints.loader.load_model on --model, RSS sampled by a thread every 0.2 s

  PYTHONPATH=. python -m launch.probe_host_memory --gb 8 [--model /tmp/k40]
"""
from __future__ import annotations

import os
import threading
import time

from absl import app, flags

flags.DEFINE_float("gb", 8.0, "bytes to move per staging method (GB)")
flags.DEFINE_integer("chunk_mb", 256, "transfer size")
flags.DEFINE_string("model", None, "also time load_model on this checkpoint, sampling RSS")
FLAGS = flags.FLAGS


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def move(get, give_back, label):
    import jax
    import numpy as np
    dev = jax.local_devices()[0]
    n = FLAGS.chunk_mb << 20
    steps = int(FLAGS.gb * 1e9 // n)
    keep = []
    for i in range(steps):
        host = get(n)
        host[:: 4096] = i                       # touch every page, as a read would
        arr = jax.device_put(host.view(np.uint8), dev)
        arr.block_until_ready()
        keep.append(arr)
        give_back(host)
        if (i + 1) * n // 10**9 != i * n // 10**9:
            print(f"{label:8} {(i + 1) * n / 1e9:6.2f} GB on device  rss {rss_gb():6.2f} GB", flush=True)
    keep.clear()


def main(argv):
    del argv
    import jax
    import numpy as np
    from checkpoints import loader
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  start rss {rss_gb():.2f} GB", flush=True)
    buf = np.empty(FLAGS.chunk_mb << 20, np.uint8)
    move(lambda n: buf, lambda h: None, "numpy")
    bufs = loader._HostBuffers(keep=1 << 30)
    move(lambda n: bufs.get((n,), np.dtype(np.uint8)), bufs.give_back, "loader")
    if FLAGS.model:
        peak, stop = [rss_gb()], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], rss_gb())
                time.sleep(0.2)
        t = threading.Thread(target=sample, daemon=True)
        t.start()
        t0 = time.perf_counter()
        _, net = loader.load_model(FLAGS.model)
        dt = time.perf_counter() - t0
        stop.set()
        t.join()
        print(f"load_model {FLAGS.model}: {dt:.1f} s, peak rss {peak[0]:.2f} GB, after {rss_gb():.2f} GB", flush=True)


if __name__ == "__main__":
    app.run(main)
