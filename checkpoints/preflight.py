"""A checkpoint directory's config.json checked against its weights' index and its tokenizer files
before anything is built: only headers, the index and small JSON files are read, so a config that
asks for more layers or experts than are stored, or a tokenizer that cannot match the model, is
refused in milliseconds with one line naming the file and field."""
from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

from checkpoints import layout as layout_lib
from checkpoints.safetensors_io import CheckpointError, CheckpointReader
from checkpoints.tokenizer_format import TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE

_EXPERT_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
_CONFIG_BYTES = 64 * 2**20        # a tokenizer_config.json is kilobytes; larger is not one


def check(path: str, cfg: Any, config_dict: Optional[dict] = None) -> Optional[CheckpointReader]:
    """Refuse (CheckpointError) a config (a ModelConfig) the checkpoint at `path` cannot back.
    Returns the reader the check opened on safetensors weights (their index and headers parsed, no
    file left open) for the load to read through (checkpoints.loader.load_arrays' `reader`); None
    for orbax or no weights. config_dict: config.json already parsed, not read again."""
    from checkpoints import orbax_io
    reader = None
    if orbax_io.is_orbax_checkpoint(path):
        _check_orbax(path, cfg)
    elif _has_weights(path):
        reader = CheckpointReader(path, config_dict=config_dict)
        _check_safetensors(reader, cfg)
    _check_tokenizer(path, cfg)
    return reader


def _has_weights(path: str) -> bool:
    return any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in os.listdir(path))


def _check_safetensors(reader: CheckpointReader, cfg: Any) -> None:
    """A config asking for more layers or experts than are stored is refused by the loader's own
    validation, run on the config cut to one layer / expert beyond what is stored (so the check costs
    what the stored model costs, not what the config asks)."""
    from checkpoints.loader import expected_for
    path = reader.path
    names = [n for n in (layout_lib.canonical_name(s) for s in reader.tensors) if n is not None]
    layers = {i for i in map(layout_lib.layer_of, names) if i is not None}
    experts = {int(m.group(1)) for m in map(_EXPERT_RE.match, names) if m}
    cut = {}
    if cfg.num_hidden_layers > len(layers):
        cut["num_hidden_layers"] = len(layers) + 1
    if experts and cfg.n_routed_experts > max(experts) + 1:
        cut["n_routed_experts"] = max(experts) + 2
        cut["num_experts_per_tok"] = min(cfg.num_experts_per_tok, max(experts) + 2)
        cut["n_group"] = 1
        cut["topk_group"] = 1
    if cut:
        reader.validate(expected_for(reader, cfg.replace(**cut)))
        asked = ', '.join(f'{k}={getattr(cfg, k)}' for k in cut)
        held = reader.index_path or os.path.join(path, reader.files[0])
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: {asked} is more than {held} "
                              "holds")


def _check_orbax(path: str, cfg: Any) -> None:
    from checkpoints import orbax_io
    meta = orbax_io.read_metadata(path)
    stored = meta["config"] if isinstance(meta["config"], dict) else {}
    for k in ("num_hidden_layers", "n_routed_experts"):
        if isinstance(stored.get(k), int) and getattr(cfg, k) > stored[k]:
            raise CheckpointError(f"{os.path.join(path, orbax_io.META_FILE)}: config field {k!r} is {stored[k]} in "
                                  f"the checkpoint but {getattr(cfg, k)} in {os.path.join(path, 'config.json')} "
                                  "(the checkpoint was written for another model)")


def _load_small_json(file: str) -> Any:
    if os.path.getsize(file) > _CONFIG_BYTES:
        raise CheckpointError(f"{file}: {os.path.getsize(file)} bytes, not a tokenizer config")
    try:
        with open(file, "rb") as f:
            return json.loads(f.read())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({type(e).__name__})") from None


def _check_tokenizer(path: str, cfg: Any) -> None:
    model_file, config_file = os.path.join(path, TIKTOKEN_FILE), os.path.join(path, TOKENIZER_CONFIG_FILE)
    has_model, has_config = os.path.isfile(model_file), os.path.isfile(config_file)
    if has_config and not has_model:
        raise CheckpointError(f"{model_file}: missing, but {TOKENIZER_CONFIG_FILE} is there (an incomplete "
                              "tokenizer: copy the file, or remove both for a model without one)")
    if not has_config:
        return
    cfg_file = os.path.join(path, "config.json")
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = getattr(cfg, field)
        for tid in ids if isinstance(ids, tuple) else (ids,):
            if tid is not None and tid >= cfg.vocab_size:
                raise CheckpointError(f"{cfg_file}: {field}={tid} is outside the vocabulary (vocab_size="
                                      f"{cfg.vocab_size}) of a model with a tokenizer")
    tc = _load_small_json(config_file)
    if not isinstance(tc, dict):
        raise CheckpointError(f"{config_file}: not a JSON object")
    n = tc.get("num_reserved_special_tokens")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= cfg.vocab_size):
        raise CheckpointError(f"{config_file}: num_reserved_special_tokens={n!r} must be an integer in "
                              f"[0, vocab_size={cfg.vocab_size}]")
    added = tc.get("added_tokens_decoder") or {}
    ids = {_content(v): k for k, v in added.items()} if isinstance(added, dict) else {}
    for field in ("bos_token", "eos_token", "pad_token"):
        tid = _int(ids.get(_content(tc.get(field))))
        if tid is not None and not 0 <= tid < cfg.vocab_size:
            raise CheckpointError(f"{config_file}: {field} {_content(tc.get(field))!r} has id {tid}, outside the "
                                  f"model's vocabulary (vocab_size={cfg.vocab_size})")
    for k, v in added.items() if isinstance(added, dict) else ():
        if (tid := _int(k)) is not None and not 0 <= tid < cfg.vocab_size:
            raise CheckpointError(f"{config_file}: added token {_content(v)!r} has id {tid}, outside the "
                                  f"model's vocabulary (vocab_size={cfg.vocab_size})")


def _content(v) -> Optional[str]:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _int(v) -> Optional[int]:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None
