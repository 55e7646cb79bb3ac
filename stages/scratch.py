"""Scratch folders under the system temp dir, named `stagerl-<kind>-<pid>-<host>-…` after the
process that made them, so that a later run on the same host removes what a killed process left
behind (its pid no longer alive). A folder of another host (a shared /tmp) or of a live process is
never touched."""
from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from storage.lock import process_alive

KINDS = ("pool", "update", "engines", "ranks")
_NAME = re.compile(r"^stagerl-(?P<kind>[a-z]+)-(?P<pid>\d+)-(?P<host>[A-Za-z0-9_]+)-")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


def scratch_prefix(kind: str, tag: str = "") -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown scratch kind {kind!r}: one of {KINDS}")
    return f"stagerl-{kind}-{os.getpid()}-{_host()}-{tag}"


def scratch_dir(kind: str, tag: str = "") -> Path:
    """A new folder of this process (see scratch_prefix); its owner removes it when done."""
    return Path(tempfile.mkdtemp(prefix=scratch_prefix(kind, tag)))


def remove_orphans(tmp_dir=None) -> list[Path]:
    """Remove this host's stagerl scratch folders whose process is gone (in `tmp_dir`, or in the
    temp dir and /dev/shm, where the update hands weights over); returns them."""
    bases = [Path(tmp_dir)] if tmp_dir else [Path(tempfile.gettempdir()), Path("/dev/shm")]
    host, removed, entries = _host(), [], []
    for base in bases:
        try:
            entries += list(base.iterdir())
        except OSError:
            continue
    for entry in entries:
        match = _NAME.match(entry.name)
        if (match is None or match["kind"] not in KINDS or match["host"] != host
                or process_alive(int(match["pid"])) or not entry.is_dir()):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed
