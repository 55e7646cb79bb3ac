"""HF model folders in the store (weights/step_k/, or any folder key), with a local cache keyed by
checksum: a folder is downloaded once per machine.

The folder's files are copied as they are; `_manifest.json` (sizes, sha256 per file and the
folder checksum) is written last and is what makes the folder complete. A cached folder is sealed
by `.complete` (the checksum and each file's size and mtime as cached); a cache hit re-hashes a
file only when it changed since, and a damaged folder is downloaded again."""
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

from storage.artifacts import ChecksumError, IncompleteError, code_version, fingerprint
from storage.layout import WEIGHTS_MANIFEST, RunLayout, parse_weights_step
from storage.lineage import folder_base, release
from storage.secrets import scrub
from storage.store import Store

_CHUNK = 8 << 20


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_hashes(local_dir) -> tuple[dict, str]:
    """({relative path: {size, sha256}}, folder checksum) of the files under `local_dir`, as a
    weights manifest records them."""
    local_dir = Path(local_dir)
    entries = {}
    for p in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        rel = p.relative_to(local_dir).as_posix()
        if rel in (WEIGHTS_MANIFEST, ".complete"):
            continue
        entries[rel] = {"size": p.stat().st_size, "sha256": file_sha256(p)}
    if not entries:
        raise FileNotFoundError(f"no files to save in {local_dir}")
    return entries, fingerprint({k: v["sha256"] for k, v in entries.items()})


def save_folder(store: Store, local_dir, key: str, extra=None, adopt_into=None, hashes=None) -> dict:
    """Upload every file under `local_dir` to `key/` and commit it with a manifest. With
    `adopt_into` (a cache dir) the local folder is then MOVED into that cache as the copy of the
    uploaded folder (its files are the ones just hashed), so a reader on this machine, e.g. the
    next step's rollout engine, loads it without downloading it back. `hashes`: folder_hashes of
    `local_dir` when the caller already has them."""
    local_dir = Path(local_dir)
    entries, checksum = hashes if hashes is not None else folder_hashes(local_dir)
    release(store, [key])  # a fork that references the folder being rewritten gets a copy first
    store.delete(f"{key}/{WEIGHTS_MANIFEST}")
    t0 = time.perf_counter()
    for rel in entries:
        store.put_file(local_dir / rel, f"{key}/{rel}")
    manifest = {"files": entries, "checksum": checksum,
                "bytes": sum(e["size"] for e in entries.values()),
                "upload_s": round(time.perf_counter() - t0, 3),
                "code_version": code_version(), "written_at": time.time(),
                "extra": extra or {}}
    manifest = scrub(manifest, store.secret_values)
    store.write_json(f"{key}/{WEIGHTS_MANIFEST}", manifest)
    if adopt_into is not None:
        adopt_folder(local_dir, manifest["checksum"], adopt_into)
    return manifest


def adopt_folder(local_dir, checksum: str, cache_dir) -> Path | None:
    """Move a folder whose files match the manifest `checksum` into the cache (same layout and
    `.complete` marker as load_folder); None when the cache already has it."""
    cache = Path(cache_dir) / "folders"
    target = cache / checksum
    if (target / ".complete").exists():
        return None
    cache.mkdir(parents=True, exist_ok=True)
    _seal(Path(local_dir), checksum)
    try:
        os.rename(local_dir, target)
    except OSError:
        if (target / ".complete").exists():
            return None  # another process adopted the same folder first
        tmp = cache / f".tmp-{checksum[:16]}-{uuid.uuid4().hex[:8]}"  # another file system: copy
        shutil.copytree(local_dir, tmp)
        os.rename(tmp, target)
    return target


def _file_stat(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _seal(folder: Path, checksum: str) -> None:
    """Write `.complete` (atomically, last): the checksum and each file's [size, mtime_ns]."""
    files = {p.relative_to(folder).as_posix(): _file_stat(p)
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in (".complete", ".complete.tmp")}
    tmp = folder / ".complete.tmp"
    tmp.write_text(json.dumps({"checksum": checksum, "files": files}))
    os.replace(tmp, folder / ".complete")


def cached_folder_problem(folder: Path, manifest: dict) -> str | None:
    """None when the cached `folder` holds every file of `manifest` as recorded; else what is
    wrong. Sizes are always compared; a file is re-hashed only when its size or mtime differ from
    the seal's (a folder sealed by an older version has no stats: all files are hashed once, then
    it is sealed again)."""
    try:
        seal = json.loads((folder / ".complete").read_text())
    except (OSError, ValueError):
        seal = {}
    stats = seal.get("files") if isinstance(seal, dict) else None
    stats, rehashed = stats if isinstance(stats, dict) else {}, False
    for rel, entry in manifest["files"].items():
        path = folder / rel
        try:
            now = _file_stat(path)
        except FileNotFoundError:
            return f"{rel} is missing"
        if now[0] != entry["size"]:
            return f"{rel} has {now[0]} bytes, the manifest says {entry['size']}"
        if stats.get(rel) == now:
            continue
        if file_sha256(path) != entry["sha256"]:
            return f"{rel} does not match the manifest's sha256"
        rehashed = True
    if rehashed:
        _seal(folder, manifest["checksum"])  # verified as the files are now
    return None


def _discard(folder: Path) -> None:
    """Move a damaged cached folder out of the way (readers that have its files open keep them)."""
    trash = folder.parent / f".bad-{folder.name[:16]}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return  # another process discarded it first
    shutil.rmtree(trash, ignore_errors=True)


def folder_manifest(store: Store, key: str) -> dict:
    try:
        return store.read_json(f"{key}/{WEIGHTS_MANIFEST}")
    except FileNotFoundError:
        raise IncompleteError(f"{store.url(key)} is incomplete: no {WEIGHTS_MANIFEST}") from None


def load_folder(store: Store, key: str, cache_dir=None) -> Path:
    """A local folder with the files of `key/`, from the cache when already fetched (by folder
    checksum), else downloaded, verified and moved into the cache atomically. A fork's folder
    references its source's (storage.lineage): the files are read where its `base` says."""
    manifest = folder_manifest(store, key)
    src = folder_base(manifest, key)
    cache = Path(cache_dir or store.cache_dir) / "folders"
    target = cache / manifest["checksum"]
    if (target / ".complete").exists():
        problem = cached_folder_problem(target, manifest)
        if problem is None:
            return target
        print(f"weights cache: {target} is damaged ({problem}); downloading {store.url(key)} again",
              flush=True)
        _discard(target)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".tmp-{manifest['checksum'][:16]}-{uuid.uuid4().hex[:8]}"
    try:
        for rel, entry in manifest["files"].items():
            dest = tmp / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            store.get_file(f"{src}/{rel}", dest)
            if dest.stat().st_size != entry["size"] or file_sha256(dest) != entry["sha256"]:
                raise ChecksumError(f"checksum mismatch for {store.url(f'{src}/{rel}')}")
        _seal(tmp, manifest["checksum"])
        try:
            os.rename(tmp, target)
        except OSError:  # another process filled the cache first
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_weights(store: Store, layout: RunLayout, k: int, local_dir, extra=None, adopt_into=None,
                 hashes=None) -> dict:
    """Export an HF folder as weights/step_k (what step k+1 samples from)."""
    return save_folder(store, local_dir, layout.weights(k), extra=extra, adopt_into=adopt_into, hashes=hashes)


def load_weights(store: Store, layout: RunLayout, k: int, cache_dir=None) -> Path:
    """Local path of weights/step_k (cached by checksum)."""
    return load_folder(store, layout.weights(k), cache_dir)


def list_weights(store: Store, layout: RunLayout) -> list:
    """Steps k whose weights/step_k folder is complete."""
    steps = (parse_weights_step(n) for n in store.list(layout.weights_dir))
    return sorted(k for k in steps
                  if k is not None and store.exists(f"{layout.weights(k)}/{WEIGHTS_MANIFEST}"))
