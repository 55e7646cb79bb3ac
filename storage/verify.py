"""Check every committed object of a run against its manifest, and un-commit what is damaged.

A stage is complete when its manifest is written, and the manifest lists each file's size and
sha256; a weights or train-state folder is complete when its `_manifest.json` is, listing the same
per file. Nothing re-reads them after the commit, so a byte flipped later (a bad disk, a hand
edit, a partial copy) would go unnoticed until some reader trips on it. `verify_run` reads every
such object back (`stagerl verify`, and `stagerl resume` before it continues a run).

`repair` un-commits what is damaged so that `stagerl resume` computes it again: the stage's
manifest is deleted; for a damaged weights folder (weights/step_k, weights/critic_step_k) the
folder's manifest and step k's update manifest are deleted, since the update is the stage that
writes them. A damaged train state (train_state/step_k/<role>) only loses its manifest: no stage
needs it, an update without its engines restores an older stored state and replays the updates
after it (stages/training/state.py). A stage runs again only if its inputs are still kept (the
step before's weights; older ones are pruned per trainer.save_freq), which is why the newest
steps can always be repaired and older ones may need a backup.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from storage.artifacts import list_steps, read_manifest
from storage.layout import SETUP_STAGES, STAGES, WEIGHTS_MANIFEST, RunLayout
from storage.lineage import folder_base
from storage.store import Store

CHUNK = 8 << 20


@dataclass
class Damage:
    key: str  # the damaged object
    problem: str  # what is wrong with it
    step: int
    stage: str | None = None  # the stage whose file it is (None: a folder the update wrote)
    folder: str | None = None  # the folder it belongs to (weights, critic or train state)


@dataclass
class VerifyReport:
    damaged: list = field(default_factory=list)
    stages: int = 0  # stage manifests checked
    folders: int = 0  # folder manifests checked
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.damaged

    def summary(self) -> str:
        return (f"{self.stages} stages and {self.folders} folders checked: {self.files} files, "
                f"{self.bytes / 1e6:.1f} MB in {self.seconds:.1f} s; "
                + ("all match their manifests" if self.ok else f"{len(self.damaged)} damaged"))


def _check(store: Store, key: str, size: int, sha256: str) -> tuple[str | None, int]:
    """(problem or None, bytes read) of one object against its manifest entry, read in chunks
    (weights files can be larger than memory)."""
    digest, n = hashlib.sha256(), 0
    try:
        with store.open_read(key) as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                digest.update(chunk)
                n += len(chunk)
    except FileNotFoundError:
        return "missing", 0
    if n != size:
        return f"{n} bytes, the manifest says {size}", n
    if digest.hexdigest() != sha256:
        return "sha256 differs from the manifest (same size: changed in place)", n
    return None, n


def _folders(store: Store, layout: RunLayout) -> list[tuple[int, str]]:
    """(step, key) of every committed weights, critic and train-state folder of the run."""
    from storage.layout import parse_weights_step

    out = []
    for name in store.list(layout.weights_dir):
        step = parse_weights_step(name)
        if step is None and name.startswith("critic_step_") and name[12:].isdigit():
            step = int(name[12:])
        if step is not None:
            out.append((step, f"{layout.weights_dir}/{name}"))
    for name in store.list(layout.train_state):
        if name.startswith("step_") and name[5:].isdigit():
            for role in store.list(f"{layout.train_state}/{name}"):
                out.append((int(name[5:]), f"{layout.train_state}/{name}/{role}"))
    return [(k, key) for k, key in sorted(out) if store.exists(f"{key}/{WEIGHTS_MANIFEST}")]


def verify_run(store: Store, layout: RunLayout) -> VerifyReport:
    """Read back every file of every committed stage and folder of the run, against its manifest."""
    t0 = time.perf_counter()
    report = VerifyReport()

    def check(key, entry, **where):
        problem, n = _check(store, key, int(entry["size"]), entry["sha256"])
        report.files += 1
        report.bytes += n
        if problem:
            report.damaged.append(Damage(key=key, problem=problem, **where))

    for step in list_steps(store, layout):
        for stage in SETUP_STAGES + STAGES:
            manifest = read_manifest(store, layout, step, stage)
            if manifest is None:
                continue
            report.stages += 1
            for entry in manifest["files"].values():
                check(entry["path"], entry, step=step, stage=stage)
    for step, folder in _folders(store, layout):
        report.folders += 1
        manifest = store.read_json(f"{folder}/{WEIGHTS_MANIFEST}")
        base = folder_base(manifest, folder)  # a fork's folder: its source's files
        for rel, entry in manifest["files"].items():
            check(f"{base}/{rel}", entry, step=step, folder=folder)
    report.seconds = time.perf_counter() - t0
    return report


def repair(store: Store, layout: RunLayout, report: VerifyReport) -> list[str]:
    """Un-commit each damaged object's stage (and folder); returns what was un-committed."""
    undone = []
    for damage in report.damaged:
        if damage.folder is not None:
            store.delete(f"{damage.folder}/{WEIGHTS_MANIFEST}")
            undone.append(damage.folder)
            if damage.folder.startswith(f"{layout.train_state}/"):
                continue  # recomputed by replay when an update needs it, not by its own update
        stage = damage.stage or ("warmstart" if damage.step == 0 else "update")
        key = layout.manifest(damage.step, stage)
        if store.exists(key):
            store.delete(key)
            undone.append(f"step {damage.step} {stage}")
    return list(dict.fromkeys(undone))
