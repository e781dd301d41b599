"""Read a checkpoint's arrays for a spec it is given: {parameter path: jax.ShapeDtypeStruct (shape,
dtype, sharding)} -> {parameter path: jax.Array}. The caller (kimi_jax) builds the spec from its model
and merges the arrays into it; this module knows only file formats and the canonical name layout
(checkpoints.layout: how parameter paths map to published tensor names).

`load_arrays(path, specs, cfg)` reads a directory written by `kimi-convert` (checkpoints.orbax_io)
with orbax, any other as a published-layout checkpoint (HF safetensors, optional compressed-tensors
INT4 experts), every tensor validated first. Floating tensors are cast to the spec's dtype; INT4
words are kept packed (the kernels consume them; the XLA path dequantizes on the fly).

Streaming (`load_params`):
* Per parameter, each addressable device's shard is a box of the global array
  (`sharding.addressable_devices_indices_map`): only the HF tensors in the box are read, and of each
  only its rows/columns (`CheckpointReader.read_slice`); devices holding the same box share one read.
  Each process reads only its own devices' slices. Shards are put on their devices as they arrive and
  joined with `jax.make_array_from_single_device_arrays` (what `jax.make_array_from_callback` does,
  except that each slice is transferred and released before the next is read, instead of all of a
  parameter's local slices being held for one batched transfer).
* Reads go in file order, not parameter order (a layer's experts interleave gate/up/down in the
  files; sequential reads are several times faster), `workers` threads in flight (os.preadv releases
  the GIL), whole tensors that are adjacent in a file (gaps up to 64 KiB, e.g. weight_shape) merged
  into one vector read of up to 64 MB straight into the destination buffers.
* Host memory on accelerators: a shard larger than `chunk_bytes` is staged in blocks (the same
  leading-axis block of every local shard, `chunk_bytes` in all) written into the preallocated global
  array in place (a donated dynamic_update_slice in one shard_map: one compile per parameter, not per
  device); staging buffers are recycled; at most `readahead_bytes` are being read while one chunk is
  placed. On CPU devices the page-aligned host buffer becomes the array (no copy), so shards are read
  whole into their final memory: peak RSS = the model + a few MB.
* Buffers are anonymous mappings advised to use transparent huge pages; one thread pre-faults them
  ahead of the reads; when the checkpoint is large for the RAM, pages read are dropped from the page
  cache (POSIX_FADV_DONTNEED) so the cache does not force reclaim of the memory being filled.
* Each floating tensor is checked for NaN / Inf by the reader thread that read it, in its host
  buffer right after the read (FiniteCheck): the check overlaps the other reads and reads nothing again.
* A tqdm bar shows GB read and GB/s (on a terminal). If anything fails, every array placed so far is
  deleted before the error propagates.

(One file over 600 lines: validation, the streamed read plan, the per-device placement and the
finite-values check run as one pipeline over the same tensors.)
"""
# Over 600 lines: the streamed reader, its placement and its checks share one pass over each tensor.
from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import functools
import itertools
import logging
import math
import mmap
import os
import sys
import time
from typing import Iterator, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from checkpoints import layout as layout_lib
from checkpoints.safetensors_io import CheckpointError, CheckpointReader, TensorInfo, np_dtype

log = logging.getLogger(__name__)
_FLOATS = ("float32", "bfloat16", "float16")

DEFAULT_WORKERS = 8
DEFAULT_CHUNK_BYTES = 256 << 20        # largest host block of one device shard
DEFAULT_READAHEAD_BYTES = 512 << 20    # host bytes being read ahead while a chunk is placed
# On CPU devices a page-aligned host buffer becomes the device array without a copy, so shards are
# read whole, straight into their final memory (False: stage and chunk as for accelerators; tests).
CPU_ADOPTS_HOST_BUFFERS = True

__all__ = ["load_arrays", "load_params", "expected_for", "LoadStats", "ParamSpecs",
           "DEFAULT_WORKERS", "DEFAULT_CHUNK_BYTES", "DEFAULT_READAHEAD_BYTES"]
ParamSpecs = Mapping[tuple[str, ...], jax.ShapeDtypeStruct]    # parameter path -> shape, dtype, sharding


# ---- the plan: chunks of device shards ------------------------------------------------------------
Box = tuple[tuple[int, int], ...]          # (start, stop) per dimension


@dataclasses.dataclass
class _Param:
    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    depth: int
    sharding: Optional[jax.sharding.Sharding]
    devices: list = dataclasses.field(default_factory=list)        # addressable, in sharding order
    done: dict = dataclasses.field(default_factory=dict)           # device -> finished shard array
    partial: dict = dataclasses.field(default_factory=dict)        # device -> shard being filled
    buf: Optional[jax.Array] = None                                # global array being filled
    remaining: int = 0                                             # chunks not yet placed
    on_cpu: bool = False                                           # every device is a CPU device
    staged: bool = True        # host buffers are staging (bounded, chunked), not the arrays' memory


@dataclasses.dataclass
class _Chunk:
    param: _Param
    groups: list             # [(shard box, devices holding it)] covered by this chunk
    rel: Optional[Box]       # the block of each shard (box relative to the shard); None: whole shards
    nbytes: int              # host bytes (parameter dtype)
    pos: tuple = ()          # (file index, offset) of its first tensor: chunks are read in file order

    @property
    def cost(self) -> int:
        """Host bytes counted against the read-ahead budget: none for CPU devices, which adopt the
        host buffer as the device array (it is the model's own memory, not staging)."""
        return self.nbytes if self.param.staged else 0

    def boxes(self) -> list[Box]:
        """The absolute box read for each group."""
        if self.rel is None:
            return [g for g, _ in self.groups]
        return [tuple((s0 + a, s0 + b) for (s0, _), (a, b) in zip(g, self.rel)) for g, _ in self.groups]


@dataclasses.dataclass
class LoadStats:
    """What one load did: bytes read from the files, seconds, parameters and device shards placed."""
    bytes_read: int = 0
    seconds: float = 0.0
    params: int = 0
    shards: int = 0
    chunks: int = 0                  # host reads units (a whole shard, or one block of every local shard)
    blocks: int = 0                  # chunks written in place into a larger shard
    max_host_bytes: int = 0          # largest host bytes held at once by chunks being read or placed

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / 1e9 / self.seconds if self.seconds else 0.0


def _box_of(index: tuple, shape) -> Box:
    return tuple(sl.indices(n)[:2] for sl, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)),
                                                     shape))


def _split_box(box: Box, itemsize: int, limit: int) -> list[Box]:
    """Split a box into C-order blocks of at most `limit` bytes along its leading axes."""
    sizes = [e - s for s, e in box]
    if math.prod(sizes) * itemsize <= limit:
        return [box]
    k = 0
    while k < len(sizes) - 1 and math.prod(sizes[k + 1:]) * itemsize > limit:
        k += 1
    step = max(1, limit // (math.prod(sizes[k + 1:]) * itemsize))
    out = []
    for outer in itertools.product(*(range(s, e) for s, e in box[:k])):
        for a in range(box[k][0], box[k][1], step):
            out.append(tuple((i, i + 1) for i in outer) + ((a, min(a + step, box[k][1])),) + box[k + 1:])
    return out


def _plan(params: list[_Param], chunk_bytes: int) -> Iterator[_Chunk]:
    for p in params:
        groups: dict[Box, list] = {}
        for d, index in p.sharding.addressable_devices_indices_map(p.shape).items():
            p.devices.append(d)
            groups.setdefault(_box_of(index, p.shape), []).append(d)
        items = [(b, tuple(ds)) for b, ds in groups.items()]
        if not items:
            continue
        shard = [e - s for s, e in items[0][0]]
        shard_bytes = math.prod(shard) * p.dtype.itemsize
        # CPU devices adopt the (page-aligned) host buffer itself: a whole shard costs no extra
        # host memory, and staging it in blocks would only add copies
        p.on_cpu = all(d.platform == "cpu" for d in p.devices)
        p.staged = not (p.on_cpu and CPU_ADOPTS_HOST_BUFFERS)
        if shard_bytes <= chunk_bytes or not p.staged:
            chunks = [_Chunk(p, [g], None, shard_bytes) for g in items]      # whole shards
        else:   # the same block of every local shard at once, chunk_bytes in all
            blocks = _split_box(tuple((0, n) for n in shard), p.dtype.itemsize,
                                max(1, chunk_bytes // len(items)))
            chunks = [_Chunk(p, items, rel, math.prod(b - a for a, b in rel) * p.dtype.itemsize * len(items))
                      for rel in blocks]
        p.remaining = len(chunks)
        yield from chunks


def _order_box(ch: _Chunk) -> Box:
    """The box whose file position orders a chunk. Blocks (which launch SPMD programs over the whole
    mesh: every process must run them in the same order) use their block of the sharding's first
    device's shard, the same on every process; whole shards (only device_put) use their own."""
    if ch.rel is None or ch.param.sharding is None:
        return ch.boxes()[0]
    first = min(ch.param.sharding.device_set, key=lambda d: d.id)
    shard = _box_of(ch.param.sharding.devices_indices_map(ch.param.shape)[first], ch.param.shape)
    return tuple((s0 + a, s0 + b) for (s0, _), (a, b) in zip(shard, ch.rel))


def _pieces(p: _Param, box: Box, dense: int):
    """(HF name, index into that tensor, leading index into the chunk's host buffer) for a box."""
    d = p.depth
    src = tuple(slice(s, e) for s, e in box[d:])
    for idx in itertools.product(*(range(s, e) for s, e in box[:d])):
        yield layout_lib.hf_name(p.path, dense, idx), src, tuple(i - s for i, (s, _) in zip(idx, box[:d]))


def _check_shapes(reader: CheckpointReader, params: list[_Param], dense: int) -> None:
    """Every HF tensor a parameter needs exists with the parameter's per-element shape, before
    anything is read or allocated."""
    for p in params:
        want = list(p.shape[p.depth:])
        for _, name in layout_lib.hf_names_for(p.path, dense, p.shape):
            info = reader.info(name)
            if list(info.shape) != want:
                raise CheckpointError(f"{reader.path}/{info.file}: tensor {info.name!r} has shape "
                                      f"{list(info.shape)}, the model expects {want}")


# ---- device side ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _zeros_fn(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.partial(jax.jit, donate_argnums=0)
def _update(buf, block, starts):
    return jax.lax.dynamic_update_slice(buf, block, starts)


@functools.lru_cache(maxsize=None)
def _update_fn(sharding: NamedSharding):
    """buf[starts + block] = block on every device at once (in place: buf is donated)."""
    spec = sharding.spec
    f = jax.shard_map(lambda buf, block, starts: jax.lax.dynamic_update_slice(buf, block, starts),
                      mesh=sharding.mesh, in_specs=(spec, spec, P()), out_specs=spec)
    return jax.jit(f, donate_argnums=0)


_HUGE = 2 << 20


class _HostBuffers:
    """Page-aligned host arrays from anonymous mmaps advised to use transparent huge pages: first
    touch (the kernel copying a read into fresh memory) is several times faster than with 4 KiB
    pages, and JAX's CPU client adopts page-aligned arrays without a copy. Staging buffers of
    non-CPU devices are recycled (keyed by size, at most `keep` bytes held free)."""

    def __init__(self, keep: int):
        self.keep, self.free, self.free_bytes = keep, collections.defaultdict(list), 0

    def get(self, shape, dtype: np.dtype) -> np.ndarray:
        n = math.prod(shape) * dtype.itemsize
        if n < _HUGE:
            return np.empty(shape, dtype)
        if self.free[n]:
            self.free_bytes -= n
            raw = self.free[n].pop()
        else:
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError):   # no THP: plain pages
                pass
            raw = np.frombuffer(m, np.uint8)
        return raw.view(dtype).reshape(shape)

    def give_back(self, arr: np.ndarray) -> None:
        """Recycle a staging buffer whose device copy is complete (never one a CPU array adopted)."""
        raw = arr.reshape(-1).view(np.uint8)
        if raw.nbytes >= _HUGE and self.free_bytes + raw.nbytes <= self.keep:
            self.free[raw.nbytes].append(raw)
            self.free_bytes += raw.nbytes


def _available_memory() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


_PAGE = mmap.PAGESIZE
_RUN_BYTES = 64 << 20       # adjacent tensors are read together up to this many bytes
_MAX_GAP = 64 << 10         # ... across gaps up to this size (e.g. 8-byte weight_shape tensors)


@dataclasses.dataclass
class _Read:
    """One tensor's part of a chunk: `direct` when it is one contiguous byte run of the file read
    straight into `out` (same dtype); otherwise CheckpointReader.read_slice cuts/casts it."""
    file: int
    offset: int
    nbytes: int
    info: TensorInfo
    name: str
    src: tuple
    out: np.ndarray
    futs: list
    direct: bool


def _coalesce(reads: list[_Read]) -> Iterator[list[_Read]]:
    """Group file-ordered reads: direct reads of nearby byte ranges (gaps up to _MAX_GAP, read into
    a scratch buffer) become one sequential vector read (preadv into several buffers) of up to
    _RUN_BYTES and 256 buffers."""
    group: list[_Read] = []
    size = 0
    for r in reads:
        gap = r.offset - (group[-1].offset + group[-1].nbytes) if group else -1
        if (group and r.direct and group[-1].direct and r.file == group[-1].file
                and 0 <= gap <= _MAX_GAP and len(group) < 256 and size + gap + r.nbytes <= _RUN_BYTES):
            group.append(r)
            size += gap + r.nbytes
            continue
        if group:
            yield group
        group, size = [r], r.nbytes
    if group:
        yield group


def _read_group(reader: CheckpointReader, group: list[_Read], finite: Optional["FiniteCheck"],
                touched=()) -> None:
    """Read one coalesced group into its buffers, once the prefaults of those buffers (touched:
    their futures) have written: a prefault after the read would zero a byte of each page."""
    for t in touched:
        t.result()
    if not group[0].direct:
        reader.read_slice(group[0].name, group[0].src, out=group[0].out)
    else:
        _read_runs(reader, group)
    if finite is not None:
        for r in group:
            finite.check(r)


def _read_runs(reader: CheckpointReader, group: list[_Read]) -> None:
    bufs, names, end = [], [], group[0].offset
    for r in group:
        if r.offset > end:                              # a gap: read and dropped
            bufs.append(memoryview(bytearray(r.offset - end)))
            names.append(r.info.name)
        bufs.append(memoryview(r.out.reshape(-1).view(np.uint8)))
        names.append(r.info.name)
        end = r.offset + r.nbytes
    reader.read_into(group[0].info.file, group[0].offset, bufs, names)


def _touch(arr: np.ndarray) -> None:
    """Fault in every page of a fresh buffer (writes zeros, which fresh pages hold anyway)."""
    arr.reshape(-1).view(np.uint8)[::_PAGE] = 0


def _delete(arrays) -> None:
    for a in arrays:
        try:
            a.delete()
        except Exception:  # noqa: BLE001 - already deleted / donated
            pass


def _progress_bar(total: int, enabled: Optional[bool], desc: str):
    from tqdm import tqdm
    if enabled is None:
        enabled = sys.stderr.isatty() and jax.process_index() == 0
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc,
                disable=not enabled, dynamic_ncols=True, smoothing=0.1)


# ---- finite values -------------------------------------------------------------------------------
# IEEE floats: a value is NaN or Inf iff its exponent bits are all ones, i.e. iff its bit pattern read as a
# signed integer is at least +Inf's (sign bit clear) or read as an unsigned integer at least -Inf's (sign
# bit set). float dtype -> (signed view, unsigned view, +Inf bits, -Inf bits).
_INF_BITS = {
    np.dtype(np.float32): (np.int32, np.uint32, 0x7F800000, 0xFF800000),
    np.dtype(np.float16): (np.int16, np.uint16, 0x7C00, 0xFC00),
    np.dtype(jnp.bfloat16): (np.int16, np.uint16, 0x7F80, 0xFF80),
}
_FINITE_BLOCK = 256 << 10      # bytes per step: the second maximum reads what the first left in cache


def all_finite(arr: np.ndarray) -> bool:
    """No NaN or Inf in a host array: two integer maxima over its bits (see _INF_BITS), block by block,
    with no temporary array; numpy releases the GIL, so reader threads check in parallel."""
    bits = _INF_BITS.get(arr.dtype)
    if bits is None:
        return bool(np.isfinite(arr).all())
    signed, unsigned, pos_inf, neg_inf = bits
    flat = arr.reshape(-1)
    s, u = flat.view(signed), flat.view(unsigned)
    step = _FINITE_BLOCK // arr.itemsize
    for i in range(0, flat.size, step):
        if s[i:i + step].max() >= pos_inf or u[i:i + step].max() >= neg_inf:
            return False
    return True


class FiniteCheck:
    """NaN / Inf in the loaded weights, found in each floating tensor's host buffer by the reader thread
    that filled it, right after the read (`check`): the check of one read overlaps the disk's delivery
    of the next ones, and no byte is read twice. The bytes checked are the parameter's (after any cast,
    so a float32 value that overflows a bfloat16 parameter counts as Inf). `raise_first` raises
    CheckpointError naming the file and tensor of the first bad tensor in file order; with several
    processes (each reads only its own devices' slices) every process gathers every process's first
    one, so all raise the same error (all call it, once, at the end of the load)."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self.bad: list[tuple[int, int, str]] = []          # (file index, offset, stored name)
        self._order = {f: i for i, f in enumerate(reader.files)}

    def check(self, r: "_Read") -> None:
        if jnp.issubdtype(r.out.dtype, jnp.floating) and not all_finite(r.out):
            self.bad.append((self._order[r.info.file], r.info.begin, r.info.name))   # list.append: atomic

    def raise_first(self) -> None:
        first = min(self.bad)[2] if self.bad else None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            names = sorted(self.reader.tensors, key=lambda n: (self._order[self.reader.tensors[n].file],
                                                                 self.reader.tensors[n].begin))
            mine = names.index(first) if first else len(names)
            k = int(np.min(multihost_utils.process_allgather(np.array([mine], np.int64))))
            first = names[k] if k < len(names) else None
        if first is not None:
            info = self.reader.info(first)
            raise CheckpointError(f"{os.path.join(self.reader.path, info.file)}: tensor {info.name!r} holds "
                                  "NaN or Inf values (check_finite_weights=False / --nocheck_finite_weights "
                                  "loads it anyway)")


# ---- loading ---------------------------------------------------------------------------------------
def _sharding_of(spec) -> jax.sharding.Sharding:
    sh = getattr(spec, "sharding", None)
    return sh if sh is not None else SingleDeviceSharding(jax.local_devices()[0])


def load_params(reader: CheckpointReader, cfg: layout_lib.ModelShape, specs: ParamSpecs, *,
                workers: int = DEFAULT_WORKERS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                readahead_bytes: int = DEFAULT_READAHEAD_BYTES, progress: Optional[bool] = None,
                stats: Optional[LoadStats] = None, keep_page_cache: Optional[bool] = None,
                check_finite: bool = True) -> dict[tuple[str, ...], jax.Array]:
    """Read every parameter of `specs` ({parameter path: ShapeDtypeStruct}) from `reader`.

    Each spec's sharding says where the parameter goes (None: the first local device); each process
    reads and places only its addressable devices' slices (streamed, see the module docstring).
    cfg: the model config (checkpoints.layout.ModelShape) the parameter paths are named for.
    workers: reads in flight (threads). chunk_bytes / readahead_bytes: host memory bounds.
    progress: tqdm bar of bytes read (None: only on a terminal, process 0).
    stats: a LoadStats to fill.
    check_finite: refuse a floating tensor with a NaN or Inf (FiniteCheck; streamed loads only).
    keep_page_cache: leave what was read in the kernel's page cache (faster reloads). None: only
      when this process's share of the checkpoint is under half the available memory; otherwise
      each range read is dropped from the cache (POSIX_FADV_DONTNEED) so that the page cache does
      not compete with the model's own memory.
    Returns {parameter path: jax.Array}.
    """
    stats = stats if stats is not None else LoadStats()
    t0 = time.perf_counter()
    b0 = reader.bytes_read
    dense = cfg.num_dense_layers
    out: dict[tuple[str, ...], jax.Array] = {}
    params = [_Param(tuple(path), tuple(spec.shape), np.dtype(spec.dtype), layout_lib.stack_depth(tuple(path)),
                     _sharding_of(spec)) for path, spec in specs.items()]
    _check_shapes(reader, params, dense)
    plan = list(_plan(params, chunk_bytes))
    # the bar's total: bytes of the local shards (stored dtype) -- known from shapes alone
    total = 0
    for p in params:
        stored = np_dtype(reader.info(layout_lib.hf_name(p.path, dense, (0,) * p.depth)).dtype).itemsize
        boxes = {_box_of(ix, p.shape) for ix in p.sharding.addressable_devices_indices_map(p.shape).values()}
        total += sum(math.prod(e - s for s, e in b) for b in boxes) * stored
    # Read in file order, not parameter order: parameters interleave in the files (a layer's experts
    # store gate, up and down next to each other), and disks read sequential ranges much faster.
    file_index = {f: i for i, f in enumerate(reader.files)}

    def pos(name):
        info = reader.info(name)
        return file_index[info.file], info.begin

    for ch in plan:
        ch.pos = min(pos(name) for name, _, _ in _pieces(ch.param, _order_box(ch), dense))
    plan.sort(key=lambda ch: ch.pos)
    if keep_page_cache is None:
        keep_page_cache = total < _available_memory() / 2
    reader.drop_page_cache = not keep_page_cache
    placed: list[jax.Array] = []           # every device array made so far (deleted on failure)
    bar = _progress_bar(total, progress, f"loading {os.path.basename(reader.path.rstrip('/'))}")
    pool = cf.ThreadPoolExecutor(max(1, workers), thread_name_prefix="kimi-load")
    # One thread touches the pages of the buffers ahead of the reads (in the same order), so that the
    # kernel's page zeroing overlaps disk waits instead of running inside the reads. A read waits
    # for its own buffers' touches (each writes a zero a page: after the read it would corrupt it).
    faulter = cf.ThreadPoolExecutor(1, thread_name_prefix="kimi-prefault")
    buffers = _HostBuffers(keep=readahead_bytes + chunk_bytes)
    finite = FiniteCheck(reader) if check_finite else None

    def start(batch: list[_Chunk]) -> list:
        """Allocate the chunks' host buffers and queue all their reads, in file order."""
        started, reads = [], []
        for ch in batch:
            hosts, futs = [], []
            for box in ch.boxes():
                host = buffers.get(tuple(e - s for s, e in box), ch.param.dtype)
                for name, src, dst in _pieces(ch.param, box, dense):
                    info, _, runs, covering = reader.slice_plan(name, src)
                    out = host[dst]
                    off, n = runs[0] if runs else (info.begin, 0)
                    direct = not covering and len(runs) == 1 and out.dtype == np_dtype(info.dtype)
                    reads.append(_Read(file_index[info.file], off, n, info, name, src, out, futs, direct))
                hosts.append(host)
            started.append((ch, hosts, futs))
        reads.sort(key=lambda r: (r.file, r.offset))
        for group in _coalesce(reads):
            touched = [faulter.submit(_touch, r.out) for r in group if r.out.nbytes >= 16 * _PAGE]
            fut = pool.submit(_read_group, reader, group, finite, touched)
            for futs in {id(r.futs): r.futs for r in group}.values():
                futs.append(fut)
        return started

    def finish(ch: _Chunk, hosts: list) -> None:
        p = ch.param
        p.remaining -= 1
        new = []
        if ch.rel is None:                              # whole shards
            for host, (box, devs) in zip(hosts, ch.groups):
                for d in devs:
                    p.done[d] = jax.device_put(host, d)
                    new.append(p.done[d])
        elif isinstance(p.sharding, NamedSharding):     # one block of every shard, in place
            if p.buf is None:
                p.buf = _zeros_fn(p.shape, p.dtype, p.sharding)()
                placed.append(p.buf)
            host_of = {d: h for h, (_, devs) in zip(hosts, ch.groups) for d in devs}
            block = tuple(b - a for a, b in ch.rel)
            gshape = tuple(n // (e - s) * k for n, (s, e), k in zip(p.shape, ch.groups[0][0], block))
            blk = jax.make_array_from_single_device_arrays(
                gshape, p.sharding, [jax.device_put(host_of[d], d) for d in p.devices])
            p.buf = _update_fn(p.sharding)(p.buf, blk, tuple(a for a, _ in ch.rel))
            new.append(p.buf)
        else:                                           # other shardings: device by device
            for host, (shard, devs) in zip(hosts, ch.groups):
                for d in devs:
                    cur = p.partial.get(d)
                    if cur is None:
                        cur = _zeros_fn(tuple(e - s for s, e in shard), p.dtype, SingleDeviceSharding(d))()
                        placed.append(cur)
                    p.partial[d] = _update(cur, jax.device_put(host, d), tuple(a for a, _ in ch.rel))
                    new.append(p.partial[d])
            if p.remaining == 0:
                p.done.update(p.partial)
                p.partial.clear()
        placed.extend(new)
        for a in new:
            a.block_until_ready()        # the host blocks are free once this returns
        if not p.on_cpu:
            for h in hosts:
                buffers.give_back(h)
        stats.chunks += 1
        stats.blocks += ch.rel is not None
        if p.remaining:
            return
        if p.buf is not None:
            arr, p.buf = p.buf, None
        else:
            arr = jax.make_array_from_single_device_arrays(p.shape, p.sharding,
                                                           [p.done[d] for d in p.devices])
            placed.append(arr)
            p.done.clear()
        stats.shards += len(arr.addressable_shards)
        stats.params += 1
        out[p.path] = arr

    window: collections.deque = collections.deque()
    held = 0                               # host bytes of started chunks (staging only)
    i = 0
    try:
        while i < len(plan) or window:
            batch = []
            while i < len(plan) and ((not window and not batch) or held + plan[i].cost <= readahead_bytes):
                batch.append(plan[i])
                held += plan[i].cost
                i += 1
            stats.max_host_bytes = max(stats.max_host_bytes, held)
            window.extend(start(batch))
            ch, hosts, futs = window.popleft()
            for f in futs:
                f.result()
            bar.update(reader.bytes_read - b0 - bar.n)
            finish(ch, hosts)
            held -= ch.cost
            del hosts
        if finite is not None:
            finite.raise_first()
    except BaseException:
        faulter.shutdown(wait=True, cancel_futures=True)
        pool.shutdown(wait=True, cancel_futures=True)
        reader.drop_page_cache = False
        bar.close()
        _delete(placed)
        for p in params:
            p.partial.clear()
            p.done.clear()
            p.buf = None
        raise
    pool.shutdown(wait=True)
    faulter.shutdown(wait=True)
    reader.drop_page_cache = False
    bar.update(reader.bytes_read - b0 - bar.n)
    bar.total = max(bar.total, bar.n)      # bytes read include small gaps bridged between tensors
    bar.close()
    stats.bytes_read += reader.bytes_read - b0
    stats.seconds += time.perf_counter() - t0
    return out


def expected_for(reader: CheckpointReader, cfg: layout_lib.ModelShape) -> dict:
    """The tensors cfg needs; floating tensors may be stored in any float dtype (HF writes float32)."""
    exp = dict(layout_lib.expected_tensors(cfg))
    for name, (shape, dtype) in exp.items():
        if dtype in _FLOATS and name in reader and reader.info(name).dtype in _FLOATS:
            exp[name] = (shape, reader.info(name).dtype)
    return exp


def load_arrays(path: str, specs: ParamSpecs, cfg: layout_lib.ModelShape, *,
                workers: int = DEFAULT_WORKERS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                readahead_bytes: int = DEFAULT_READAHEAD_BYTES, progress: Optional[bool] = None,
                stats: Optional[LoadStats] = None, keep_page_cache: Optional[bool] = None,
                check_finite: bool = True, reader: Optional[CheckpointReader] = None,
                ) -> dict[tuple[str, ...], jax.Array]:
    """{parameter path: jax.Array} for `specs` from the checkpoint directory `path`, every tensor
    validated against `cfg` first (before any device memory is allocated); check_finite: refuse a
    floating tensor holding NaN or Inf (safetensors), a file whose data checksum differs (orbax).

    A directory written by `kimi-convert` (checkpoints.orbax_io) is restored with orbax (after its
    config is compared with `cfg.to_hf_dict()`); any other is read as a published-layout safetensors
    checkpoint (load_params: workers / chunk_bytes / readahead_bytes / keep_page_cache), through
    `reader` when given (a CheckpointReader of `path`, e.g. checkpoints.preflight.check's: its index
    and headers are not read again).
    """
    from checkpoints import orbax_io
    if orbax_io.is_orbax_checkpoint(path):
        t0 = time.perf_counter()
        out = orbax_io.restore_params(path, cfg.to_hf_dict(), specs, verify=check_finite)
        if stats is not None:
            stats.bytes_read += sum(math.prod(a.shape) * a.dtype.itemsize for a in out.values())
            stats.seconds += time.perf_counter() - t0
            stats.params += len(out)
        return out
    with reader if reader is not None else CheckpointReader(path) as reader:
        reader.validate(expected_for(reader, cfg))
        return load_params(reader, cfg, specs, workers=workers, chunk_bytes=chunk_bytes,
                           readahead_bytes=readahead_bytes, progress=progress, stats=stats,
                           keep_page_cache=keep_page_cache, check_finite=check_finite)
