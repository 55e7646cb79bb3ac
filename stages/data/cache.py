"""The RL dataset prepared once, not once per step: `load_rl_dataset`.

Preparing a split (reading the parquet files, applying the chat template, tokenising every prompt)
grows with the dataset; picking a step's batch does not. `load_rl_dataset` returns the dataset
`RLDataset(data_cfg, tokenizer, split, fallback_seed)` would build, from rows prepared once:

- key = sha256 of: the data files' contents (sha256, in order), the tokenizer's content (its files
  in `tokenizer_dir` — every step's weights folder carries a copy of the same tokenizer, so the
  folder's path is left out — plus the versions of the libraries that run it), the `data.*` settings
  that change the rows (`RowSpec.key_fields()`: batch size, shuffle and seed are not among them),
  and the source of this module, stages/data/dataset.py, files.py and arrow.py (a change to how
  rows are prepared must not reuse rows prepared the old way);
- in this process: a file is hashed again only when its (inode, size, mtime_ns) changed, and a
  known key returns the rows already prepared;
- on disk, under `cache_dir/datasets/`: `<key>.json` (the manifest: the data file's name, sha256
  and size, the row counts, and what the key was made of) and `<key>-<sha256[:16]>.arrow` (an Arrow
  IPC file of the prepared rows), each written to a temporary file then renamed, the data file
  before the manifest. A new process reads it back instead of tokenising; its sha256 is checked
  first, and a file that does not match (truncated, corrupt, half written) is rebuilt with a
  `DatasetCacheWarning`. Rows from disk are decoded when a batch first uses them, so a step costs
  the same with 1k or 100k prompts.

The tokenizer is loaded only when the rows have to be prepared. Rows whose fields do not
round-trip through JSON exactly (bytes, timestamps, NaN, ...) are kept in this process only.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from fnmatch import fnmatch
from functools import cache
from pathlib import Path

from stages.data import dataset as dataset_module, arrow as dataset_arrow, files as dataset_files
from stages.data.dataset import PreparedRows, RLDataset, RowSpec, prepare_rows
from stages.data.arrow import ArrowRows, encode_rows, row_schema

FORMAT = 1
# Files of a model folder that decide how text is templated and tokenised (weights and generation
# files vary per step or do not matter; of config.json only TOKENIZER_CONFIG_KEYS count).
# *.py: a tokenizer's remote code.
TOKENIZER_FILE_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*",
                           "merges*", "chat_template*", "*.tiktoken", "*.model", "*.py")
TOKENIZER_SUBDIRS = ("additional_chat_templates",)
# config.json keys AutoTokenizer reads to choose the tokenizer class.
TOKENIZER_CONFIG_KEYS = ("model_type", "tokenizer_class", "auto_map")
# tokenizer_config.json keys that say how a tokenizer was loaded, not how it tokenises: a tokenizer
# loaded from a local folder and saved again writes them (every step's weights folder), the base
# model's folder lacks them. Left out of the key, so step 2 (the first step sampling a saved
# folder) reuses the rows step 1 prepared instead of preparing them again.
TOKENIZER_LOADER_KEYS = ("is_local", "local_files_only")
TOKENIZER_LIBRARIES = ("transformers", "tokenizers", "jinja2", "sentencepiece", "tiktoken")
MEMO_ENTRIES = 4  # prepared splits kept per process (train and val of a run, and a spare)
CHECKSUM_ENTRIES = 1024

_LOCK = threading.RLock()
_MEMO: OrderedDict[str, tuple[PreparedRows, str | None]] = OrderedDict()
_BY_STAT: OrderedDict[tuple[str, str], tuple[tuple, object]] = OrderedDict()


class DatasetCacheWarning(UserWarning):
    """A dataset cache file was unusable (and rebuilt) or could not be written."""


def clear_memory_cache() -> None:
    """Forget this process's prepared rows and file checksums (what a new process starts with)."""
    with _LOCK:
        _MEMO.clear()
        _BY_STAT.clear()


# -- the key ---------------------------------------------------------------------------------

def _stat_memo(path: str, kind: str, compute):
    """compute(path), memoised while the file's (inode, size, mtime_ns) is unchanged."""
    st = os.stat(path)
    signature = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _LOCK:
        hit = _BY_STAT.get((path, kind))
        if hit is not None and hit[0] == signature:
            return hit[1]
    value = compute(path)  # stat taken before reading: a write during it changes the signature
    with _LOCK:
        _BY_STAT[(path, kind)] = (signature, value)
        while len(_BY_STAT) > CHECKSUM_ENTRIES:
            _BY_STAT.popitem(last=False)
    return value


def _sha256_file(path) -> str:
    from storage.weights import file_sha256

    return file_sha256(path)


def file_checksum(path) -> str:
    """sha256 of a file's content, computed again only when its stat signature changed."""
    return _stat_memo(os.path.abspath(os.path.expanduser(str(path))), "sha256", _sha256_file)


def _tokenizer_config_sha256(path: str) -> str:
    """sha256 of tokenizer_config.json without TOKENIZER_LOADER_KEYS (canonical JSON); of its bytes
    where it is not a JSON object."""
    data = Path(path).read_bytes()
    try:
        config = json.loads(data)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        return hashlib.sha256(data).hexdigest()
    kept = {k: v for k, v in config.items() if k not in TOKENIZER_LOADER_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def _config_fields(path: str) -> dict:
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable config.json ({err})") from None
    return {k: config[k] for k in TOKENIZER_CONFIG_KEYS if k in config}


@cache
def _library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in TOKENIZER_LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


@cache
def _code_fingerprint() -> str:
    digest = hashlib.sha256()
    for module_file in (dataset_module.__file__, dataset_files.__file__, dataset_arrow.__file__, __file__):
        digest.update(Path(module_file).read_bytes())
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer_dir) -> dict:
    """The content of the tokenizer files in a model folder (not their path), the config keys that
    choose the tokenizer class, and the versions of the libraries that run it."""
    folder = os.path.abspath(os.path.expanduser(str(tokenizer_dir)))
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"tokenizer folder not found: {tokenizer_dir}") from None
    names = [e.name for e in entries
             if e.is_file() and any(fnmatch(e.name, pattern) for pattern in TOKENIZER_FILE_PATTERNS)]
    for sub in TOKENIZER_SUBDIRS:
        if os.path.isdir(os.path.join(folder, sub)):
            names += [f"{sub}/{e.name}" for e in os.scandir(os.path.join(folder, sub)) if e.is_file()]
    if not names:
        raise FileNotFoundError(
            f"no tokenizer files ({', '.join(TOKENIZER_FILE_PATTERNS)}) in {tokenizer_dir}")
    config = os.path.join(folder, "config.json")
    return {"files": {name: _stat_memo(os.path.join(folder, name), "sha256", _sha256_file)
                      if name != "tokenizer_config.json" else
                      _stat_memo(os.path.join(folder, name), "tokenizer_config", _tokenizer_config_sha256)
                      for name in sorted(names)},
            "config": _stat_memo(config, "config", _config_fields) if os.path.isfile(config) else {},
            "libraries": _library_versions()}


def dataset_key(spec: RowSpec, tokenizer_dir) -> tuple[str, dict]:
    """(key, what it was made of) for a split's prepared rows."""
    data_files = []
    for path in spec.files:
        try:
            data_files.append(file_checksum(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"data file not found: {path}") from None
    parts = {"format": FORMAT, "code": _code_fingerprint(), "data_files": data_files,
             "tokenizer": tokenizer_fingerprint(tokenizer_dir), "rows": spec.key_fields()}
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32], parts


# -- loading ---------------------------------------------------------------------------------

def load_rl_dataset(data_cfg: dict, tokenizer_dir, split: str = "train", fallback_seed: int = 0,
                    cache_dir=None, tokenizer=None, chat_template: str | None = None) -> RLDataset:
    """`RLDataset(data_cfg, <tokenizer of tokenizer_dir>, split, fallback_seed)`, from rows prepared
    once per key: from this process's memory, else from `cache_dir` (when given), else prepared
    now (loading the tokenizer unless `tokenizer` is passed; it must be that folder's) and stored
    in both. `cache_dir` is the run's local cache (None: this process's memory only).
    `dataset.cache_info` says which: {"key", "source": memory|disk|built, "path", "load_s"}.
    Every dataset of a key shares its rows (that is what makes a step cheap): treat them as
    read-only. `chat_template` (actor_rollout_ref.model.custom_chat_template) replaces the
    tokenizer's template and is part of the key."""
    t0 = time.perf_counter()
    cfg = dict(data_cfg or {})
    spec = RowSpec.from_config(cfg, split, chat_template)
    key, parts = dataset_key(spec, tokenizer_dir)
    with _LOCK:  # threads asking for a key at once prepare it once
        if key in _MEMO:
            _MEMO.move_to_end(key)
            (prepared, path), source = _MEMO[key], "memory"
        else:
            found = _read_cache(Path(cache_dir), key) if cache_dir is not None else None
            if found is not None:
                (prepared, path), source = found, "disk"
            else:
                if tokenizer is None:
                    tokenizer = _load_tokenizer(tokenizer_dir, spec.trust_remote_code)
                prepared, source = prepare_rows(spec, tokenizer), "built"
                path = None
                if cache_dir is not None:
                    path = _write_cache(Path(cache_dir), key, prepared, parts, spec)
            _MEMO[key] = (prepared, path)
            while len(_MEMO) > MEMO_ENTRIES:
                _MEMO.popitem(last=False)
    dataset = RLDataset.from_prepared(cfg, prepared, split, fallback_seed, chat_template=chat_template)
    dataset.cache_info = {"key": key, "source": source, "path": path,
                          "load_s": round(time.perf_counter() - t0, 6)}
    return dataset


def run_tokenizer_folder(cfg: dict) -> Path:
    """The folder whose tokenizer a run's prompts are keyed and tokenised by: the initial model's
    (actor_rollout_ref.model.path). Every weights folder of the run holds a saved copy of that
    tokenizer (the export, the warm start) and is new each step, so keying by a step's folder hashed
    its files again every step (by their inode: ~3.5 ms of the flow's time on the tiny model, the
    whole tokenizer.json at real size); the initial folder's are hashed once per process."""
    return Path(os.path.expanduser(str(cfg["actor_rollout_ref"]["model"]["path"])))


def load_run_dataset(cfg: dict, split: str, store) -> RLDataset:
    """A run's split (the training flow's schedule, the rollout's prompts): load_rl_dataset with
    the run's data settings, seed, chat template and run_tokenizer_folder, cached in the store's
    local cache dir (storage.cache_dir, else ~/.cache/stagerl: Store resolves it)."""
    model = cfg["actor_rollout_ref"]["model"]
    return load_rl_dataset(dict(cfg.get("data") or {}), run_tokenizer_folder(cfg), split,
                           int(cfg["trainer"].get("seed") or 0), cache_dir=store.cache_dir,
                           chat_template=model.get("custom_chat_template"))


def _load_tokenizer(tokenizer_dir, trust_remote_code: bool):
    from transformers import AutoTokenizer

    folder = Path(os.path.expanduser(str(tokenizer_dir)))
    if not folder.is_dir():  # else Hugging Face reads it as a hub repo id
        raise FileNotFoundError(f"tokenizer folder {folder} does not exist (the model path: a local "
                                f"Hugging Face folder)")
    return AutoTokenizer.from_pretrained(os.path.expanduser(str(tokenizer_dir)),
                                         trust_remote_code=trust_remote_code)


# -- the disk cache --------------------------------------------------------------------------

def _write_cache(cache_dir: Path, key: str, prepared: PreparedRows, parts: dict, spec: RowSpec):
    """Write the rows and then their manifest; returns the data file's path (None when the rows
    cannot be stored or the folder is not writable: this process keeps them in memory anyway)."""
    import pyarrow as pa

    table, why_not = encode_rows(prepared.rows)
    if table is None:
        warnings.warn(f"dataset cache: rows of {list(spec.files)} kept in memory only: {why_not}",
                      DatasetCacheWarning, stacklevel=3)
        return None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    sha = hashlib.sha256(data).hexdigest()
    folder = cache_dir / "datasets"
    name = f"{key}-{sha[:16]}.arrow"
    manifest = {"format": FORMAT, "key": key, "file": name, "sha256": sha, "bytes": len(data),
                "rows": table.num_rows, "filtered_count": prepared.filtered_count,
                "truncated_count": prepared.truncated_count, "data_files": list(spec.files),
                "key_parts": parts, "written_at": time.time()}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        previous = _manifest_file(folder, key)
        _atomic_write(folder / name, data)
        _atomic_write(folder / f"{key}.json", json.dumps(manifest, indent=1, default=str).encode())
    except OSError as err:
        warnings.warn(f"dataset cache: could not write {folder / name}: {err}", DatasetCacheWarning,
                      stacklevel=3)
        return None
    if previous not in (None, name):  # a rebuilt entry: its old data file is orphaned
        (folder / previous).unlink(missing_ok=True)
    return str(folder / name)


def _manifest_file(folder: Path, key: str) -> str | None:
    try:
        return json.loads((folder / f"{key}.json").read_text()).get("file")
    except (OSError, ValueError, AttributeError):
        return None


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_cache(cache_dir: Path, key: str):
    """(PreparedRows, path) from the disk cache, None when absent or unusable (warned)."""
    folder = cache_dir / "datasets"
    manifest_path = folder / f"{key}.json"
    if not manifest_path.exists():
        return None
    try:
        return _read_entry(folder, manifest_path, key)
    except Exception as err:  # noqa: BLE001 — any unreadable entry is rebuilt, never trusted
        warnings.warn(f"dataset cache entry {manifest_path} is unusable, rebuilding it: {err}",
                      DatasetCacheWarning, stacklevel=3)
        return None


def _read_entry(folder: Path, manifest_path: Path, key: str):
    import pyarrow as pa

    manifest = json.loads(manifest_path.read_text())
    name = manifest["file"]
    if manifest.get("format") != FORMAT or manifest.get("key") != key or not str(name).startswith(key) \
            or "/" in name or "\\" in name:
        raise ValueError(f"manifest does not describe key {key} in format {FORMAT}")
    path = folder / name
    data = path.read_bytes()
    if len(data) != manifest["bytes"]:
        raise ValueError(f"{path} has {len(data)} bytes, the manifest says {manifest['bytes']}")
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise ValueError(f"{path}: sha256 differs from the manifest's")
    table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
    if table.schema != row_schema() or table.num_rows != manifest["rows"]:
        raise ValueError(f"{path}: {table.num_rows} rows of {table.schema} do not match the manifest")
    rows = ArrowRows(table.combine_chunks(), str(path))
    return PreparedRows(rows, int(manifest["filtered_count"]), int(manifest["truncated_count"])), str(path)
