"""Fault injection for resume tests: an environment switch the stages honour.

    STAGERL_FAULT=update:after_rows          SIGKILL this process at that point of the update stage
    STAGERL_FAULT=rollout:before_write@2     ... only in step 2
    STAGERL_FAULT=reward:before_write:storage   raise a StoreError there, once per process
                                             (kinds: kill | storage | oom | value)

Several faults may be given, comma-separated. Points every stage has: `start` (flows/step.py,
just before stage.run) and `before_manifest` (the stage's files are written, its manifest is not,
so the stage stays incomplete). The commit path has no fault code: with STAGERL_FAULT set, the
training flow opens its store through `with_faults(store)`, which passes `before_manifest`
before writing a stage manifest. `maybe_fault(STAGE, "point", step)` injects at any other point
a test needs."""
from __future__ import annotations

import os
import re
import signal
import sys

ENV = "STAGERL_FAULT"
KINDS = ("kill", "storage", "oom", "value")
_fired: set = set()


class FaultSpecError(ValueError):
    """STAGERL_FAULT is not of the form stage:point[:kind][@step]."""


def parse(text: str) -> list[dict]:
    """'update:after_rows@2,reward:start:storage' -> [{stage, point, kind, step}, ...]."""
    faults = []
    for item in (t.strip() for t in (text or "").split(",")):
        if not item:
            continue
        body, _, step = item.partition("@")
        parts = body.split(":")
        if len(parts) not in (2, 3) or not all(parts):
            raise FaultSpecError(f"{ENV}={text!r}: {item!r} is not stage:point[:kind][@step]")
        kind = parts[2] if len(parts) == 3 else "kill"
        if kind not in KINDS:
            raise FaultSpecError(f"{ENV}={text!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
        if step and not step.isdigit():
            raise FaultSpecError(f"{ENV}={text!r}: step {step!r} is not an integer")
        faults.append({"stage": parts[0], "point": parts[1], "kind": kind,
                       "step": int(step) if step else None})
    return faults


def maybe_fault(stage: str, point: str, step: int | None = None) -> None:
    """Inject the fault STAGERL_FAULT names for (stage, point[, step]); otherwise do nothing."""
    text = os.environ.get(ENV)
    if not text:
        return
    for fault in parse(text):
        if fault["stage"] != stage or fault["point"] != point:
            continue
        if fault["step"] is not None and step is not None and fault["step"] != step:
            continue
        where = f"{stage}:{point}" + (f" (step {step})" if step is not None else "")
        if fault["kind"] == "kill":
            print(f"[stagerl fault] SIGKILL at {where}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        token = (stage, point, fault["kind"], step)
        if token in _fired:  # raise-type faults fire once per process, so a retry can succeed
            continue
        _fired.add(token)
        if fault["kind"] == "storage":
            from storage.store import StoreError
            raise StoreError(f"injected storage error at {where}")
        if fault["kind"] == "oom":
            raise MemoryError(f"injected out-of-memory at {where}")
        raise ValueError(f"injected bad input at {where}")


_MANIFEST_KEY = re.compile(r"/steps/(\d{6,})/_manifests/([a-z_]+)\.json$")


class FaultyStore:
    """A Store (every call delegated) that passes the `before_manifest` fault point before it
    writes a stage manifest (`.../steps/<step>/_manifests/<stage>.json`)."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    def write_json(self, key: str, obj, *args, **kwargs):
        match = _MANIFEST_KEY.search(key)
        if match:
            maybe_fault(match.group(2), "before_manifest", int(match.group(1)))
        return self._store.write_json(key, obj, *args, **kwargs)


def with_faults(store):
    """`store` itself, or a FaultyStore around it when STAGERL_FAULT is set."""
    return FaultyStore(store) if os.environ.get(ENV) else store
