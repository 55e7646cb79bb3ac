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


# The longest files first (minutes each, here), the rest in collection order: with `-n 2 --dist
# loadfile --no-loadscope-reorder` (the Makefile) each worker takes the next file as it frees up, so
# no long file starts last and runs alone at the end of the suite (xdist's default reorder puts
# files with few tests, such as test_readme.py's one, last).
LONG_FIRST = ("test_readme.py", "test_flows.py", "test_fork.py", "test_fork_deployment.py", "test_extend.py",
              "test_rank_pool.py", "test_prefect_disk_full.py", "test_s3_outage.py", "test_engines_vllm.py",
              "test_zygote.py", "test_launch_deepspeed.py")


def pytest_collection_modifyitems(session, config, items):
    """tests/test_readme.py (the whole README in order: a 3-step demo, the tour's runs, forks and
    its Prefect deployment in subprocesses, the longest file) first, then the other long files."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))
