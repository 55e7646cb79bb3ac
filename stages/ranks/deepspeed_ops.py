"""Pre-build DeepSpeed's CPU shared-memory comm op once (JIT compile takes 45 s - 3 min).

`make install` runs `python -m stages.ranks.deepspeed_ops` with TORCH_EXTENSIONS_DIR pointing at a cache
folder inside the checkout, so every later DeepSpeed launch on CPU ranks loads the built .so.
"""
import os
import sys
import time
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".cache" / "torch_extensions"


def extensions_dir() -> str:
    """The folder DeepSpeed builds its ops into; set in the environment for child processes."""
    path = os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_DIR))
    return path


def same_ninja() -> None:
    """Build and load DeepSpeed's ops with this Python environment's own ninja (pip's, beside the
    interpreter) whatever PATH says. Two ninja versions over one build folder (the system's 1.11
    and pip's 1.13 hash command lines differently) each see the other's build as changed and
    rebuild the op (80 s on 2 cores): measured in CI, where a process with the venv's bin on PATH
    alternated with processes without it."""
    bindir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bindir, "ninja")):
        parts = os.environ.get("PATH", "").split(os.pathsep)
        if parts[:1] != [bindir]:
            os.environ["PATH"] = os.pathsep.join([bindir] + [p for p in parts if p != bindir])


def op_build_env() -> None:
    """Before DeepSpeed may load (or build) an op, at run time: `make install`'s prebuilt folder
    when it exists and TORCH_EXTENSIONS_DIR is not set (else a first multi-rank run would build the
    op again into ~/.cache/torch_extensions: 45 s - 3 min), the environment's own ninja, and no
    build lock left behind by an interrupted build (clear_stale_build_locks)."""
    if DEFAULT_DIR.is_dir():
        extensions_dir()
    same_ninja()
    clear_stale_build_locks()


def _building(folder: Path) -> bool:
    """A live process works in the op's build folder (torch runs ninja there while it builds)."""
    target = os.path.realpath(folder)
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.path.realpath(os.readlink(proc / "cwd")) == target:
                return True
        except OSError:
            continue
    return False


def clear_stale_build_locks(grace_s: float = 5.0) -> list:
    """torch's JIT build takes `<op>/lock` (a FileBaton: no holder recorded) and every later load
    waits for it to go: a lock left by an interrupted build made every later update wait forever,
    with fresh rank heartbeats. A lock is stale when no live process works in its build folder and
    it is `grace_s` old (a build's first moments, before ninja starts, are covered); stale locks are
    removed, naming them; a live build is waited for. Returns the locks removed."""
    base = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or DEFAULT_DIR)
    removed = []
    for lock in base.glob("*/lock"):
        while lock.exists():
            if _building(lock.parent):
                time.sleep(1.0)
                continue
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                break
            if age < grace_s:
                time.sleep(grace_s - age)
                continue
            lock.unlink(missing_ok=True)
            removed.append(lock)
            print(f"removed the stale DeepSpeed op build lock {lock} (no build runs in {lock.parent}; "
                  f"left by an interrupted build)", file=sys.stderr, flush=True)
    return removed


def prebuild() -> str:
    """`make install`'s build (or load) of the op; a lock an interrupted build left is cleared
    first, as at run time (it made this wait forever: a killed `make install`, then another)."""
    extensions_dir()
    same_ninja()
    clear_stale_build_locks()
    from deepspeed.accelerator import get_accelerator

    module = get_accelerator().create_op_builder("ShareMemCommBuilder").load()
    return module.__file__


if __name__ == "__main__":
    path = prebuild()
    print(f"DeepSpeed CPU comm op ready: {path}", file=sys.stderr)
