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


# The longest files, longest first (seconds each took in a CI rehearsal on the 2-core machine,
# 2026-12-05: test_readme ~490, test_flows ~490, test_staleness ~250, test_rank_pool ~185, ...).
# `make test` runs `-n 2 --dist loadfile --no-loadscope-reorder`: each worker takes the next file in
# collection order, so the long files start first and the short ones fill in at the end (xdist's
# own reorder, by number of tests, started the one-test README file last: a tail of ~8 minutes).
LONGEST_FIRST = ("test_readme.py", "test_flows.py", "test_staleness.py", "test_rank_pool.py", "test_logprob.py",
                 "test_fork.py", "test_prefect_disk_full.py", "test_shipped_configs.py", "test_policy_losses.py",
                 "test_readme_parts.py", "test_multiturn.py", "test_rollout_correction.py", "test_metric_sinks.py",
                 "test_engines_vllm.py", "test_scratch.py", "test_flow_retry.py", "test_cluster_parts.py",
                 "test_multiturn_resume.py", "test_update.py", "test_launch_deepspeed.py", "test_zygote.py",
                 "test_extend.py", "test_deepspeed_ops.py", "test_s3_outage.py", "test_inspect.py")


def pytest_collection_modifyitems(session, config, items):
    """The files in LONGEST_FIRST order, then the others (in their own order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))
