"""A 15 s S3 outage in the middle of a training run's update, end to end: `stagerl train` (its
own local Prefect server, 2 ranks in the rank pool) with the store on moto's S3 server behind a
TCP proxy that resets every connection and refuses new ones for 15 s once step 1's advantage is
committed. The storage errors, on the ranks and in the training process alike, are retried
(botocore's own connection retries, then orchestration.storage_retries with delays doubling from
orchestration.retry_delay_s): the update commits only after the outage, and the run ends with the
weights of a run without the outage."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _s3_server import MotoServer
from _tcp_proxy import TcpProxy
from storage.artifacts import read_manifest
from storage.layout import RunLayout
from storage.store import Store
from storage.weights import folder_manifest
from test_flows import PROJECT, tiny_overrides, write_run_assets

REPO = Path(__file__).resolve().parent.parent
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
TWO_RANKS = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
             "orchestration.retry_delay_s=2.0", "orchestration.storage_retries=5"]  # the defaults


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return write_run_assets(tmp_path_factory.mktemp("assets"))


def train(env, root: str, assets, tmp_path, experiment: str):
    args = ["train", "--config", "tiny-cpu", "--experiment", experiment, *tiny_overrides(assets, tmp_path / "unused"),
            *TWO_RANKS, f"storage.root={root}", f"storage.cache_dir={tmp_path / experiment}-cache"]
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=tmp_path, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def watch_commit(store, layout, committed: list, run) -> None:
    """Append the time step 1's update manifest appears (read around the proxy)."""
    while run.poll() is None and read_manifest(store, layout, 1, "update") is None:
        time.sleep(0.1)
    if read_manifest(store, layout, 1, "update") is not None:
        committed.append(time.time())


def test_a_15s_s3_outage_during_the_update_is_survived(assets, tmp_path):
    with MotoServer() as s3, TcpProxy(s3.port) as proxy:
        s3.make_bucket("runs")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "STAGERL_"))}
        env.update(CREDS, AWS_ENDPOINT_URL=proxy.url, PYTHONUNBUFFERED="1",
                   PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
        store = Store.from_config({"root": "s3://runs/t", "endpoint_url": s3.endpoint_url,
                                   "key": "testing", "secret": "testing"})  # around the proxy
        reference = train(env, "s3://runs/t", assets, tmp_path, "reference")
        out, _ = reference.communicate(timeout=600)
        assert reference.returncode == 0, out[-4000:]
        run = train(env, "s3://runs/t", assets, tmp_path, "outage")
        layout = RunLayout(PROJECT, "outage")
        deadline = time.time() + 600
        while read_manifest(store, layout, 1, "advantage") is None:
            assert run.poll() is None and time.time() < deadline, "step 1's advantage did not commit"
            time.sleep(0.1)
        update_started = read_manifest(store, layout, 1, "update") is None
        proxy.cut(15.0)
        committed = []
        watcher = threading.Thread(target=watch_commit, args=(store, layout, committed, run), daemon=True)
        watcher.start()
        out, _ = run.communicate(timeout=600)
        watcher.join(timeout=30)
        print(out[-6000:])
        assert update_started  # the outage began while step 1's update ran
        assert run.returncode == 0, out[-4000:]
        (start, end), = proxy.cuts
        assert end - start >= 15.0
        # the outage was met: the update (2-3 s without it) committed only after the store came back.
        # Who retried (botocore's own connection retries or orchestration.storage_retries) varies.
        assert committed and committed[0] > end, (committed, proxy.cuts, out[-4000:])
        ref = folder_manifest(store, RunLayout(PROJECT, "reference").weights(2))["checksum"]
        assert folder_manifest(store, layout.weights(2))["checksum"] == ref
