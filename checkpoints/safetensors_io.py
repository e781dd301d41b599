"""Reading (sharded) safetensors checkpoints with precise, one-line errors.

`CheckpointReader(path)` finds `model.safetensors`, or the shards listed by
`model.safetensors.index.json`, parses every file's header (never the data) and checks it against
the file size, so a truncated or corrupt shard fails at open. Tensors are then read whole (`read`,
through the safetensors library's numpy backend; bf16 comes back as ml_dtypes.bfloat16, torch is
never imported) or in part (`read_slice`: positioned reads, `os.preadv`, of only the byte runs a
slice needs, straight into the caller's buffer; the GIL is released while the kernel copies, so
several threads can read at once). `validate(expected)` compares the checkpoint with
`layout.expected_tensors(cfg)` after mapping K2.5 names to canonical ones.

Every problem raises `CheckpointError` (a ValueError) whose message names the file and the tensor.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import math
import os
import re
import stat
import struct
import threading
from typing import Any, Mapping, Optional, Sequence, Union

import ml_dtypes
import numpy as np

from checkpoints import layout as layout_lib

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
_SHARD_RE = re.compile(r"^model-\d+-of-\d+\.safetensors$")
_MAX_HEADER = 100 * 1024 * 1024      # the safetensors library refuses headers above 100 MB too
_OPEN_HANDLES = 4                    # safe_open handles kept open (LRU); bounds open files, not RAM
# read_slice: a slice whose contiguous byte runs are shorter than this is read as the span of whole
# rows that covers it (one read) and cut in memory; longer runs are read one by one.
_MIN_RUN_BYTES = 256 * 1024
_IOV_MAX = 1024                      # buffers per preadv call (Linux IOV_MAX)
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")

# safetensors dtype tag -> (numpy-style dtype name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "I16": ("int16", 2),
    "U16": ("uint16", 2), "F16": ("float16", 2), "BF16": ("bfloat16", 2), "I32": ("int32", 4),
    "U32": ("uint32", 4), "F32": ("float32", 4), "F64": ("float64", 8), "I64": ("int64", 8),
    "U64": ("uint64", 8), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}

__all__ = ["CheckpointError", "CheckpointReader", "TensorInfo", "read_header", "DTYPES", "np_dtype"]


def np_dtype(name: str) -> np.dtype:
    """numpy dtype for a numpy-style dtype name ('bfloat16' and float8 types via ml_dtypes)."""
    if hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _bounds(index, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(start, stop) per dimension of `index` (a tuple of step-1 slices, shorter than shape OK)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    if len(index) != len(shape):
        raise IndexError(f"index {index} has more dimensions than the tensor {list(shape)}")
    out = []
    for sl, n in zip(index, shape):
        if not isinstance(sl, slice):
            raise TypeError(f"read_slice takes slices, got {sl!r}")
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"read_slice needs step-1 slices, got {sl!r}")
        out.append((start, max(start, stop)))
    return tuple(out)


def _not_regular(path: str) -> str:
    """What a path that exists and is not a regular file is ("" when it is one or is absent)."""
    if not os.path.lexists(path) or os.path.isfile(path):
        return ""
    link = f"a symlink to {os.readlink(path)}, " if os.path.islink(path) else ""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return f"{link}which cannot be opened: {e.strerror}"
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return link + next((k for test, k in kinds if test(mode)), "not a file")


class CheckpointError(ValueError):
    """A checkpoint that is missing, malformed or does not match the model config."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor lives. `begin`/`end` are absolute byte offsets in `file`."""
    name: str                 # name as stored
    file: str                 # shard file name, relative to the checkpoint directory
    shape: tuple[int, ...]
    dtype: str                # numpy-style name: 'bfloat16', 'float32', 'int32', ...
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(file_path: str, display: Optional[str] = None) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header and check it against the file size (no data read)."""
    shown = display or file_path
    fname = os.path.basename(file_path)
    size = os.path.getsize(file_path)
    if size < 8:
        raise CheckpointError(f"{shown}: truncated file ({size} bytes, less than the 8-byte "
                              "safetensors header length)")
    with open(file_path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER:
            raise CheckpointError(f"{shown}: corrupt safetensors file (header length {n} bytes)")
        if 8 + n > size:
            raise CheckpointError(f"{shown}: truncated file (header needs {8 + n} bytes, file has "
                                  f"{size})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{shown}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{shown}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + n
    infos: dict[str, TensorInfo] = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        try:
            tag, shape, (b, e) = h["dtype"], tuple(int(s) for s in h["shape"]), h["data_offsets"]
            b, e = int(b), int(e)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{shown}: corrupt header entry for tensor {name!r}: {h!r}") from None
        if tag not in DTYPES:
            raise CheckpointError(f"{shown}: tensor {name!r} has unsupported dtype {tag!r}")
        dtype, itemsize = DTYPES[tag]
        need = math.prod(shape) * itemsize
        if b < 0 or e - b != need:
            raise CheckpointError(f"{shown}: corrupt header: tensor {name!r} {dtype}{list(shape)} "
                                  f"needs {need} bytes but data_offsets {[b, e]} span {e - b}")
        infos[name] = TensorInfo(name, fname, shape, dtype, data_start + b, data_start + e)
    beyond = [t for t in infos.values() if t.end > size]
    if beyond:
        t = min(beyond, key=lambda t: t.begin)
        raise CheckpointError(f"{shown}: truncated file: tensor {t.name!r} needs bytes up to {t.end} "
                              f"but the file has {size} ({len(beyond)} tensor(s) cut off)")
    _check_byte_ranges(shown, infos, data_start, size)
    return infos


def _check_byte_ranges(shown: str, infos: Mapping[str, TensorInfo], data_start: int, size: int) -> None:
    """The tensors' byte ranges tile the data section exactly, as the format (and the safetensors
    library) requires: no two overlap (one would read the other's bytes), none is left unclaimed."""
    pos, prev = data_start, None
    for t in sorted(infos.values(), key=lambda t: (t.begin, t.end)):
        if t.begin < pos:
            raise CheckpointError(f"{shown}: corrupt header: tensor {t.name!r} (bytes {t.begin - data_start}.."
                                  f"{t.end - data_start}) overlaps tensor {prev.name!r} (bytes "
                                  f"{prev.begin - data_start}..{prev.end - data_start})")
        if t.begin > pos:
            raise CheckpointError(f"{shown}: corrupt header: bytes {pos - data_start}..{t.begin - data_start} "
                                  f"before tensor {t.name!r} belong to no tensor")
        pos, prev = t.end, t
    if pos != size:
        raise CheckpointError(f"{shown}: corrupt file: the last {size - pos} bytes belong to no tensor")


class CheckpointReader:
    """Header-level view of a safetensors checkpoint directory plus tensor-by-tensor reads.

    Attributes:
      path: the checkpoint directory.
      files: shard file names (relative to path), in index order.
      index_path: path of model.safetensors.index.json, or None for a single model.safetensors.
      tensors: stored name -> TensorInfo, for every tensor in every shard.
      config_dict: parsed config.json (None only with require_config=False and no config.json);
        given as `config_dict` by a caller that has parsed it already, the file is not read again.
    """

    def __init__(self, path: str, *, require_config: bool = True,
                 config_dict: Optional[dict] = None):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: checkpoint directory does not exist")
        self.config_dict = self._read_config(require_config) if config_dict is None else config_dict
        self.index_path: Optional[str] = None
        self.tensors: dict[str, TensorInfo] = {}
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            self._open_index(index)
        elif os.path.isfile(os.path.join(self.path, SINGLE_FILE)):
            self.files = [SINGLE_FILE]
            self.tensors = read_header(self._abs(SINGLE_FILE))
        elif what := _not_regular(os.path.join(self.path, SINGLE_FILE)):
            raise CheckpointError(f"{os.path.join(self.path, SINGLE_FILE)}: not a regular file ({what})")
        else:
            shards = sorted(f for f in os.listdir(self.path) if _SHARD_RE.match(f))
            if shards:
                raise CheckpointError(f"{os.path.join(self.path, INDEX_FILE)}: missing index for the "
                                      f"{len(shards)} shard files ({shards[0]}, ...)")
            raise CheckpointError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE} in the checkpoint "
                                  "directory")
        self._handles: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._by_canonical: Optional[dict[str, TensorInfo]] = None
        self._skip_logged = False
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0                 # bytes read by read_slice / read_into (all threads)
        # read_slice / read_into: after reading, tell the kernel the file pages are not needed again
        # (POSIX_FADV_DONTNEED), so that a model larger than the spare RAM does not fill the page
        # cache and force reclaim while the model's own memory is being allocated
        self.drop_page_cache = False

    # ---- opening ---------------------------------------------------------------------
    def _abs(self, fname: str) -> str:
        return os.path.join(self.path, fname)

    def _read_config(self, required: bool) -> Optional[dict]:
        cfg = os.path.join(self.path, CONFIG_FILE)
        if not os.path.isfile(cfg):
            if required:
                raise CheckpointError(f"{cfg}: missing config (no config.json in the checkpoint "
                                      "directory)")
            return None
        try:
            with open(cfg) as f:
                d = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg}: config is not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise CheckpointError(f"{cfg}: config is not a JSON object")
        return d

    def _open_index(self, index: str) -> None:
        self.index_path = index
        try:
            with open(index) as f:
                data = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: index is not valid JSON ({e})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: index has no weight_map")
        by_file: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(fname, []).append(name)
        self.files = list(by_file)
        for fname, names in by_file.items():
            if os.path.basename(fname) == fname and (what := _not_regular(self._abs(fname))):
                raise CheckpointError(f"{self._abs(fname)}: not a regular file ({what}), a shard file "
                                      f"of {index}")
            if os.path.basename(fname) != fname or not os.path.isfile(self._abs(fname)):
                others = f" and {len(names) - 1} other tensor(s)" if len(names) > 1 else ""
                raise CheckpointError(f"{index}: tensor {names[0]!r}{others} mapped to shard file "
                                      f"{self._abs(fname)}, which does not exist")
            infos = read_header(self._abs(fname))
            for name in names:
                if name not in infos:
                    raise CheckpointError(f"{self._abs(fname)}: missing tensor {name!r}, which "
                                          f"{index} says this shard holds")
            for name, info in infos.items():
                if name not in weight_map:
                    raise CheckpointError(f"{self._abs(fname)}: tensor {name!r} is not listed in "
                                          f"the index {index}")
                if weight_map[name] != fname:  # also listed under another shard
                    raise CheckpointError(f"{self._abs(fname)}: tensor {name!r} is also stored here, "
                                          f"but {index} maps it to {weight_map[name]}")
                self.tensors[name] = info

    # ---- queries ---------------------------------------------------------------------
    @property
    def layout(self) -> str:
        """'k25' if the text model is stored under `language_model.`, else 'k2'."""
        return "k25" if any(n.startswith(layout_lib.K25_PREFIX) for n in self.tensors) else "k2"

    def _canonical(self) -> dict[str, TensorInfo]:
        if self._by_canonical is None:
            m: dict[str, TensorInfo] = {}
            for name, info in self.tensors.items():
                c = layout_lib.canonical_name(name)
                if c is None:
                    continue
                if c in m:
                    a = m[c]
                    raise CheckpointError(f"{self._abs(info.file)}: tensor {name!r} duplicates "
                                          f"{a.name!r} in {self._abs(a.file)} (both map to {c!r})")
                m[c] = info
            self._by_canonical = m
        return self._by_canonical

    def info(self, name: str) -> TensorInfo:
        """TensorInfo by stored name or by canonical name."""
        if name in self.tensors:
            return self.tensors[name]
        info = self._canonical().get(name)
        if info is None:
            where = self.index_path or self._abs(SINGLE_FILE)
            raise CheckpointError(f"{where}: no tensor {name!r} in the checkpoint")
        return info

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self._canonical()

    # ---- reading ---------------------------------------------------------------------
    def _handle(self, fname: str):
        h = self._handles.get(fname)
        if h is not None:
            self._handles.move_to_end(fname)
            return h
        from safetensors import safe_open
        try:
            h = safe_open(self._abs(fname), framework="numpy")
        except Exception as e:  # noqa: BLE001 - the library raises its own error types
            raise CheckpointError(f"{self._abs(fname)}: cannot open ({e})") from None
        self._handles[fname] = h
        while len(self._handles) > _OPEN_HANDLES:
            _, old = self._handles.popitem(last=False)
            old.__exit__(None, None, None)
        return h

    def read(self, name: str) -> np.ndarray:
        """Read one tensor (stored or canonical name) into host memory; bf16 as ml_dtypes.bfloat16."""
        info = self.info(name)
        try:
            arr = self._handle(info.file).get_tensor(info.name)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self._abs(info.file)}: cannot read tensor {info.name!r} "
                                  f"({e})") from None
        if tuple(arr.shape) != info.shape or arr.dtype.name != info.dtype:
            raise CheckpointError(f"{self._abs(info.file)}: tensor {info.name!r} read back as "
                                  f"{arr.dtype.name}{list(arr.shape)}, header says "
                                  f"{info.dtype}{list(info.shape)}")
        return arr

    # ---- slice reads (positioned, thread-safe) -------------------------------------------------
    def _fd(self, fname: str) -> int:
        with self._lock:
            fd = self._fds.get(fname)
            if fd is None:
                try:
                    fd = os.open(self._abs(fname), os.O_RDONLY)
                except OSError as e:
                    raise CheckpointError(f"{self._abs(fname)}: cannot open ({e.strerror})") from None
                self._fds[fname] = fd
            return fd

    def _pread(self, info: TensorInfo, buf: memoryview, offset: int) -> None:
        """Fill `buf` (bytes) from absolute file offset `offset` of info's file."""
        self.read_into(info.file, offset, [buf], info.name)

    def read_into(self, fname: str, offset: int, bufs: Sequence[memoryview],
                  what: Union[str, Sequence[str]] = "") -> None:
        """Fill the byte buffers `bufs` with the contiguous range of file `fname` that starts at
        `offset` (one positioned vector read, repeated on short reads). Thread-safe; the GIL is
        released while the kernel copies. `what`: the tensor name (or one name per buffer) for errors."""
        fd = self._fd(fname)
        names = [what] * len(bufs) if isinstance(what, str) else list(what)
        total = sum(len(b) for b in bufs)
        done, pending = 0, [(b, n) for b, n in zip(bufs, names) if len(b)]
        while pending:
            try:
                k = os.preadv(fd, [b for b, _ in pending[:_IOV_MAX]], offset + done)
            except OSError as e:
                raise CheckpointError(f"{self._abs(fname)}: cannot read tensor {pending[0][1]!r} "
                                      f"({e.strerror})") from None
            if k == 0:
                raise CheckpointError(f"{self._abs(fname)}: truncated file: tensor {pending[0][1]!r} "
                                      f"needs bytes up to {offset + done + len(pending[0][0])} but the "
                                      f"file has {os.fstat(fd).st_size}")
            done += k
            while pending and k >= len(pending[0][0]):
                k -= len(pending[0][0])
                pending.pop(0)
            if pending and k:
                pending[0] = (pending[0][0][k:], pending[0][1])
        if self.drop_page_cache:
            try:
                os.posix_fadvise(fd, offset, total, os.POSIX_FADV_DONTNEED)
            except (AttributeError, OSError):
                pass
        with self._lock:
            self.bytes_read += total

    def slice_plan(self, name: str, index=()) -> tuple[TensorInfo, tuple[int, ...], list[tuple[int, int]], bool]:
        """How `read_slice` reads tensor[index]: (info, result shape, byte runs (absolute offset,
        length) in C order, whether the runs are read as one covering span of whole rows)."""
        info = self.info(name)
        b = _bounds(index, info.shape)
        shape = tuple(e - s for s, e in b)
        itemsize = np_dtype(info.dtype).itemsize
        strides = [itemsize * math.prod(info.shape[d + 1:]) for d in range(len(info.shape))]
        partial = [d for d, ((s, e), n) in enumerate(zip(b, info.shape)) if (s, e) != (0, n)]
        if math.prod(shape) == 0:
            return info, shape, [], False
        k = partial[-1] if partial else 0          # runs: contiguous over dims k.., one per outer index
        run = (b[k][1] - b[k][0]) * strides[k]
        n_runs = math.prod(e - s for s, e in b[:k])
        if n_runs > 1 and run < _MIN_RUN_BYTES:
            # one read of the whole rows [s0, e0) of dim 0, cut in memory
            lo = info.begin + b[0][0] * strides[0]
            return info, shape, [(lo, (b[0][1] - b[0][0]) * strides[0])], True
        starts = [info.begin + sum(i * st for i, st in zip(idx, strides)) + b[k][0] * strides[k]
                  for idx in itertools.product(*(range(s, e) for s, e in b[:k]))]
        return info, shape, [(s, run) for s in starts], False

    def read_slice(self, name: str, index=(), out: Optional[np.ndarray] = None) -> np.ndarray:
        """tensor[index] (stored or canonical name; index: step-1 slices of the leading dims), read
        with positioned reads of only the byte runs it needs (short runs: the covering rows).

        out: a C-contiguous array of the slice's shape to fill (any dtype: the stored values are
        cast, e.g. bf16 -> float32); default: a new array of the stored dtype. Thread-safe."""
        info, shape, runs, covering = self.slice_plan(name, index)
        dt = np_dtype(info.dtype)
        if out is not None and (tuple(out.shape) != shape or not out.flags.c_contiguous):
            raise ValueError(f"read_slice({info.name!r}): out is {list(out.shape)} "
                             f"(contiguous={out.flags.c_contiguous}), the slice is {list(shape)}")
        direct = out is not None and out.dtype == dt and not covering
        dst = out if direct else np.empty(shape, dt)
        if covering:
            b = _bounds(index, info.shape)
            rows = np.empty((b[0][1] - b[0][0],) + tuple(info.shape[1:]), dt)
            self._pread(info, memoryview(rows.reshape(-1).view(np.uint8)), runs[0][0])
            dst[...] = rows[(slice(None),) + tuple(slice(s, e) for s, e in b[1:])]
        elif runs:
            flat = memoryview(dst.reshape(-1).view(np.uint8))
            pos = 0
            for off, length in runs:
                self._pread(info, flat[pos:pos + length], off)
                pos += length
        if out is None:
            return dst
        if not direct:
            out[...] = dst
        return out

    def close(self) -> None:
        while self._handles:
            _, h = self._handles.popitem()
            h.__exit__(None, None, None)
        with self._lock:
            while self._fds:
                _, fd = self._fds.popitem()
                os.close(fd)

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- validation ------------------------------------------------------------------
    def _num_hidden_layers(self, expected: Mapping[str, Any]) -> Optional[int]:
        layers = [layout_lib.layer_of(n) for n in expected]
        layers = [i for i in layers if i is not None]
        if layers:
            return max(layers) + 1
        cfg = self.config_dict or {}
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        n = text.get("num_hidden_layers")
        return int(n) if isinstance(n, int) else None

    def validate(self, expected: Mapping[str, layout_lib.TensorSpec]) -> dict[str, TensorInfo]:
        """Check the checkpoint holds exactly `expected` (canonical name -> (shape, dtype)).

        Tensors skipped by design (vision tower, projector, MTP layers, rotary_emb.inv_freq) are
        logged in one line. Raises CheckpointError naming the first problem (file and tensor) and
        how many more there are. Returns canonical name -> TensorInfo for the expected tensors.
        """
        n_layers = self._num_hidden_layers(expected)
        skipped: collections.Counter[str] = collections.Counter()
        found: dict[str, TensorInfo] = {}
        problems: list[str] = []
        nextn = self._config_field("num_nextn_predict_layers")
        nextn = nextn if isinstance(nextn, int) and not isinstance(nextn, bool) and nextn >= 0 else 0
        # a layer past num_hidden_layers is an MTP layer when config.json counts it
        # (num_nextn_predict_layers) or it has an MTP layer's own tensors (eh_proj, enorm, hnorm);
        # any other is a layer of the model that the config leaves out
        layer = lambda n: layout_lib.layer_of(layout_lib.canonical_name(n) or n)
        mtp = {layer(n) for n in self.tensors if any(f".{k}." in n for k in ("eh_proj", "enorm", "hnorm"))}
        beyond: list[str] = []
        for name, info in self.tensors.items():
            why = layout_lib.skip_reason(name, n_layers)
            if why == "MTP layer" and layer(name) >= n_layers + nextn and layer(name) not in mtp:
                beyond.append(name)
                continue
            if why is not None:
                skipped[why] += 1
                continue
            c = layout_lib.canonical_name(name)
            where = self._abs(info.file)
            if c in found:
                problems.append(f"{where}: tensor {name!r} duplicates {found[c].name!r} in "
                                f"{self._abs(found[c].file)}")
                continue
            found[c] = info
            if c not in expected:
                problems.append(f"{where}: unexpected tensor {name!r} (not part of the model "
                                "that the config describes)")
                continue
            shape, dtype = expected[c]
            if tuple(info.shape) != tuple(shape):
                problems.append(f"{where}: tensor {name!r} has shape {list(info.shape)}, expected "
                                f"{list(shape)}")
            elif info.dtype not in layout_lib.accepted_dtypes(c, dtype):
                problems.append(f"{where}: tensor {name!r} has dtype {info.dtype}, expected {dtype}")
        # Missing tensors first: their message carries the bf16-vs-INT4 hint when that is the cause,
        # or the layer / expert count the checkpoint has when config.json disagrees with it.
        missing = [c for c in expected if c not in found]
        if missing:
            peers = self._layer_summary(found)
            problems = [self._missing_message(c, found, peers, expected) for c in missing] + problems
        if skipped and not self._skip_logged:
            self._skip_logged = True
            kinds = ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items()))
            log.info("%s: skipping %d tensors not used by design (%s)", self.path,
                     sum(skipped.values()), kinds)
        if beyond:
            top = max(layer(n) for n in beyond)
            t = self.tensors[beyond[0]]
            problems.insert(0, f"{self._abs(t.file)}: tensor {t.name!r} belongs to layer {layer(t.name)}, but "
                               f"config.json says num_hidden_layers={n_layers} and num_nextn_predict_layers="
                               f"{nextn}: the checkpoint holds layers up to {top}")
        if problems:
            more = f" [+{len(problems) - 1} more problem(s)]" if len(problems) > 1 else ""
            raise CheckpointError(problems[0] + more)
        return {c: found[c] for c in expected}

    @staticmethod
    def _layer_summary(found: Mapping[str, TensorInfo]) -> dict:
        """layer -> (files holding its tensors, number of routed experts stored) in one pass."""
        files: dict[int, set] = collections.defaultdict(set)
        experts: dict[int, int] = collections.defaultdict(int)
        for n, i in found.items():
            layer = layout_lib.layer_of(n)
            if layer is None:
                continue
            files[layer].add(i.file)
            m = _EXPERT_RE.match(n)
            if m:
                experts[layer] = max(experts[layer], int(m.group(2)) + 1)
        return {"files": files, "experts": experts, "layers": max(files, default=-1) + 1}

    def _config_field(self, name: str):
        cfg = self.config_dict or {}
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        return text.get(name)

    def _missing_message(self, c: str, found: Mapping[str, TensorInfo], peers: dict,
                         expected: Mapping[str, Any]) -> str:
        stored = layout_lib.layout_name(c, self.layout)
        layer = layout_lib.layer_of(c)
        if self.index_path:
            where = f"{self.index_path}: missing tensor {stored!r} (not in the index's weight_map"
            files = sorted(peers["files"].get(layer, ())) if layer is not None else []
            where += f"; other tensors of layer {layer} are in {', '.join(files)})" if files else ")"
        else:
            where = f"{self._abs(self.files[0])}: missing tensor {stored!r}"
        base, _, suffix = c.rpartition(".")
        m = _EXPERT_RE.match(c)
        if suffix in layout_lib.QUANT_SUFFIXES and f"{base}.weight" in found:
            where += "; the checkpoint has bf16 experts but config.json has a quantization_config"
        elif suffix == "weight" and f"{base}.weight_packed" in found:
            where += "; the checkpoint has INT4 experts but config.json has no quantization_config"
        elif m and 0 < peers["experts"].get(layer, 0) <= int(m.group(2)):
            where += (f"; the checkpoint has {peers['experts'][layer]} routed experts in layer {layer} "
                      f"but config.json says n_routed_experts={self._config_field('n_routed_experts')}")
        elif layer is not None and layer not in peers["files"] and peers["layers"] > 0:
            where += (f"; the checkpoint has layers 0..{peers['layers'] - 1} but config.json says "
                      f"num_hidden_layers={self._config_field('num_hidden_layers')}")
        return where
