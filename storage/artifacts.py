"""Atomic stage artifacts: files go to temporary keys, are moved into place, and the manifest is
written last. Readers trust only what a manifest lists, and verify each file's sha256.

    write_stage(store, layout, step, "rollout", {"rollout.parquet": table}, fingerprint=fp)
    table = read_table(store, layout, step, "rollout")
"""
import functools
import hashlib
import json
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

from storage import schemas
from storage.layout import (STAGE_FILES, STAGES, RunLayout, check_stage, parse_step, temp_key)
from storage.lineage import release
from storage.secrets import scrub, scrub_override
from storage.store import Store

MANIFEST_VERSION = 1


class IncompleteError(RuntimeError):
    """A stage has no manifest (never written, or its writer died before committing)."""


class ChecksumError(RuntimeError):
    """An object's bytes do not match the checksum its manifest lists."""


def fingerprint(obj) -> str:
    """sha256 of the canonical JSON of `obj` (sorted keys, no whitespace)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """Package version and, when the code is a git checkout, its commit sha."""
    try:
        from importlib.metadata import version
        pkg = version("stagerl")
    except Exception:
        pkg = "unknown"
    sha = None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        sha = out.stdout.strip() or None if out.returncode == 0 else None
    except Exception:
        pass
    return {"package": pkg, "git_sha": sha}


# ---- writing ------------------------------------------------------------------------------
def _encode(name: str, content):
    """(bytes, row_count) of one stage file: a pyarrow table, a JSON-able object, or bytes."""
    if isinstance(content, (bytes, bytearray)):
        return bytes(content), None
    if hasattr(content, "schema") and hasattr(content, "num_rows"):
        if name in schemas.FILE_SCHEMAS:
            schemas.validate(schemas.FILE_SCHEMAS[name], content, where=name)
        return Store.parquet_bytes(content), content.num_rows
    return json.dumps(content, indent=2, sort_keys=True, default=str).encode(), None


def upload_files(store: Store, layout: RunLayout, step: int, stage: str, files: dict) -> dict:
    """Phase 1 of a commit: invalidate the old manifest, write each file to a temporary key, then
    move it into place. Returns the file entries for the manifest. Without the manifest (phase
    2) the stage stays incomplete."""
    check_stage(stage)
    missing = [n for n in STAGE_FILES[stage] if n not in files]
    if missing:
        raise ValueError(f"stage {stage!r} must write {', '.join(missing)}")
    # a fork that references files about to be rewritten gets its own copy first (storage.lineage)
    release(store, [layout.stage_file(step, name) for name in files])
    store.delete(layout.manifest(step, stage))
    token = uuid.uuid4().hex[:12]
    entries = {}
    for name, content in files.items():
        t0 = time.perf_counter()
        data, rows = _encode(name, content)
        key = layout.stage_file(step, name)
        tmp = temp_key(key, token)
        store.write_bytes(tmp, data)
        store.move(tmp, key)
        entries[name] = {"path": key, "size": len(data), "sha256": sha256_bytes(data),
                         "rows": rows, "write_s": round(time.perf_counter() - t0, 4)}
        if rows is not None:
            store.remember_table(key, entries[name]["sha256"], content)
    return entries


def write_manifest(store: Store, layout: RunLayout, step: int, stage: str, entries: dict, *,
                   fingerprint: str, inputs=None, timings=None, extra=None, row_count=None) -> dict:
    """Phase 2 of a commit: write the manifest (secrets removed). The stage is now complete."""
    rows = [row_count] if row_count is not None else [e["rows"] for e in entries.values()
                                                      if e.get("rows") is not None]
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "project": layout.project, "experiment": layout.experiment,
        "step": step, "stage": stage,
        "fingerprint": fingerprint,
        "inputs": inputs or {},
        "row_count": rows[0] if rows else None,
        "files": entries,
        "bytes": sum(e["size"] for e in entries.values()),
        "timings": dict(timings or {}),
        "code_version": code_version(),
        "written_at": time.time(),
        "host": socket.gethostname(), "pid": os.getpid(),
        "extra": extra or {},
    }
    manifest = scrub(manifest, store.secret_values)
    store.write_json(layout.manifest(step, stage), manifest)
    return manifest


def write_stage(store: Store, layout: RunLayout, step: int, stage: str, files: dict, *,
                fingerprint: str, inputs=None, timings=None, extra=None, row_count=None) -> dict:
    """Write a stage's files atomically and commit them with a manifest; returns the manifest.

    `files` maps names in the step folder (see layout.STAGE_FILES) to a pyarrow table (validated
    against its schema, written as zstd parquet), a JSON-able object, or bytes. `inputs` maps
    input names to their fingerprints. The manifest's row_count is the first table's rows, or
    `row_count` when given (the update: the rows it trained on, not its micro-batch table's)."""
    t0 = time.perf_counter()
    entries = upload_files(store, layout, step, stage, files)
    timings = dict(timings or {})
    timings.setdefault("storage_write_s", round(time.perf_counter() - t0, 4))
    return write_manifest(store, layout, step, stage, entries, fingerprint=fingerprint,
                          inputs=inputs, timings=timings, extra=extra, row_count=row_count)


def write_table(store, layout, step, stage, table, **kw) -> dict:
    """write_stage for a one-table stage (rollout, logprob, reward, advantage)."""
    return write_stage(store, layout, step, stage, {STAGE_FILES[stage][0]: table}, **kw)


# ---- reading ------------------------------------------------------------------------------
def read_manifest(store: Store, layout: RunLayout, step: int, stage: str):
    """The stage's manifest, or None when the stage is incomplete."""
    key = layout.manifest(step, stage)
    try:
        return store.read_json(key)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None  # a torn local write is impossible (atomic rename); be safe anyway


def require_manifest(store, layout, step, stage) -> dict:
    m = read_manifest(store, layout, step, stage)
    if m is None:
        raise IncompleteError(f"step {step} stage {stage!r} of {layout.base} is incomplete: "
                              f"no manifest at {store.url(layout.manifest(step, stage))}")
    return m


def read_file(store: Store, layout: RunLayout, step: int, stage: str, name: str = None, manifest: dict = None):
    """Read one file a manifest lists, verifying its checksum. Tables come back as pyarrow
    (validated against their schema), .json as objects, anything else as bytes. `manifest`: the
    stage's manifest when the caller has just read it (else it is read here)."""
    manifest = manifest or require_manifest(store, layout, step, stage)
    name = name or STAGE_FILES[stage][-1 if stage == "update" else 0]
    entry = manifest["files"].get(name)
    if entry is None:
        raise KeyError(f"manifest of step {step} stage {stage!r} lists no file {name!r}")
    kept = store.recent_table(entry["path"], entry["sha256"])
    if kept is not None:  # committed by this process with exactly these bytes (Store.remember_table)
        return kept
    data = store.read_bytes(entry["path"])
    if len(data) != entry["size"] or sha256_bytes(data) != entry["sha256"]:
        raise ChecksumError(f"checksum mismatch for {store.url(entry['path'])}: the object "
                            f"differs from its manifest ({len(data)} bytes, expected "
                            f"{entry['size']}); it is corrupt or was rewritten")
    if name.endswith(".parquet"):
        table = Store.parquet_table(data)
        if name in schemas.FILE_SCHEMAS:
            schemas.validate(schemas.FILE_SCHEMAS[name], table, where=store.url(entry["path"]))
        return table
    if name.endswith(".json"):
        return json.loads(data)
    return data


def read_table(store, layout, step, stage, manifest: dict = None):
    """The verified main table of a stage (update: its microbatches table)."""
    return read_file(store, layout, step, stage, manifest=manifest)


# ---- status -------------------------------------------------------------------------------
def is_complete(store, layout, step, stage, fingerprint: str = None) -> bool:
    """True when the stage has a manifest (with this fingerprint, if given)."""
    m = read_manifest(store, layout, step, stage)
    return m is not None and (fingerprint is None or m.get("fingerprint") == fingerprint)


def list_steps(store: Store, layout: RunLayout) -> list:
    """Step numbers that have a folder in the store."""
    return sorted(s for s in (parse_step(n) for n in store.list(layout.steps_dir))
                  if s is not None)


def last_committed(store: Store, layout: RunLayout, stage: str) -> int:
    """The newest step whose `stage` is committed (0: none): the step folders listed once, then
    manifests read from the newest down (one or two reads for a run stopped at its end)."""
    for step in reversed(list_steps(store, layout)):
        if read_manifest(store, layout, step, stage) is not None:
            return step
    return 0


def step_status(store: Store, layout: RunLayout, step: int) -> dict:
    """{stage: complete?} for one step, in pipeline order."""
    names = set(store.list(layout.manifests_dir(step)))
    return {stage: f"{stage}.json" in names for stage in STAGES}


def run_status(store: Store, layout: RunLayout) -> dict:
    """{step: {stage: complete?}} for every step folder of the run."""
    return {step: step_status(store, layout, step) for step in list_steps(store, layout)}


# ---- run.json -----------------------------------------------------------------------------
def write_run_json(store: Store, layout: RunLayout, config: dict, extra=None) -> dict:
    """Write run.json: the resolved config with secrets removed, its fingerprint, code version."""
    clean = scrub(config, store.secret_values)
    extra = dict(extra or {})
    if isinstance(extra.get("source"), dict) and extra["source"].get("overrides"):
        extra["source"] = {**extra["source"], "overrides": [
            scrub_override(o, store.secret_values) for o in extra["source"]["overrides"]]}
    doc = {"project": layout.project, "experiment": layout.experiment, "config": clean,
           "fingerprint": fingerprint(clean), "code_version": code_version(),
           "written_at": time.time(), **scrub(extra, store.secret_values)}
    store.write_json(layout.run_json, doc)
    return doc


def read_run_json(store: Store, layout: RunLayout):
    try:
        return store.read_json(layout.run_json)
    except FileNotFoundError:
        return None
