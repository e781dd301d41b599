"""sha256 of every file under a directory, computed in parallel, and its verification: the data
checksums of an orbax checkpoint (checkpoints.orbax_io writes them, restore verifies them)."""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
from typing import Mapping, Optional

from checkpoints.safetensors_io import CheckpointError

BLOCK = 8 << 20


def _files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(out)


def _sha256(file: str) -> str:
    h = hashlib.sha256()                  # hashlib releases the GIL on large updates: threads scale
    with open(file, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return "sha256:" + h.hexdigest()


def digest_tree(root: str, workers: Optional[int] = None) -> dict[str, str]:
    """{path relative to root: 'sha256:<hex>'} of every file under root."""
    files = _files(root)
    with concurrent.futures.ThreadPoolExecutor(workers or min(16, os.cpu_count() or 1)) as pool:
        return dict(zip(files, pool.map(_sha256, (os.path.join(root, f) for f in files))))


def verify_tree(root: str, expected: Mapping[str, str], workers: Optional[int] = None) -> None:
    """Refuse (CheckpointError naming the file) a tree whose files differ from `expected`: a file
    missing, added, or whose bytes changed."""
    got = set(_files(root))
    missing = sorted(set(expected) - got)
    if missing:
        raise CheckpointError(f"{os.path.join(root, missing[0])}: missing (its checksum is recorded) "
                              f"[{len(missing)} file(s)]")
    extra = sorted(got - set(expected))
    if extra:
        raise CheckpointError(f"{os.path.join(root, extra[0])}: not among the files the checkpoint recorded")
    names = sorted(expected)
    with concurrent.futures.ThreadPoolExecutor(workers or min(16, os.cpu_count() or 1)) as pool:
        for name, digest in zip(names, pool.map(_sha256, (os.path.join(root, n) for n in names))):
            if digest != expected[name]:
                raise CheckpointError(f"{os.path.join(root, name)}: data checksum mismatch (the file changed "
                                      "after it was written: corrupt or altered)")
