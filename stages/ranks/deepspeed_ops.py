"""Pre-build DeepSpeed's CPU shared-memory comm op once (JIT compile takes 45 s - 3 min).

`make install` runs `python -m stages.ranks.deepspeed_ops` with TORCH_EXTENSIONS_DIR pointing at a cache
folder inside the checkout, so every later DeepSpeed launch on CPU ranks loads the built .so.
"""
import os
import sys
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
    op again into ~/.cache/torch_extensions: 45 s - 3 min), and the environment's own ninja."""
    if DEFAULT_DIR.is_dir():
        extensions_dir()
    same_ninja()


def prebuild() -> str:
    extensions_dir()
    same_ninja()
    from deepspeed.accelerator import get_accelerator

    module = get_accelerator().create_op_builder("ShareMemCommBuilder").load()
    return module.__file__


if __name__ == "__main__":
    path = prebuild()
    print(f"DeepSpeed CPU comm op ready: {path}", file=sys.stderr)
