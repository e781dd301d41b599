"""Synthetic checkpoints in the exact Kimi-K2 / K2.5 on-disk format (for tests and demos).

`write_checkpoint(path, cfg)` writes config.json plus safetensors holding exactly the tensors of
`layout.expected_tensors(cfg)` (random weights; INT4 routed experts packed by `int4.pack_weight`),
in the K2 layout (DeepseekV3ForCausalLM names) or the K2.5 layout (`language_model.` prefixes, a
nested config and a few dummy vision tensors that kimi_jax skips). Each tensor's values depend
only on (seed, canonical name), so the same seed gives the same weights whatever the layout or
shard count. Files are streamed: each shard's header is written first (every shape is known up
front), then each tensor's bytes as they are produced, large ones in pieces, so memory stays at about
one tensor (or one 32 MB piece) whatever the shard size: a true-geometry Kimi-K2.5 layer (9.5 GB of
INT4 experts) never needs more than a few hundred MB. `values="fast"` fills large tensors from raw
PCG64DXSM bits (INT4 words) or bit-built bf16 numbers of about the right magnitude (~1 GB/s instead
of ~0.1 GB/s for normal samples + INT4 quantization), for benchmarks at real scale. A shard is
written to `NAME.tmp` and renamed when complete.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import zlib
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import ml_dtypes
import numpy as np

from checkpoints import int4
from checkpoints import layout as layout_lib
from checkpoints.safetensors_io import CONFIG_FILE, DTYPES, INDEX_FILE, SINGLE_FILE, CheckpointError

BF16 = np.dtype(ml_dtypes.bfloat16)
_NP_DTYPES = {"bfloat16": BF16, "float32": np.dtype(np.float32), "int32": np.dtype(np.int32),
              "int64": np.dtype(np.int64)}
_NORM_STD = 0.05          # norm weights: 1 + 0.05 * N(0, 1), "around 1.0"
_WEIGHT_FILES = (SINGLE_FILE, INDEX_FILE, CONFIG_FILE)
_TAGS = {name: tag for tag, (name, _) in DTYPES.items()}     # 'bfloat16' -> 'BF16'
_PIECE_ELEMS = 1 << 23     # large tensors are produced and written 8M elements at a time
_FAST_MIN_ELEMS = 1 << 16  # values="fast": smaller tensors (norms, biases) keep normal values
VALUES = ("normal", "fast")

__all__ = ["write_checkpoint", "write_checkpoint_from_tensors", "write_safetensors", "hf_config_dict",
           "shard_file_name", "VALUES"]


# ---- config.json ---------------------------------------------------------------------
def hf_config_dict(cfg: layout_lib.ModelShape, layout: str = "k2") -> dict:
    """config.json contents for `cfg`: DeepSeek-V3 fields (k2) or the KimiK25 nesting (k25)."""
    text = cfg.to_hf_dict()
    if layout == "k2":
        text["model_type"] = cfg.model_type if cfg.model_type in ("deepseek_v3", "kimi_k2") else "kimi_k2"
        return text
    if layout != "k25":
        raise ValueError(f"unknown checkpoint layout {layout!r} (known: {layout_lib.LAYOUTS})")
    text["model_type"] = "kimi_k2"
    top = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"], "tie_word_embeddings": cfg.tie_word_embeddings,
        "ignore_index": -100, "use_unified_vision_chunk": True,
        "text_config": text,
        # A small stand-in for MoonViT's config; kimi_jax never reads it.
        "vision_config": {"model_type": "moonvit", "num_hidden_layers": 1, "hidden_size": 8,
                          "intermediate_size": 16, "num_attention_heads": 2, "patch_size": 2,
                          "merge_kernel_size": [2, 2], "mm_projector_type": "patchmerger",
                          "text_hidden_size": cfg.hidden_size},
    }
    if "quantization_config" in text:
        top["quantization_config"] = text["quantization_config"]
    return top


def _vision_specs(cfg: layout_lib.ModelShape) -> dict[str, layout_lib.TensorSpec]:
    """A few tiny stand-ins for K2.5's vision tower / projector (exercise the skip path)."""
    return {"vision_tower.patch_embed.proj.weight": ((8, 3, 2, 2), "bfloat16"),
            "vision_tower.encoder.final_layernorm.weight": ((8,), "bfloat16"),
            "mm_projector.proj.0.weight": ((cfg.hidden_size, 32), "bfloat16")}


# ---- random tensors --------------------------------------------------------------------
def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _rows_per_piece(shape: tuple[int, ...]) -> int:
    return max(1, _PIECE_ELEMS // max(1, math.prod(shape[1:])))


class _RandomTensors:
    """Deterministic random value of each tensor, from (seed, canonical name) only.

    Returns an array, or for large tensors an iterator of C-order pieces (row blocks or flat runs)
    whose concatenation is the tensor: the values do not depend on the piece size.
    """

    def __init__(self, seed: int, std: float, group_size: Optional[int], values: str = "normal"):
        if values not in VALUES:
            raise ValueError(f"values={values!r} (known: {VALUES})")
        self.seed, self.std, self.group_size, self.values = seed, std, group_size, values
        self._last: tuple[str, tuple] = ("", ())          # INT4 (base name, (packed, scale))

    def _int4(self, base: str, out_in: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        if self._last[0] != base:
            w = self.std * _rng(self.seed, base).standard_normal(out_in, dtype=np.float32)
            self._last = (base, int4.pack_weight(w, self.group_size))
        return self._last[1]

    def __call__(self, name: str, shape: tuple[int, ...], dtype: str):
        base, _, suffix = name.rpartition(".")
        if suffix == "weight_shape":
            raise AssertionError("weight_shape is produced by the caller")
        if self.values == "fast" and math.prod(shape) >= _FAST_MIN_ELEMS:
            return self._fast(name, shape, dtype, suffix)
        if suffix in ("weight_packed", "weight_scale"):
            packed, scale = self._int4(base, (shape[0], shape[1] * 8 if suffix == "weight_packed"
                                              else shape[1] * self.group_size))
            return packed if suffix == "weight_packed" else scale
        if math.prod(shape) > _PIECE_ELEMS:
            return self._normal_pieces(name, shape, dtype)
        x = _rng(self.seed, name).standard_normal(shape, dtype=np.float32)
        return self._finish(name, suffix, x, dtype)

    def _finish(self, name: str, suffix: str, x: np.ndarray, dtype: str) -> np.ndarray:
        if suffix == "e_score_correction_bias":
            return (self.std * x).astype(np.float32)
        if name.endswith("norm.weight"):
            return (1.0 + _NORM_STD * x).astype(_NP_DTYPES[dtype])
        return (self.std * x).astype(_NP_DTYPES[dtype])

    def _normal_pieces(self, name, shape, dtype) -> Iterator[np.ndarray]:
        # consecutive draws from one generator equal one big draw: same values as unpieced
        rng, suffix, rows = _rng(self.seed, name), name.rpartition(".")[2], _rows_per_piece(shape)
        for r in range(0, shape[0], rows):
            n = min(rows, shape[0] - r)
            yield self._finish(name, suffix, rng.standard_normal((n,) + tuple(shape[1:]),
                                                                 dtype=np.float32), dtype)

    def _fast(self, name, shape, dtype, suffix) -> Iterator[np.ndarray]:
        """Raw PCG64DXSM words: INT4 packed words as they come (every nibble is a valid code);
        bf16/float32 numbers with a random sign and mantissa and one of four binary exponents
        around the tensor's magnitude (std for weights, std/4.6 for INT4 group scales, as
        uniform codes in [-8, 7] have std 4.6)."""
        bits = np.random.PCG64DXSM([self.seed, zlib.crc32(name.encode())])
        dt = _np_dtype(dtype)
        total = math.prod(shape)
        per_word = 8 // dt.itemsize
        mag = self.std / 4.6 if suffix == "weight_scale" else self.std
        top = math.floor(math.log2(mag)) + 1        # magnitudes in [2^(top-4), 2^top)
        for start in range(0, total, _PIECE_ELEMS):
            n = min(_PIECE_ELEMS, total - start)
            w = bits.random_raw(-(-n // per_word)).view(dt if dt.kind in "iu" else
                                                        (np.uint16 if dt.itemsize == 2 else np.uint32))[:n]
            if dt.kind in "iu":
                yield w
                del w
                continue
            m = 7 if dt.itemsize == 2 else 23       # mantissa bits (bfloat16 / float32)
            e = w >> m                              # in place from here: one temporary piece
            e &= 3
            np.subtract(127 + top - 1, e, out=e)    # biased exponent
            e <<= m
            w &= (0x807F if m == 7 else 0x807FFFFF)  # keep sign and mantissa
            w |= e
            del e
            yield w.view(dt)
            del w                                   # before the next piece is drawn


# ---- writing -------------------------------------------------------------------------
def shard_file_name(i: int, n: int) -> str:
    """HF shard name, 1-based: model-00001-of-00003.safetensors."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _np_dtype(dtype: str) -> np.dtype:
    return _NP_DTYPES[dtype] if dtype in _NP_DTYPES else np.dtype(dtype)


def _nbytes(shape, dtype: str) -> int:
    return math.prod(shape) * _np_dtype(dtype).itemsize


def _split(sizes: Sequence[int], n: int) -> list[list[int]]:
    """Contiguous split of tensor indices into n non-empty shards of roughly equal bytes."""
    if not 1 <= n <= len(sizes):
        raise ValueError(f"num_shards={n} must be between 1 and the number of tensors ({len(sizes)})")
    total, acc, s = sum(sizes), 0, 0
    shards: list[list[int]] = [[] for _ in range(n)]
    for i, size in enumerate(sizes):
        left = len(sizes) - i                      # tensors not yet placed, including i
        if shards[s] and s < n - 1 and (acc >= (s + 1) * total / n or left == n - 1 - s):
            s += 1
        shards[s].append(i)
        acc += size
    return shards


def _clear(path: str) -> None:
    """Remove weight/index/config files of an earlier checkpoint written to `path`."""
    for f in os.listdir(path):
        if f in _WEIGHT_FILES or (f.startswith("model") and (f.endswith(".safetensors")
                                                             or f.endswith(".safetensors.tmp"))):
            os.remove(os.path.join(path, f))


Produced = Union[np.ndarray, Iterable[np.ndarray]]


def write_safetensors(file_path: str, specs: Sequence[tuple[str, tuple, str]],
                      produce: Callable[[str, tuple, str], Produced],
                      metadata: Optional[dict] = None) -> int:
    """Stream one safetensors file: the header (from `specs` [(name, shape, dtype name)]), then each
    tensor's bytes from `produce(name, shape, dtype)` (an array, or an iterable of C-order pieces).

    Tensors are laid out by decreasing item size (as the safetensors library does), so every tensor
    starts aligned to its item size. Written to FILE.tmp, renamed when complete. Returns bytes written.
    """
    order = sorted(range(len(specs)), key=lambda i: -_np_dtype(specs[i][2]).itemsize)
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    off = 0
    for i in order:
        name, shape, dtype = specs[i]
        n = _nbytes(shape, dtype)
        header[name] = {"dtype": _TAGS[_np_dtype(dtype).name], "shape": [int(d) for d in shape],
                        "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = file_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i in order:
            name, shape, dtype = specs[i]
            want, dt = _nbytes(shape, dtype), _np_dtype(dtype)
            out = produce(name, shape, dtype)
            if isinstance(out, np.ndarray):
                if out.shape != tuple(shape) or out.dtype != dt:
                    raise CheckpointError(f"{file_path}: tensor {name!r} is {out.dtype}{list(out.shape)}, "
                                          f"expected {dtype}{list(shape)}")
                out = (out,)
            got = 0
            for piece in out:
                piece = np.ascontiguousarray(piece)
                if piece.dtype != dt:
                    raise CheckpointError(f"{file_path}: tensor {name!r}: a piece is {piece.dtype}, "
                                          f"expected {dtype}")
                f.write(memoryview(piece.reshape(-1).view(np.uint8)))
                got += piece.nbytes
                del piece                           # free it before the next one is produced
            if got != want:
                raise CheckpointError(f"{file_path}: tensor {name!r}: produced {got} bytes, "
                                      f"{dtype}{list(shape)} needs {want}")
    os.replace(tmp, file_path)
    return 8 + len(raw) + off


def _write(path: str, config: dict, specs: Sequence[tuple[str, tuple, str]],
           produce: Callable[[str, tuple, str], Produced], num_shards: int,
           tokenizer_dir: Optional[str], on_shard: Optional[Callable[[str, int], None]] = None) -> None:
    """Write config.json and the tensors `specs` [(stored name, shape, dtype)], shard by shard,
    each streamed tensor by tensor (see write_safetensors)."""
    os.makedirs(path, exist_ok=True)
    _clear(path)
    shards = _split([_nbytes(s, d) for _, s, d in specs], num_shards)
    weight_map: dict[str, str] = {}
    for k, idx in enumerate(shards):
        fname = SINGLE_FILE if num_shards == 1 else shard_file_name(k + 1, num_shards)
        n = write_safetensors(os.path.join(path, fname), [specs[i] for i in idx], produce)
        weight_map.update({specs[i][0]: fname for i in idx})
        if on_shard is not None:
            on_shard(fname, n)
    if num_shards > 1:
        total = sum(_nbytes(s, d) for _, s, d in specs)
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer_dir:
        for f in sorted(os.listdir(tokenizer_dir)):
            src = os.path.join(tokenizer_dir, f)
            if os.path.isfile(src) and f not in _WEIGHT_FILES and not f.endswith(".safetensors"):
                shutil.copy2(src, os.path.join(path, f))


def write_checkpoint(path: str, cfg: layout_lib.ModelShape, *, seed: int = 0, layout: str = "k2",
                     num_shards: int = 1, std: float = 0.02,
                     tokenizer_dir: Optional[str] = None, values: str = "normal",
                     on_shard: Optional[Callable[[str, int], None]] = None) -> layout_lib.ModelShape:
    """Write a random checkpoint for `cfg` to directory `path` (earlier weights there are removed).

    Args:
      layout: 'k2' (DeepseekV3ForCausalLM names, flat config) or 'k25' (`language_model.` prefixes,
        KimiK25 nested config, plus a few dummy vision tensors).
      num_shards: 1 writes model.safetensors; more write model-0000i-of-0000N.safetensors and
        model.safetensors.index.json.
      std: normal std of weight matrices (norm weights are 1 + 0.05 N(0,1); the router bias is
        float32 std * N(0,1)).
      tokenizer_dir: copy its files (tiktoken.model, tokenizer_config.json, ...) into path.
      values: 'normal' (above; INT4 experts quantized from normal weights) or 'fast' (tensors of
        64K+ elements from raw random bits, ~10x faster; for loading benchmarks at real scale).
      on_shard: called as on_shard(file name, bytes) after each shard is written.
    Returns:
      cfg (what the written config.json describes).
    """
    expected = layout_lib.expected_tensors(cfg)
    specs = [(layout_lib.layout_name(n, layout), s, d) for n, (s, d) in expected.items()]
    canon = {layout_lib.layout_name(n, layout): n for n in expected}
    if layout == "k25":
        specs += [(n, s, d) for n, (s, d) in _vision_specs(cfg).items()]
    rand = _RandomTensors(seed, std, cfg.quantization.group_size if cfg.quantization else None, values)

    def produce(name, shape, dtype):
        c = canon.get(name, name)
        if c.endswith(".weight_shape"):
            packed_shape = expected[c.rpartition(".")[0] + ".weight_packed"][0]
            return np.array([packed_shape[0], packed_shape[1] * 8], dtype=np.int32)
        return rand(c, shape, dtype)

    _write(path, hf_config_dict(cfg, layout), specs, produce, num_shards, tokenizer_dir, on_shard)
    return cfg


def write_checkpoint_from_tensors(path: str, cfg: layout_lib.ModelShape, tensors: Mapping[str, np.ndarray], *,
                                  layout: str = "k2", num_shards: int = 1,
                                  tokenizer_dir: Optional[str] = None, strict: bool = True,
                                  config: Optional[dict] = None) -> None:
    """Write given weights (canonical names -> arrays) as a `layout` checkpoint for `cfg`.

    Names that are not canonical model tensors (e.g. `vision_tower.*`) are written unchanged.
    strict: require exactly the tensors, shapes and dtypes of `expected_tensors(cfg)` (raises
      CheckpointError otherwise); strict=False writes whatever it is given (to build broken
      checkpoints in tests). config: override the config.json contents.
    """
    expected = layout_lib.expected_tensors(cfg)
    where = os.path.join(path, SINGLE_FILE if num_shards == 1 else INDEX_FILE)
    if strict:
        for n, (shape, dtype) in expected.items():
            if n not in tensors:
                raise CheckpointError(f"{where}: missing tensor {n!r} in the tensors to write")
            a = tensors[n]
            if tuple(a.shape) != tuple(shape) or a.dtype.name not in layout_lib.accepted_dtypes(n, dtype):
                raise CheckpointError(f"{where}: tensor {n!r} is {a.dtype.name}{list(a.shape)}, "
                                      f"expected {dtype}{list(shape)}")
        extra = [n for n in tensors if n not in expected and layout_lib.canonical_name(n) is not None]
        if extra:
            raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} in the tensors to write")
    order = [n for n in expected if n in tensors] + [n for n in tensors if n not in expected]
    stored = {}
    for n in order:
        s = layout_lib.layout_name(n, layout) if layout_lib.canonical_name(n) == n else n
        stored[s] = n
    specs = [(s, tuple(tensors[n].shape), tensors[n].dtype.name) for s, n in stored.items()]
    _write(path, config if config is not None else hf_config_dict(cfg, layout), specs,
           lambda name, shape, dtype: tensors[stored[name]], num_shards, tokenizer_dir)
