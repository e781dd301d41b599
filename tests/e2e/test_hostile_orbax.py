"""Orbax checkpoints whose data changed after they were written: the sha256 of every file under
state/ is recorded at save and compared on restore, so a flipped byte, a file gone or a file added
is refused in one line naming the file; verify=False skips the comparison."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from checkpoints import orbax_io
from checkpoints.safetensors_io import CheckpointError
from kimi_jax.config import preset

HF = preset("tiny").to_hf_dict()


@pytest.fixture
def saved(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"a": {"w": rng.standard_normal((64, 96)).astype(np.float32)},
              "b": {"w": rng.integers(0, 2**31 - 1, (4, 128), dtype=np.int32)}}
    path = str(tmp_path / "ck")
    meta = orbax_io.save(path, arrays, HF, chunk_bytes=8 << 10)
    specs = {("a", "w"): jax.ShapeDtypeStruct((64, 96), np.float32), ("b", "w"): jax.ShapeDtypeStruct((4, 128), np.int32)}
    return path, meta, arrays, specs


def _data_files(path: str) -> list[str]:
    """The files of state/ holding array bytes (the largest ones), largest first."""
    root = os.path.join(path, orbax_io.STATE_DIR)
    files = [os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns]
    return sorted(files, key=os.path.getsize, reverse=True)


def test_checksums_are_recorded_for_every_file(saved):
    path, meta, arrays, specs = saved
    with open(os.path.join(path, orbax_io.META_FILE)) as f:
        recorded = json.load(f)["checksums"]
    root = os.path.join(path, orbax_io.STATE_DIR)
    assert set(recorded) == {os.path.relpath(f, root) for f in _data_files(path)}
    got = orbax_io.restore_params(path, HF, specs)
    assert np.array_equal(np.asarray(got[("a", "w")]), arrays["a"]["w"])


def test_a_flipped_data_byte_is_refused_naming_the_file(saved):
    path, meta, arrays, specs = saved
    victim = _data_files(path)[0]
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CheckpointError, match="data checksum mismatch") as e:
        orbax_io.restore_params(path, HF, specs)
    assert os.path.relpath(victim, path) in str(e.value) and "\n" not in str(e.value)
    try:                                 # unverified: orbax may restore the flipped value or fail
        orbax_io.restore_params(path, HF, specs, verify=False)
    except CheckpointError:
        pass


def test_a_file_gone_or_added_is_refused(saved):
    path, meta, arrays, specs = saved
    extra = os.path.join(path, orbax_io.STATE_DIR, "stray.bin")
    with open(extra, "wb") as f:
        f.write(b"x")
    with pytest.raises(CheckpointError, match="stray.bin: not among the files"):
        orbax_io.restore_params(path, HF, specs)
    os.remove(extra)
    victim = next(f for f in _data_files(path) if "ocdbt" not in os.path.basename(f) and "manifest" not in f)
    os.remove(victim)
    with pytest.raises(CheckpointError):
        orbax_io.restore_params(path, HF, specs)


def test_load_arrays_verifies_unless_told_not_to(saved, monkeypatch):
    from checkpoints import checksums, loader
    path, meta, arrays, specs = saved
    calls = []
    real = checksums.verify_tree
    monkeypatch.setattr(checksums, "verify_tree", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = preset("tiny")
    orbax_io.restore_params(path, HF, specs)
    assert calls == [1]
    monkeypatch.setattr(orbax_io, "restore_params", lambda p, c, s, verify: calls.append(verify) or {})
    loader.load_arrays(path, specs, cfg, check_finite=False)
    loader.load_arrays(path, specs, cfg)
    assert calls == [1, False, True]
