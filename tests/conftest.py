"""Shared test settings. Fixtures specific to one area live in that area's test module (or a
tests/_*.py helper module it imports), so each test file reads on its own."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# DeepSpeed's CPU comm op, pre-built by `make install` into the checkout (stages/ranks/deepspeed_ops.py).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(__import__("pathlib").Path(__file__).resolve().parent.parent
                                                  / ".cache" / "torch_extensions"))


def pytest_collection_modifyitems(session, config, items):
    """tests/test_readme.py (the whole README in order: a 3-step demo, the tour's runs, forks and
    its Prefect deployment in subprocesses, the longest file) first, so that with `-n 2 --dist
    loadfile` it runs beside other files instead of alone at the end of the suite."""
    items.sort(key=lambda item: 0 if item.path.name == "test_readme.py" else 1)
