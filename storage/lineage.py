"""Forks reference their source's objects instead of copying them (flows/fork.py makes forks).

- A fork's **stage manifest** is its source's manifest with the fork's own fingerprint and
  inputs: its file entries keep the source's keys, sizes and sha256, so every reader
  (storage.artifacts.read_file, storage.verify) reads and checks the source's objects as always.
- A fork's **weights or train-state folder** is a `_manifest.json` alone, whose `base` names the
  folder that holds the files (storage.weights.load_folder and storage.verify read them there).
- The run whose folder holds the objects (their **owner**: the first two segments of the keys)
  keeps one record per fork, `forks/{fork}.json`, mapping each object (or folder) it references
  to the fork's manifest that references it.

**Copy on demand.** Before an owner deletes or rewrites objects (weights and train states
pruned, a stage or folder written again, `stagerl delete --detach-forks`), `release(store, keys)`
copies every referenced object under those keys into the forks that reference them and points
their manifests at the copies (checksums unchanged). Deleting or pruning a source therefore
never breaks a fork; `delete_tree` is the deletion that does this first.
"""
from __future__ import annotations

import time
import uuid

from storage.layout import WEIGHTS_MANIFEST, RunLayout, owner_base

__all__ = ["reference_stage", "reference_folder", "folder_base", "record_fork", "fork_records",
           "release", "delete_tree", "forget_fork"]


def folder_base(manifest: dict, key: str) -> str:
    """Where the files of the folder at `key` are: its own key, or the `base` it references."""
    return str(manifest.get("base") or key).strip("/")


# ---- making references ----------------------------------------------------------------------
def reference_stage(store, src_manifest: dict, layout: RunLayout, step: int, stage: str, *,
                    fingerprint: str, inputs: dict, source: str) -> dict:
    """Commit `stage` of `step` in the run `layout` as a reference to `src_manifest`'s files
    (run `source`); returns {object key: the new manifest's key}."""
    doc = dict(src_manifest)
    doc.update(project=layout.project, experiment=layout.experiment, fingerprint=fingerprint,
               inputs=dict(inputs),
               forked_from={"experiment": source, "fingerprint": src_manifest.get("fingerprint"),
                            "written_at": src_manifest.get("written_at")})
    key = layout.manifest(step, stage)
    store.write_json(key, doc)
    return {entry["path"]: key for entry in (doc.get("files") or {}).values()}


def reference_folder(store, src_key: str, dst_key: str) -> dict:
    """Commit the folder `dst_key` as a reference to the committed folder `src_key` (or to what
    that one references); {} when `src_key` is not a committed folder."""
    try:
        manifest = store.read_json(f"{src_key}/{WEIGHTS_MANIFEST}")
    except FileNotFoundError:
        return {}
    base = folder_base(manifest, src_key)
    key = f"{dst_key}/{WEIGHTS_MANIFEST}"
    store.write_json(key, {**manifest, "base": base, "forked_from": src_key})
    return {base: key}


def record_fork(store, owner: str, fork: RunLayout, objects: dict, lineage: dict) -> None:
    """Write (or extend) the owner's record of `fork`: the objects it references there."""
    project, experiment = owner.split("/")
    key = RunLayout(project, experiment).fork_record(fork.experiment)
    try:
        old = store.read_json(key).get("objects") or {}
    except FileNotFoundError:
        old = {}
    store.write_json(key, {"project": fork.project, "experiment": fork.experiment,
                           "lineage": lineage, "written_at": time.time(),
                           "objects": {**old, **objects}})


def fork_records(store, layout: RunLayout) -> list[dict]:
    """The records of the forks that reference objects of `layout`'s run."""
    out = []
    for name in store.list(layout.forks_dir):
        if name.endswith(".json"):
            try:
                out.append({**store.read_json(f"{layout.forks_dir}/{name}"),
                            "key": f"{layout.forks_dir}/{name}"})
            except FileNotFoundError:
                continue
    return out


def forget_fork(store, fork: RunLayout, owners) -> None:
    """Remove the records of `fork` at its owners (the fork itself is being deleted)."""
    for owner in owners:
        project, experiment = owner.split("/")
        store.delete(RunLayout(project, experiment).fork_record(fork.experiment))


# ---- copy on demand -------------------------------------------------------------------------
def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + "/") for p in prefixes)


def release(store, keys) -> list[str]:
    """Before the objects under `keys` are deleted or rewritten: copy each one a fork references
    into that fork and point its manifest at the copy. Returns what was copied ('src -> dst')."""
    prefixes = sorted({str(k).strip("/") for k in keys if str(k).strip("/").count("/") >= 1})
    copied = []
    for owner in sorted({owner_base(p) for p in prefixes}):
        project, experiment = owner.split("/")
        mine = [p for p in prefixes if owner_base(p) == owner]
        for record in fork_records(store, RunLayout(project, experiment)):
            objects = record.get("objects") or {}
            hit = {o for o in objects if _under(o, mine)}
            if not hit:
                continue
            for manifest_key in sorted({objects[o] for o in hit}):
                copied += _materialize(store, manifest_key, hit)
            rest = {o: m for o, m in objects.items() if o not in hit}
            body = {k: v for k, v in record.items() if k != "key"}
            if rest:
                store.write_json(record["key"], {**body, "objects": rest})
            else:
                store.delete(record["key"])
    return copied


def delete_tree(store, key: str) -> list[str]:
    """Delete everything under `key` after copying what forks reference there into them. A
    folder's manifest goes first: a deletion cut short (the run killed while it prunes) leaves
    an uncommitted folder, which nothing reads, not a committed one with files missing, which
    `stagerl verify` reports as damaged and a resume then refuses to start from."""
    copied = release(store, [key])
    store.delete(f"{key}/{WEIGHTS_MANIFEST}")
    store.delete(key, recursive=True)
    return copied


def _copy(store, src: str, dst: str) -> None:
    """Copy one object through a temporary key, so `dst` appears whole or not at all."""
    tmp = f"{dst}.tmp-{uuid.uuid4().hex[:12]}"
    store.copy(src, tmp)
    store.move(tmp, dst)


def _materialize(store, manifest_key: str, objects: set) -> list[str]:
    """Copy the objects of `objects` that the manifest at `manifest_key` references into its own
    run, then rewrite the manifest to point at them (nothing when it no longer references them)."""
    try:
        doc = store.read_json(manifest_key)
    except FileNotFoundError:
        return []
    copied = []
    if manifest_key.endswith("/" + WEIGHTS_MANIFEST):
        base = doc.get("base")
        if base not in objects:
            return []
        folder = manifest_key[:-len(WEIGHTS_MANIFEST) - 1]
        for rel in doc.get("files") or {}:
            _copy(store, f"{base}/{rel}", f"{folder}/{rel}")
        doc.pop("base")
        doc["copied_from"] = base
        copied.append(f"{base} -> {folder}")
    else:
        project, experiment = owner_base(manifest_key).split("/")
        layout = RunLayout(project, experiment)
        for name, entry in (doc.get("files") or {}).items():
            if entry.get("path") in objects:
                dst = layout.stage_file(int(doc["step"]), name)
                _copy(store, entry["path"], dst)
                copied.append(f"{entry['path']} -> {dst}")
                entry["copied_from"], entry["path"] = entry["path"], dst
    if copied:
        store.write_json(manifest_key, doc)
    return copied
