"""Pre-build DeepSpeed's CPU shared-memory comm op once (JIT compile takes 45 s - 3 min).

`make install` runs `python -m stages.deepspeed_ops` with TORCH_EXTENSIONS_DIR pointing at a cache
folder inside the checkout, so every later DeepSpeed launch on CPU ranks loads the built .so.
"""
import os
import sys
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parent.parent / ".cache" / "torch_extensions"


def extensions_dir() -> str:
    """The folder DeepSpeed builds its ops into; set in the environment for child processes."""
    path = os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_DIR))
    return path


def prebuild() -> str:
    extensions_dir()
    from deepspeed.accelerator import get_accelerator

    module = get_accelerator().create_op_builder("ShareMemCommBuilder").load()
    return module.__file__


if __name__ == "__main__":
    path = prebuild()
    print(f"DeepSpeed CPU comm op ready: {path}", file=sys.stderr)
