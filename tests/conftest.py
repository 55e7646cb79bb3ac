"""Shared test settings. Fixtures specific to one area live in that area's test module (or a
tests/_*.py helper module it imports), so each test file reads on its own."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# DeepSpeed's CPU comm op, pre-built by `make install` into the checkout (stages/deepspeed_ops.py).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(__import__("pathlib").Path(__file__).resolve().parent.parent
                                                  / ".cache" / "torch_extensions"))
