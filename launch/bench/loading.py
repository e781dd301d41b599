r"""kimi-bench loading: the streamed loader against the raw read speed of the same
files, in one run; peak host memory; orbax save and restore of the same model.

  kimi-make-synthetic --model kimi-k2.5 --num_layers 2 --vocab_size 32768 --out /tmp/k25
  kimi-bench loading --model /tmp/k25 --orbax_dir /tmp/k25-orbax --report out/loading_bench.md
  kimi-bench loading --model /tmp/k25 --platform cpu --finite_check both --rounds 6 --settle_s 15

Rounds of: drop the page cache (root only; otherwise reported as warm), raw read of every safetensors
file (positioned 64 MB reads into reused buffers by --raw_workers threads: the disk's ceiling for this
access pattern), drop again, the same reads into freshly allocated memory (what any load onto a CPU
device also pays), drop again, load_model onto the first device (bf16: stored dtype, no conversion).
--finite_check both adds a load without the NaN / Inf check to every round, before the checked one in
even rounds and after it in odd ones, and prints the check's cost (the geometric mean of the
rounds' ratios, which cancels the position effect over each pair of rounds).
Then orbax save of the loaded model and, cache dropped, orbax restore. Peak RSS per phase is the
process's VmHWM, reset before the phase (/proc/self/clear_refs); on CPU the "device" arrays live in
host memory, so a load's peak includes the model itself: the loader's own overhead is peak - base -
model bytes.
"""
from __future__ import annotations

import concurrent.futures as cf
import datetime
import gc
import json
import os
import re
import shutil
import time

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "safetensors checkpoint directory", required=True)
flags.DEFINE_string("orbax_dir", None, "where to write the orbax copy (removed afterwards unless "
                    "--keep); none: skip orbax")
flags.DEFINE_bool("keep", False, "keep the orbax copy")
flags.DEFINE_string("platform", None, "JAX platform to load onto (cpu, cuda); default: JAX's default device")
flags.DEFINE_bool("delete_source", False, "delete the safetensors checkpoint after the load rounds, before "
                  "writing the orbax copy (when the disk cannot hold both)")
flags.DEFINE_integer("rounds", 2, "raw-read + load rounds")
flags.DEFINE_integer("workers", None, "loader threads (default: the loader's)")
flags.DEFINE_integer("raw_workers", 8, "threads for the raw read")
flags.DEFINE_bool("drop_caches", True, "drop the page cache before each timed read (needs root)")
flags.DEFINE_float("settle_s", 0.0, "seconds to wait after dropping the page cache, before each timed read: "
                   "on a VM whose balloon driver reports free memory to the host, memory freed more than a "
                   "few seconds earlier is several times slower to touch again, so a settle time of ~15 s "
                   "puts every phase in that same state")
flags.DEFINE_enum("finite_check", "on", ["on", "off", "both"], "load_model's NaN / Inf check of every "
                  "tensor (check_finite); both: each round also times a load without it (cache dropped again)")
flags.DEFINE_string("report", None, "write a markdown report here (and JSON next to it)")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def drop_caches() -> str:
    """Drop the page cache (root only), then wait --settle_s."""
    state = "warm (not dropped)"
    if FLAGS.drop_caches:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            state = "cold (dropped)"
        except OSError:
            state = "unknown (drop_caches refused)"
    if FLAGS.settle_s:
        time.sleep(FLAGS.settle_s)
        state += f", settled {FLAGS.settle_s:g} s"
    return state


def raw_read(paths, workers: int, block: int = 64 << 20) -> tuple[int, float]:
    """Read every file with positioned reads of `block` bytes, `workers` in flight, into one reused
    buffer per thread. Returns (bytes, seconds)."""
    import threading
    local = threading.local()
    jobs = []
    for p in paths:
        size = os.path.getsize(p)
        jobs += [(p, off, min(block, size - off)) for off in range(0, size, block)]
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}

    def one(job):
        p, off, n = job
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(block)
        mv = memoryview(buf)[:n]
        got = 0
        while got < n:
            k = os.preadv(fds[p], [mv[got:]], off + got)
            if k == 0:
                raise EOFError(p)
            got += k
        return n

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(workers) as ex:
        total = sum(ex.map(one, jobs))
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return total, dt


def raw_read_fresh(paths, workers: int, block: int = 64 << 20) -> tuple[int, float]:
    """As raw_read, but into freshly allocated memory (one anonymous mapping for all files,
    transparent huge pages advised, prefaulted by one thread ahead of the reads, page cache dropped
    behind them): the same reads plus the cost of bringing the model's memory into existence, which
    any load onto a CPU device pays."""
    import mmap
    import numpy as np
    sizes = [os.path.getsize(p) for p in paths]
    m = mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    arr = np.frombuffer(m, np.uint8)
    jobs, o = [], 0
    for p, size in zip(paths, sizes):
        for off in range(0, size, block):
            n = min(block, size - off)
            jobs.append((p, off, n, o))
            o += n
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}

    def one(job):
        p, off, n, o = job
        mv = memoryview(m)[o:o + n]
        got = 0
        while got < n:
            got += os.preadv(fds[p], [mv[got:]], off + got)
        os.posix_fadvise(fds[p], off, n, os.POSIX_FADV_DONTNEED)
        return n

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(1) as pf, cf.ThreadPoolExecutor(workers) as ex:
        for _, _, n, o in jobs:
            pf.submit(lambda o=o, n=n: arr[o:o + n:4096].fill(0))
        total = sum(ex.map(one, jobs))
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    del arr
    m.close()
    return total, dt


def main(argv):
    del argv
    if FLAGS.platform:
        os.environ["JAX_PLATFORMS"] = FLAGS.platform
    import jax
    import jax.numpy as jnp
    import numpy as np

    from checkpoints import loader, orbax_io
    from checkpoints.safetensors_io import CheckpointReader
    from kimi_jax.config import ModelConfig
    from kimi_jax.entrypoints.weights import load_model
    from kimi_jax.model.transformer import param_arrays
    from kimi_jax.parallel.sharding import Layout

    res: dict = {"date": datetime.date.today().isoformat(), "model": FLAGS.model,
                 "jax": jax.__version__, "device": str(jax.devices()[0]), "cpus": os.cpu_count(),
                 "rounds": []}
    with CheckpointReader(FLAGS.model) as r:
        files = [os.path.join(FLAGS.model, f) for f in r.files]
    res["file_bytes"] = sum(os.path.getsize(f) for f in files)
    print(f"{FLAGS.model}: {len(files)} files, {res['file_bytes'] / 1e9:.2f} GB -> {res['device']}", flush=True)
    kw = {"workers": FLAGS.workers} if FLAGS.workers else {}
    on_host = jax.devices()[0].platform == "cpu"     # only CPU "device" arrays live in host memory

    def timed_load(check_finite: bool, stats: loader.LoadStats) -> tuple[dict, float, str]:
        """load_model onto the first device from a dropped page cache: (parameters, seconds, cache state)."""
        cache = drop_caches()
        t0 = time.perf_counter()
        net = param_arrays(load_model(FLAGS.model, ModelConfig.from_pretrained(FLAGS.model), Layout(),
                                      jnp.bfloat16, check=False, stats=stats, check_finite=check_finite, **kw))
        jax.block_until_ready(net)
        return net, time.perf_counter() - t0, cache

    def load_nocheck(rnd: int, row: dict) -> None:
        _, dt, row["nocheck_cache"] = timed_load(False, loader.LoadStats())
        row.update(nocheck_s=dt, nocheck_gbps=res["file_bytes"] / 1e9 / dt)
        print(f"round {rnd}: load_model without the finite check in {dt:.2f}s = "
              f"{row['nocheck_gbps']:.2f} GB/s of the files ({row['nocheck_cache']})", flush=True)

    def load(rnd: int, row: dict) -> dict:
        _reset_peak()
        base = _status("VmRSS")
        stats = loader.LoadStats()
        net, dt, row["load_cache"] = timed_load(FLAGS.finite_check != "off", stats)
        model_bytes = sum(v.nbytes for v in net.values())
        peak = _status("VmHWM")
        row.update(load_s=dt, load_read_s=stats.seconds, load_bytes=stats.bytes_read,
                   load_gbps=stats.bytes_read / 1e9 / dt, model_bytes=model_bytes, rss_base=base,
                   rss_peak=peak, overhead=peak - base - (model_bytes if on_host else 0),
                   max_host_bytes=stats.max_host_bytes)
        row["ratio"] = row["load_gbps"] / row["raw_gbps"]
        row["ratio_fresh"] = row["load_gbps"] / row["fresh_gbps"]
        print(f"round {rnd}: load_model {stats.bytes_read / 1e9:.2f} GB in {dt:.2f}s = "
              f"{row['load_gbps']:.2f} GB/s ({row['ratio']:.0%} of raw, {row['ratio_fresh']:.0%} of raw "
              f"into fresh memory), peak RSS "
              f"{peak / 1e9:.2f} GB = base {base / 1e9:.2f} + "
              + (f"model {model_bytes / 1e9:.2f} + " if on_host else "") +
              f"loader {row['overhead'] / 1e9:.2f} GB ({row['load_cache']})", flush=True)
        return net

    net = None
    for rnd in range(FLAGS.rounds):
        row: dict = {}
        net = None
        gc.collect()                      # the previous round's model (nnx graphs hold cycles)
        row["raw_cache"] = drop_caches()
        n, dt = raw_read(files, FLAGS.raw_workers)
        row.update(raw_bytes=n, raw_s=dt, raw_gbps=n / 1e9 / dt)
        print(f"round {rnd}: raw read {n / 1e9:.2f} GB in {dt:.2f}s = {n / 1e9 / dt:.2f} GB/s "
              f"({row['raw_cache']})", flush=True)
        drop_caches()
        n, dt = raw_read_fresh(files, FLAGS.raw_workers)
        row.update(fresh_s=dt, fresh_gbps=n / 1e9 / dt)
        print(f"round {rnd}: raw read into fresh memory {n / 1e9:.2f} GB in {dt:.2f}s = "
              f"{n / 1e9 / dt:.2f} GB/s", flush=True)
        # both: the loads with and without the check alternate which goes first, round by round (on a
        # VM, how fast fresh memory is depends on how long ago it was freed)
        if FLAGS.finite_check == "both" and rnd % 2 == 0:
            load_nocheck(rnd, row)
            gc.collect()
        net = load(rnd, row)
        if FLAGS.finite_check == "both" and rnd % 2 == 1:
            net = None
            gc.collect()
            load_nocheck(rnd, row)
        if "nocheck_s" in row:
            row["check_cost"] = row["load_s"] / row["nocheck_s"] - 1
        res["rounds"].append(row)
    if FLAGS.finite_check == "both" and res["rounds"]:
        # geometric mean of the per-round ratios: with the order alternating, a slower first (or second)
        # position cancels out over each pair of rounds
        res["check_cost"] = float(np.exp(np.mean([np.log1p(r["check_cost"]) for r in res["rounds"]]))) - 1
        res["ratio_median"] = float(np.median([r["ratio"] for r in res["rounds"]]))
        res["ratio_fresh_median"] = float(np.median([r["ratio_fresh"] for r in res["rounds"]]))
        print(f"over {len(res['rounds'])} rounds: the check costs {res['check_cost']:+.1%} of the load time "
              f"(geometric mean); the load with it runs at (median) {res['ratio_median']:.0%} of the raw read, "
              f"{res['ratio_fresh_median']:.0%} of the raw read into fresh memory", flush=True)
    cfg = ModelConfig.from_pretrained(FLAGS.model)
    if FLAGS.orbax_dir:
        if FLAGS.delete_source:
            shutil.rmtree(FLAGS.model)
            print(f"deleted {FLAGS.model} (--delete_source)", flush=True)
        out = FLAGS.orbax_dir
        if os.path.exists(out):
            orbax_io.check_output(out, True)
            shutil.rmtree(out)
        _reset_peak()
        base = _status("VmRSS")
        t0 = time.perf_counter()
        meta = orbax_io.save(out, net, cfg.to_hf_dict(), source=None if FLAGS.delete_source else FLAGS.model)
        os.sync()
        dt = time.perf_counter() - t0
        res["orbax_save"] = dict(seconds=dt, bytes=meta["bytes"], gbps=meta["bytes"] / 1e9 / dt,
                                 rss_peak=_status("VmHWM"), rss_base=base, synced=True)
        print(f"orbax save {meta['bytes'] / 1e9:.2f} GB in {dt:.2f}s (incl. sync) = "
              f"{meta['bytes'] / 1e9 / dt:.2f} GB/s, peak RSS {_status('VmHWM') / 1e9:.2f} GB", flush=True)
        del net
        net = None
        gc.collect()
        cache = drop_caches()
        _reset_peak()
        base = _status("VmRSS")
        stats = loader.LoadStats()
        t0 = time.perf_counter()
        net = param_arrays(load_model(out, cfg, Layout(), jnp.bfloat16, check=False, stats=stats))
        jax.block_until_ready(net)
        dt = time.perf_counter() - t0
        res["orbax_restore"] = dict(seconds=dt, bytes=stats.bytes_read, gbps=stats.bytes_read / 1e9 / dt,
                                    rss_peak=_status("VmHWM"), rss_base=base, cache=cache)
        print(f"orbax restore {stats.bytes_read / 1e9:.2f} GB in {dt:.2f}s = "
              f"{stats.bytes_read / 1e9 / dt:.2f} GB/s, peak RSS {_status('VmHWM') / 1e9:.2f} GB "
              f"({cache})", flush=True)
        net = None
        if not FLAGS.keep:
            shutil.rmtree(out)
    if FLAGS.report:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.report)), exist_ok=True)
        with open(os.path.splitext(FLAGS.report)[0] + ".json", "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


def run(argv=None) -> None:
    from launch import common
    common.run(main, "kimi-bench loading", __name__, __doc__, argv=argv, common=False)


if __name__ == "__main__":
    run()
