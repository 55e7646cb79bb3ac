"""The Prefect flows end to end with real parts: `prefect server start` (SQLite), process work
pools and workers, `prefect deploy` from this checkout, `prefect deployment run` at the CPU
default's shape (720 rows, 2 ranks) with the store on a moto S3 endpoint, and the real stages in
`stagerl train`/`stagerl resume` subprocesses killed with SIGKILL inside each stage (STAGERL_FAULT)
and resumed (tiny overrides, 1 rank). Multi-pool mode and the retry policy use the small stage
modules in tests/_toy_stages (STAGERL_STAGES): they test orchestration, not the stages."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from _prefect_server import PrefectServer
from _s3_server import MotoServer
from _sink_logs import tensorboard_scalars, wandb_run
from flows.train import changed_keys, check_run_json, prune_weights, weights_to_delete, RunConfigChanged
from flows.step import SIDE_BY_SIDE, is_retryable
from storage.sinks import log_line
from storage.faults import FaultSpecError, parse
from storage.artifacts import read_file, read_manifest, read_table
from storage.layout import STAGES, RunLayout
from storage.store import Store, StoreError
from storage.weights import folder_manifest, list_weights, load_weights, save_folder

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
PROJECT = "stagerl"
DEFAULT_ROWS = 720  # the CPU default (configs/tiny-cpu.yaml): 60 prompts x n=12


# ---- pure parts ----------------------------------------------------------------------------
def test_weights_kept_per_save_freq_and_max_to_keep():
    assert weights_to_delete([1, 2, 3], 3, -1, None) == [1, 2]  # only the latest
    assert weights_to_delete([1, 2, 3, 4, 5, 6], 6, 2, None) == [1, 3, 5]
    assert weights_to_delete([2, 4, 6, 7], 7, 2, 2) == [2, 4]  # newest two: 6 and the latest 7
    assert weights_to_delete([4], 4, -1, 1) == []
    assert weights_to_delete([0, 1, 2], 2, -1, 1) == [1]  # the warm start (reference) stays
    assert weights_to_delete([1, 2], 3, -1, None) == [1]  # step 3 still committing: 2 is kept


def test_weights_of_a_step_still_committing_are_not_counted(tmp_path):
    """prune_weights after step 2 while its update still commits in the background (weights/
    step_000002 complete, the update manifest not yet): step 1's weights stay, since a kill now
    reruns step 2 from them; once the manifest is there, step 1's go."""
    store, layout = Store.from_config({"root": str(tmp_path / "runs")}), RunLayout(PROJECT, "p")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.bin").write_bytes(b"weights")
    for k in (1, 2):
        save_folder(store, tmp_path / "w", layout.weights(k))
    cfg = {"trainer": {"save_freq": -1, "max_actor_ckpt_to_keep": None}}
    assert prune_weights(store, layout, 2, cfg) == [] and list_weights(store, layout) == [1, 2]
    store.write_json(layout.manifest(2, "update"), {"stage": "update"})
    assert prune_weights(store, layout, 2, cfg) == [1] and list_weights(store, layout) == [2]


def test_the_step_loop_prunes_in_the_background(tmp_path):
    """The step loop's prune runs in the session's background thread (prune_in_background), one
    after the other in the same thread (started once: not a thread per step), which the session's
    close ends: the old folder is gone once the prune has run, and a prune that fails there is
    reported and done by the next one instead of failing the run."""
    import threading

    from flows.train import PRUNE, prune_in_background
    from stages.session import RunSession

    store, layout = Store.from_config({"root": str(tmp_path / "runs")}), RunLayout(PROJECT, "p")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.bin").write_bytes(b"weights")
    for k in (1, 2, 3):
        save_folder(store, tmp_path / "w", layout.weights(k))
        store.write_json(layout.manifest(k, "update"), {"stage": "update"})
    cfg = {"trainer": {"save_freq": -1, "max_actor_ckpt_to_keep": None}}
    threads, listing = [], store.list

    def failing_once(key):  # the first prune's listing fails, as a storage outage would
        threads.append(threading.current_thread())
        if len(threads) == 1:
            raise OSError("store unavailable")
        return listing(key)
    store.list = failing_once
    with RunSession() as session:
        prune_in_background(session, store, layout, 2, cfg)
        session.join_background(PRUNE)
        assert list_weights(store, layout) == [1, 2, 3]  # failed: nothing removed, the run goes on
        prune_in_background(session, store, layout, 3, cfg)
        session.join_background(PRUNE)
        assert list_weights(store, layout) == [3]
    assert threads[0].name == f"background-{PRUNE}" and threads[0] in threads[2:]  # MainThread: the asserts'
    assert not threads[0].is_alive()  # the session's close ended it


def test_work_held_for_the_next_compute_starts_there_or_when_it_is_waited_for(tmp_path):
    """RunSession.defer(..., at_compute=True) and start_background(..., at_compute=True) start
    nothing until a stage calls compute_starts() (which also calls the on_compute functions, in
    the stage's thread), or until the work is waited for: a held commit by wait_commit /
    wait_commits (a reader of the update's weights, the run's end), held background work by
    join_background; held work of one name runs in the order it was given."""
    import threading

    from stages.session import RunSession

    ran, calls = [], []
    with RunSession() as session:
        session.on_compute("probe", lambda: calls.append(threading.current_thread().name))
        session.defer("update", 1, "fp1", lambda: ran.append("commit 1"), at_compute=True)
        session.start_background("prune", lambda: ran.append("prune a"), at_compute=True)
        session.start_background("prune", lambda: ran.append("prune b"), at_compute=True)
        threading.Event().wait(0.2)
        assert ran == [] and calls == [] and session.pending_fingerprint(1, "update") == "fp1"
        session.compute_starts()
        session.wait_commit("update", 1)
        session.join_background("prune")
        assert sorted(ran) == ["commit 1", "prune a", "prune b"] and ran.index("prune a") < ran.index("prune b")
        assert calls == ["MainThread"] and session.pending_fingerprint(1, "update") is None

        session.defer("update", 2, "fp2", lambda: ran.append("commit 2"), at_compute=True)
        session.start_background("prune", lambda: ran.append("prune c"), at_compute=True)
        session.wait_commit("update", 2)  # no compute started: waiting for it starts it
        session.join_background("prune")
        assert ran[-2:] == ["commit 2", "prune c"] and calls == ["MainThread"]

        session.defer("update", 3, "fp3", lambda: ran.append("commit 3"), at_compute=True)
        session.on_compute("probe", None)
        session.compute_starts()
        session.wait_commits()
        assert ran[-1] == "commit 3" and calls == ["MainThread"]  # removed: not called again
        session.defer("update", 4, "fp4", lambda: ran.append("commit 4"), at_compute=True)
    assert ran[-1] == "commit 4"  # the session's close waits for held commits too


def test_a_prune_cut_short_leaves_no_committed_folder_with_files_missing(tmp_path, monkeypatch):
    """A run killed while it prunes old weights (the folder half deleted: here the store's backend
    stops after removing the weights file, as a SIGKILL would) leaves that folder uncommitted, not
    damaged: `verify_run` is ok, so `stagerl resume` starts (a clean-clone CI run once failed on it:
    a kill in step 3's background commit landed inside the flow's rmtree of step 1's folder)."""
    from storage.verify import verify_run

    store, layout = Store.from_config({"root": str(tmp_path / "runs")}), RunLayout(PROJECT, "p")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.bin").write_bytes(b"weights")
    for k in (1, 2):
        save_folder(store, tmp_path / "w", layout.weights(k))
    store.write_json(layout.manifest(2, "update"), {"stage": "update", "files": {}})

    def killed(path):  # the data file goes, then the process is gone
        os.remove(os.path.join(path, "model.bin"))
        raise KeyboardInterrupt("killed while deleting")
    monkeypatch.setattr(store.backend, "delete_tree", killed)
    with pytest.raises(KeyboardInterrupt):
        prune_weights(store, layout, 2, {"trainer": {"save_freq": -1, "max_actor_ckpt_to_keep": None}})
    assert list_weights(store, layout) == [2]  # step 1's folder is no longer committed
    report = verify_run(store, layout)
    assert report.ok and report.folders == 1, report.damaged


def test_start_up_without_collections_and_the_steps_with_them():
    """`stagerl train` starts with Python's automatic collections off (flows.cli.train); after the
    first step freeze_heap collects what the start-up left (a reference cycle made meanwhile is
    gone), freezes what is alive and turns them on."""
    import gc
    import weakref

    from flows.train import freeze_heap

    class Node:
        pass

    gc.disable()
    try:
        cycle = Node()
        cycle.self = cycle
        alive = weakref.ref(cycle)
        del cycle
        assert alive() is not None  # no automatic collection while off
        freeze_heap()
        assert alive() is None and gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()


def test_retry_policy_retries_storage_errors_only():
    assert is_retryable(StoreError("write s3://b/k failed"))
    assert is_retryable(ConnectionError("reset")) and is_retryable(TimeoutError())
    assert is_retryable(OSError(5, "I/O error"))
    for exc in (MemoryError(), ValueError("bad row 3"), FileNotFoundError("x.parquet"),
                KeyError("col"), RuntimeError("rank 1 failed")):
        assert not is_retryable(exc), exc


def test_fault_spec_and_log_line():
    assert parse("update:after_rows@2, reward:start:storage") == [
        {"stage": "update", "point": "after_rows", "kind": "kill", "step": 2},
        {"stage": "reward", "point": "start", "kind": "storage", "step": None}]
    with pytest.raises(FaultSpecError, match="stage:point"):
        parse("update")
    assert log_line(3, {"actor/pg_loss": 0.25, "actor/lr": 1e-4, "n": 2}) == \
        "step:3 - actor/pg_loss:0.250 - actor/lr:1.000e-04 - n:2"


def test_run_json_refuses_changed_keys_that_alter_finished_work(tmp_path):
    store = Store.from_config({"root": str(tmp_path)})
    layout = RunLayout("p", "e")
    cfg = {"data": {"train_batch_size": 4}, "trainer": {"logger": ["console"]}}
    check_run_json(store, layout, cfg, {"rows": 8}, {})
    store.write_json(layout.manifest(1, "rollout"), {"fingerprint": "x"})  # finished work
    check_run_json(store, layout, {**cfg, "trainer": {"logger": ["console", "tensorboard"]}},
                   {"rows": 8}, {})  # logging may change
    with pytest.raises(RunConfigChanged, match=r"data.train_batch_size: 4 -> 8"):
        check_run_json(store, layout, {**cfg, "data": {"train_batch_size": 8}}, {"rows": 16}, {})
    assert changed_keys({"a": {"b": 1}, "storage": {"root": "x"}},
                        {"a": {"b": 2}, "storage": {"root": "y"}}) == ["a.b"]


def test_cli_refuses_a_bad_plan_and_an_unknown_experiment(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, text=True,
                              capture_output=True, timeout=120)

    bad = cli("train", "--config", "tiny-cpu", "data.train_batch_size=7", f"storage.root={tmp_path}")
    assert bad.returncode == 2 and "must be >= actor.ppo_mini_batch_size (15)" in bad.stdout
    assert "data.train_batch_size=15" in bad.stdout  # a value that works is suggested
    assert not (tmp_path / "stagerl").exists()  # refused before anything was written
    (tmp_path / "notes.txt").write_text("question,answer\n1+1,2\n")
    text = cli("train", "--config", "tiny-cpu", f"data.train_files={tmp_path}/notes.txt", f"storage.root={tmp_path}")
    assert text.returncode == 2, text.stdout[-2000:] + text.stderr[-2000:]
    assert f"data.train_files: {tmp_path}/notes.txt is not a parquet file (ArrowInvalid" in text.stdout
    assert not (tmp_path / "stagerl").exists() and "Traceback" not in text.stdout + text.stderr
    for name, why in (("a/b", "must not contain a slash"), ("x" * 300, "(300 characters): at most 128")):
        named = cli("train", "--config", "tiny-cpu", "--experiment", name, f"storage.root={tmp_path}")
        assert named.returncode == 2 and "error: invalid experiment name" in named.stdout, named.stdout[-2000:]
        assert why in named.stdout and "Prefect" not in named.stdout + named.stderr
        assert not (tmp_path / "stagerl").exists()
    sp = cli("train", "--config", "tiny-cpu", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
             "actor_rollout_ref.model.use_remove_padding=true", f"storage.root={tmp_path}")
    assert sp.returncode == 2 and ("error: actor_rollout_ref.actor.ulysses_sequence_parallel_size=2: "
                                   "sequence parallelism is planned as verl does") in sp.stdout, sp.stdout
    missing = cli("resume", "nope", "--root", str(tmp_path))
    assert missing.returncode == 2 and "no experiment 'nope'" in missing.stdout
    elsewhere = subprocess.run(  # tiny-cpu's relative paths, run from another folder
        [sys.executable, "-m", "flows.cli", "train", "--config", "tiny-cpu", f"storage.root={tmp_path}"], cwd=tmp_path,
        text=True, capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert elsewhere.returncode == 2, elsewhere.stdout + elsewhere.stderr
    assert (f"error: actor_rollout_ref.model.path: ./runs/models/tiny is not a folder (looked for "
            f"{tmp_path.resolve()}/runs/models/tiny; relative paths start at the working directory "
            f"{tmp_path}); data.train_files: ./runs/data/arith-train.parquet is not a file") in elsewhere.stdout
    assert "Repo id" not in elsewhere.stdout + elsewhere.stderr and not (tmp_path / "stagerl").exists()


def test_a_dataset_row_the_run_cannot_use_is_refused_before_anything_starts(tmp_path):
    """An empty prompt, a missing data.reward_fn_key column, a null ground truth (built-in
    scorers): `stagerl train` exits 2 naming the file, the row and the column, before the Prefect
    server starts and before anything is written (no run.json, no lock: no experiment folder)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages.data.tools import make_arith_dataset

    def train_on(rows, name):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        run = subprocess.run([sys.executable, "-m", "flows.cli", "train", "--config", "tiny-cpu",
                              "--experiment", name, f"data.train_files={path}", f"data.val_files={path}",
                              f"actor_rollout_ref.model.path={tmp_path}", f"storage.root={tmp_path / 'runs'}"],
                             cwd=REPO, text=True, capture_output=True, timeout=120)
        assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
        assert "Prefect" not in run.stdout + run.stderr and "Traceback" not in run.stdout + run.stderr
        assert not (tmp_path / "runs" / PROJECT / name).exists()  # no run.json, no lock
        return run.stdout.strip().splitlines()[-1], path

    rows = make_arith_dataset(80, seed=0, difficulty=1)
    rows[37]["prompt"] = []
    line, path = train_on(rows, "empty")
    assert line == f"error: {path} row 37: empty prompt (column 'prompt'): []"
    rows = [{k: v for k, v in r.items() if k != "data_source"} for r in make_arith_dataset(80, seed=0)]
    line, path = train_on(rows, "nosource")
    assert line == f"error: {path} row 0: no 'data_source' column (data.reward_fn_key)"
    rows = make_arith_dataset(80, seed=0, difficulty=1)
    rows[5]["reward_model"] = {"style": "rule", "ground_truth": None}
    line, path = train_on(rows, "notruth")
    assert line.startswith(f"error: 1 of 80 train prompts have no reward_model.ground_truth: {path} row 5. "
                           f"The built-in scorers compare answers with it"), line


# ---- shared fixtures -----------------------------------------------------------------------
def write_run_assets(base: Path) -> Path:
    """The tiny model and the arithmetic train (40 prompts) and test (8) files that
    tiny_overrides points at (this file's and the other flow tests' `assets`)."""
    from stages.data.tools import write_arith_dataset
    from stages.model.tiny import save_tiny_model

    save_tiny_model(base / "model")
    write_arith_dataset(base / "train.parquet", n=40)
    write_arith_dataset(base / "test.parquet", n=8, split="test")
    return base


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from stages.data.tools import write_arith_dataset

    base = write_run_assets(tmp_path_factory.mktemp("assets"))
    write_arith_dataset(base / "train-120.parquet", n=120)  # 2 steps of the CPU default
    return base


def default_shape_overrides(assets, root, steps=2) -> list:
    """The CPU default's batch (60 prompts x 12 = 720 rows, 2 ranks, its micro-batches) with
    short responses, no warm start and no validation, so that a step takes seconds; hf replicas
    (the default's vLLM engine is run by tests/test_shipped_configs.py and test_engines_*)."""
    return ["warmstart.enable=false", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "actor_rollout_ref.rollout.name=hf",
            f"data.train_files={assets}/train-120.parquet", f"data.val_files={assets}/test.parquet",
            f"actor_rollout_ref.model.path={assets}/model", f"storage.root={root}",
            f"storage.cache_dir={assets}/default-cache", "data.max_response_length=16",
            f"trainer.total_training_steps={steps}", "orchestration.retry_delay_s=0.5"]


def tiny_overrides(assets, root, steps=2) -> list:
    """A small run (4 prompts x 2, 1 rank) on the hf engine (vLLM, the CPU default's engine, has
    its own tests and the deployment test above; a vLLM start per killed run would cost minutes)."""
    return ["warmstart.enable=false", "actor_rollout_ref.rollout.name=hf", "trainer.val_before_train=false", f"data.train_files={assets}/train.parquet", f"data.val_files={assets}/test.parquet",
            f"actor_rollout_ref.model.path={assets}/model", f"storage.root={root}",
            f"storage.cache_dir={root}-cache",
            "data.train_batch_size=4", "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.hf_generate_batch_size=8", "trainer.n_gpus_per_node=1",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "reward.num_workers=1",
            "orchestration.retry_delay_s=0.5"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with PrefectServer(tmp_path_factory.mktemp("prefect-home")) as srv:
        yield srv


def stagerl(server, args, toy=False, fault=None, timeout=420, **env_vars):
    """`stagerl ARGS` in its own session against the test server; returns CompletedProcess."""
    env = server.env(PYTHONUNBUFFERED="1", **env_vars)  # a SIGKILLed process loses no buffered log lines
    env.pop("STAGERL_FAULT", None)
    if toy:
        env.update(STAGERL_STAGES="_toy_stages", PYTHONPATH=f"{TESTS}{os.pathsep}{REPO}")
    if fault:
        env["STAGERL_FAULT"] = fault
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a killed run (its rank processes)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def manifest_times(store, layout, steps=(1, 2)) -> dict:
    out = {}
    for step in steps:
        for stage in STAGES:
            m = read_manifest(store, layout, step, stage)
            out[(step, stage)] = m and m["written_at"]
    return out


# ---- deployments on a real server ----------------------------------------------------------
S3_CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@pytest.fixture(scope="module")
def deployed(server, assets, tmp_path_factory):
    """prefect deploy + a process worker + `prefect deployment run 'rl-train/tiny-cpu'`: real
    stages at the CPU default's shape (720 rows, 2 ranks), 2 steps, the store on a moto S3
    endpoint. Yields (store, layout, run output)."""
    with MotoServer() as s3:
        s3.make_bucket("runs")
        creds = {**S3_CREDS, "AWS_ENDPOINT_URL": s3.endpoint_url}
        server.cli("work-pool", "create", "cpu", "--type", "process", "--overwrite")
        server.cli("deploy", "--name", "tiny-cpu", cwd=REPO)
        worker = server.start_worker("cpu", REPO, server.env(**creds))
        overrides = default_shape_overrides(assets, "s3://runs/e2e", steps=2)
        params = json.dumps({"overrides": overrides, "experiment_name": "deployed"})
        run = server.cli("deployment", "run", "rl-train/tiny-cpu", "--params", params, "--watch",
                         "--watch-interval", "2", "--watch-timeout", "480", cwd=REPO,
                         timeout=540, check=False)
        assert run.returncode == 0, run.stdout[-3000:] + worker.log.read_text()[-6000:]
        old = dict(os.environ)
        os.environ.update(creds)
        try:
            yield Store.from_config({"root": "s3://runs/e2e"}), RunLayout(PROJECT, "deployed"), run
        finally:
            os.environ.clear()
            os.environ.update(old)


def test_deployment_run_two_steps_on_s3(deployed, tmp_path):
    """Every stage's parquet of both steps (720 rows each) and the step-2 weights, read back
    from S3; the update ran on 2 ranks."""
    store, layout, run = deployed
    assert "Completed" in run.stdout
    for step in (1, 2):
        for stage in STAGES:
            if stage != "update":
                assert read_table(store, layout, step, stage).num_rows == DEFAULT_ROWS, stage
        uids = read_table(store, layout, step, "rollout").column("uid").to_pylist()
        assert len(set(uids)) == DEFAULT_ROWS // 12
        micro = read_table(store, layout, step, "update")  # one row per (rank, micro-batch)
        assert sorted(set(micro.column("rank").to_pylist())) == [0, 1]
        actor_rows = [r for rows, role in zip(micro.column("rows").to_pylist(),
                                              micro.column("role").to_pylist())
                      if role == "actor" for r in rows]
        assert sorted(actor_rows) == list(range(DEFAULT_ROWS))  # ppo_epochs=1: each row once
    assert list_weights(store, layout) == [2]  # save_freq=-1 keeps only the latest
    folder = load_weights(store, layout, 2, cache_dir=tmp_path / "cache")
    assert (folder / "model.safetensors").stat().st_size > 0
    assert store.exists(layout.run_json) and not store.exists(layout.lock)


def test_each_step_publishes_versioned_artifacts(server, deployed):
    """Markdown (metrics, samples, parquet links) and a samples table, one version per step."""
    def versions(key):
        out = server.cli("artifact", "inspect", key, "-o", "json")
        return json.loads(out.stdout)

    steps = versions("stagerl-deployed-step")
    assert len(steps) == 2 and all(a["type"] == "markdown" for a in steps)
    texts = sorted(a["data"] for a in steps)
    assert "stagerl/deployed: step 1" in texts[0] and "stagerl/deployed: step 2" in texts[1]
    assert f"| rollout | ran | {DEFAULT_ROWS} |" in texts[0] and "reward/score/mean" in texts[0]
    for k, text in zip((1, 2), texts):  # each stage's parquet, linked from the report
        assert f"- rollout rollout.parquet: s3://runs/e2e/stagerl/deployed/steps/00000{k}/rollout.parquet" in text
    assert len(json.loads(versions("stagerl-deployed-samples")[0]["data"])) == 3


# ---- fault injection: SIGKILL inside each real stage, then resume ---------------------------
@pytest.fixture(scope="module")
def reference(server, assets, tmp_path_factory):
    """(store root, console output) of an uninterrupted 2-step run (real stages, tiny overrides)."""
    root = tmp_path_factory.mktemp("reference")
    ref = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", "f", *tiny_overrides(assets, root)])
    assert ref.returncode == 0, ref.stdout[-4000:]
    return root, ref.stdout


@pytest.fixture(scope="module")
def reference_run(reference):
    """The store root of the reference run: copy it before changing anything."""
    return reference[0]


def test_a_step_logs_a_short_line_and_reports_every_stages_rows(server, reference):
    """The console's line per step holds storage.sinks.CONSOLE_KEYS that the run has (tiny-cpu:
    GRPO with a KL loss, no critic), in that order, each value as the store holds it; the full set
    (actor/lr, ...) is not on the console. The step's Prefect report gives every stage's rows,
    the update's too (the rows it trained on), and its metrics table. The stage task runs that
    completed wrote no "Finished in state Completed()" line (orchestration.log_completed_stages
    false, the default); Prefect holds each as Completed all the same."""

    from storage.sinks import log_line
    from test_flow_retry import api

    root, out = reference
    assert not re.search(r"Task run '[^']+' - Finished in state Completed\(\)", out), out[-3000:]
    assert "Flow run" in out and "Task run 'rollout-step-1'" not in out
    for stage in STAGES:
        runs = api(server, "/task_runs/filter", {"task_runs": {"name": {"any_": [f"{stage}-step-2"]}}})
        assert runs and all(r["state"]["type"] == "COMPLETED" for r in runs), (stage, runs[:1])
    store, layout = Store.from_config({"root": str(root)}), RunLayout(PROJECT, "f")
    keys = ["critic/score/mean", "critic/rewards/mean", "response_length/mean", "actor/kl_loss",
            "actor/pg_loss", "actor/grad_norm", "timing_s/step"]
    for step in (1, 2):
        lines = [m.group(1) for m in re.finditer(rf"(?m)\bstep:{step} - (.*)$", out)]
        assert len(lines) == 1, (step, lines, out[-3000:])
        parts = dict(part.split(":", 1) for part in lines[0].strip().split(" - "))
        assert list(parts) == keys, lines[0]
        stored = read_file(store, layout, step, "update", "update/metrics.json")
        for stage in STAGES:
            stored.update((read_manifest(store, layout, step, stage)["extra"] or {}).get("metrics") or {})
        for key in keys[:-1]:
            assert f"{key}:{parts[key]}" == log_line(step, {key: stored[key]}).split(" - ", 1)[1]
        assert 0 < float(parts["timing_s/step"]) < 300 and "actor/lr" in stored
    reports = json.loads(server.cli("artifact", "inspect", "stagerl-f-step", "-o", "json").stdout)
    texts = [a["data"] for a in reports if "stagerl/f: step 1\n" in a["data"]]
    assert texts, [a["data"][:200] for a in reports]
    rows = 4 * 2  # tiny_overrides: 4 prompts x n=2
    for stage in STAGES:
        assert f"| {stage} | ran | {rows} |" in texts[0], texts[0]
    assert "| critic/score/mean |" in texts[0] and "| actor/pg_loss |" in texts[0]
    assert read_manifest(store, layout, 1, "update")["row_count"] == rows  # the committed manifest too


@pytest.fixture(scope="module")
def reference_checksum(reference_run):
    """The step-2 weights' checksum of the uninterrupted run."""
    store = Store.from_config({"root": str(reference_run)})
    return folder_manifest(store, RunLayout(PROJECT, "f").weights(2))["checksum"]


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_damaged_files_are_found_by_verify_and_resume_and_repaired(server, reference_run, tmp_path,
                                                                   reference_checksum):
    """A finished run with one flipped byte in step 2's reward.parquet and one in its weights:
    `stagerl verify` and `stagerl runs --verify` name them, `stagerl resume` refuses to go on,
    `stagerl verify --repair` un-commits them and the next resume computes them again, equal to
    the uninterrupted run."""
    root = tmp_path / "runs"
    shutil.copytree(reference_run, root)
    run_dir = root / PROJECT / "f"
    weights = max((p for p in (run_dir / "weights" / "step_000002").iterdir() if p.is_file()),
                  key=lambda p: p.stat().st_size)
    flip_byte(run_dir / "steps" / "000002" / "reward.parquet")
    flip_byte(weights)
    verify = stagerl(server, ["verify", "f", "--root", str(root)])
    assert verify.returncode == 1, verify.stdout[-3000:]
    assert "2 damaged" in verify.stdout and "all match" not in verify.stdout
    assert f"damaged: {run_dir}/steps/000002/reward.parquet (step 2 reward): sha256 differs" in verify.stdout
    assert f"damaged: {weights} (step 2 folder" in verify.stdout
    runs = stagerl(server, ["runs", "--root", str(root), "--verify"])
    assert runs.returncode == 0 and runs.stdout.split()[-1] == "2", runs.stdout  # the DAMAGED column
    refused = stagerl(server, ["resume", "f", "--root", str(root)])
    assert refused.returncode == 1 and "error: not resuming a run with damaged files" in refused.stdout
    repaired = stagerl(server, ["verify", "f", "--root", str(root), "--repair"])
    assert repaired.returncode == 0, repaired.stdout[-3000:]
    assert "un-committed: step 2 reward" in repaired.stdout and "un-committed: step 2 update" in repaired.stdout
    resumed = stagerl(server, ["resume", "f", "--root", str(root)])
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "all match their manifests" in resumed.stdout  # checked before it continued
    store = Store.from_config({"root": str(root)})
    assert folder_manifest(store, RunLayout(PROJECT, "f").weights(2))["checksum"] == reference_checksum
    again = stagerl(server, ["verify", "f", "--root", str(root)])
    assert again.returncode == 0 and "all match their manifests" in again.stdout, again.stdout[-3000:]


def test_sigkill_inside_each_stage_then_resume_equals_uninterrupted(server, assets, tmp_path,
                                                                    reference_checksum):
    """A run SIGKILLed inside a stage of step 2 (its files written, its manifest not), then
    resumed (`stagerl resume`, or `stagerl train` again with the same arguments) — and that
    resumed run killed inside the next stage, and so on through all five: each time the complete
    stages are not re-run (manifest times unchanged, shown as Cached), and the final weights equal
    the uninterrupted run's."""
    root = tmp_path / "runs"
    args = ["train", "--config", "tiny-cpu", "--experiment", "f", *tiny_overrides(assets, root)]
    store, layout = Store.from_config({"root": str(root)}), RunLayout(PROJECT, "f")
    run = stagerl(server, args, fault=f"{STAGES[0]}:before_manifest@2")
    i, killed = 0, []
    while i < len(STAGES):
        stage = STAGES[i]
        assert run.returncode == -signal.SIGKILL, (stage, run.stdout[-3000:])
        assert f"SIGKILL at {stage}:before_manifest (step 2)" in run.stdout
        killed.append(stage)
        before = manifest_times(store, layout)
        assert all(before[(1, s)] for s in STAGES) and store.exists(layout.weights(1))
        # the stages before it are complete, those after it not, except the one that runs beside
        # it (logprob and reward, flows.step.SIDE_BY_SIDE), which may have committed meanwhile
        beside = {s for s in SIDE_BY_SIDE if stage in SIDE_BY_SIDE and s != stage}
        assert all((before[(2, s)] is not None) == (j < i) for j, s in enumerate(STAGES) if s not in beside), stage
        assert store.exists(layout.artifact(2, stage))  # killed inside it: written, not committed
        nxt = i + 1
        while nxt < len(STAGES) and (before[(2, STAGES[nxt])] is not None or STAGES[nxt] in beside):
            nxt += 1  # completed beside the killed stage, or running beside it in the resume (a kill
            #           there could end the resume before the killed stage commits): not killed
        again = ["resume", "f", "--root", str(root)] if len(killed) % 2 == 1 else args
        run = stagerl(server, again, fault=None if nxt == len(STAGES) else f"{STAGES[nxt]}:before_manifest@2")
        after = manifest_times(store, layout)
        assert all(after[k] == v for k, v in before.items() if v is not None), stage
        assert after[(2, stage)] is not None  # the killed stage ran again and committed
        assert ("Cached" in run.stdout) == (i > 0), stage  # step 2's complete stages: skipped
        i = nxt
    assert {"rollout", "advantage", "update"} <= set(killed) and len(killed) >= 4, killed
    assert run.returncode == 0, run.stdout[-4000:]
    assert all(manifest_times(store, layout).values())
    assert folder_manifest(store, layout.weights(2))["checksum"] == reference_checksum


def test_kills_with_sparse_train_states_resume_by_replay_bit_for_bit(server, assets, tmp_path):
    """trainer.save_freq=5 over 3 steps: no train state is stored before the last step. A run
    SIGKILLed in step 3's update (trained and handed over, nothing stored) or in the update's
    background write of the weights, then resumed: the update of step 3 restores no state and
    replays steps 1-2 from their stored rows, and the final weights equal an uninterrupted run's,
    bit for bit; `stagerl verify` checks every stored version. (A kill in step 3's rollout resumes
    through the same replay; left out for time, ~35 s: a rollout kill's resume is
    test_sigkill_inside_each_stage_then_resume_equals_uninterrupted's.)"""
    root = tmp_path / "runs"
    base = tiny_overrides(assets, root, steps=3) + ["trainer.save_freq=5", "orchestration.step_report_interval_s=3600"]
    ref = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", "ref", *base])
    assert ref.returncode == 0, ref.stdout[-4000:]
    # step reports rate-limited to one an hour: the first step's and the last's only
    reports = json.loads(server.cli("artifact", "inspect", "stagerl-ref-step", "-o", "json").stdout)
    assert sorted(re.search(r"ref: step (\d+)\n", a["data"]).group(1) for a in reports) == ["1", "3"]
    store = Store.from_config({"root": str(root)})
    checksum = lambda e: folder_manifest(store, RunLayout(PROJECT, e).weights(3))["checksum"]
    assert sorted(store.list(RunLayout(PROJECT, "ref").train_state)) == ["step_000003"]
    for name, fault in (("upd", "update:after_train@3"), ("persist", "update:persist@3")):
        killed = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", name, *base], fault=fault)
        assert killed.returncode == -signal.SIGKILL, (fault, killed.stdout[-3000:])
        assert f"SIGKILL at {fault.split('@')[0]} (step 3)" in killed.stdout
        assert read_manifest(store, RunLayout(PROJECT, name), 3, "update") is None
        resumed = stagerl(server, ["resume", name, "--root", str(root)])
        assert resumed.returncode == 0, (fault, resumed.stdout[-4000:])
        assert "replaying step 1's update" in resumed.stdout and "replaying step 2's update" in resumed.stdout
        assert checksum(name) == checksum("ref"), fault
        verify = stagerl(server, ["verify", name, "--root", str(root)])
        assert verify.returncode == 0 and "all match their manifests" in verify.stdout, verify.stdout[-2000:]
    # the flow runs are named after their experiment and steps in Prefect (its API, not a random name)
    request = urllib.request.Request(f"{server.api_url}/flow_runs/filter", data=b'{"limit": 200}',
                                     headers={"Content-Type": "application/json"}, method="POST")
    names = {r["name"] for r in json.loads(urllib.request.urlopen(request, timeout=30).read())}
    assert {"ref · steps 1-3", "upd · steps 1-3", "upd · steps 3-3 (resume)",
            "persist · steps 3-3 (resume)"} <= names, sorted(names)


def test_a_killed_prefect_server_stops_the_run_and_resume_completes(assets, tmp_path, reference_checksum):
    """`stagerl train` with its own local Prefect server (no PREFECT_API_URL): the server is
    SIGKILLed during step 1; the run stops within 30 s with a message naming the server and the
    command to run next, which completes the run with the uninterrupted run's weights."""
    root = (tmp_path / "runs").resolve()
    home = root / ".cache" / "prefect"  # flows.cli.train.prefect_env: the store's scratch home
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "STAGERL_FAULT"}
    env.update(PYTHONUNBUFFERED="1")
    store, layout = Store.from_config({"root": str(root)}), RunLayout(PROJECT, "f")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", "--config", "tiny-cpu", "--experiment", "f",
                             *tiny_overrides(assets, root)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while read_manifest(store, layout, 1, "rollout") is None:
            assert proc.poll() is None and time.time() < deadline, "step 1's rollout did not finish"
            time.sleep(0.2)
        record = json.loads((home / f"stagerl-server-{proc.pid}.json").read_text())
        os.kill(record["pid"], signal.SIGKILL)
        killed = time.time()
        out, _ = proc.communicate(timeout=60)
        stopped_s = time.time() - killed
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"run stopped {stopped_s:.1f} s after the server's SIGKILL")
    assert proc.returncode == 1 and stopped_s < 30, (proc.returncode, stopped_s, out[-3000:])
    assert (f"the local Prefect server (pid {record['pid']}, {record['api_url']}) exited with code -9"
            in out), out[-3000:]
    command = out.split("continue with `", 1)[1].split("`", 1)[0]
    assert command == f"stagerl resume {PROJECT}/f --root {root}"
    resumed = subprocess.run([sys.executable, "-m", "flows.cli", *command.split()[1:]], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert folder_manifest(store, layout.weights(2))["checksum"] == reference_checksum


def test_a_prefect_api_that_stops_answering_lets_the_steps_finish_and_names_it(assets, tmp_path, reference_checksum):
    """`stagerl train` against a Prefect API it did not start (PREFECT_API_URL), SIGKILLed during
    step 1: the steps go on (a stage needs only the store, and a step report that cannot be
    published holds no step back), then the run ends naming the API and the command to run
    next, which completes the run (on a fresh server) with the uninterrupted run's weights."""
    from flows.prefect_server import local_server
    from stages.ranks.procs import kill_group

    root = (tmp_path / "runs").resolve()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "STAGERL_FAULT"}
    env.update(PYTHONUNBUFFERED="1", PREFECT_CLIENT_MAX_RETRIES="1")  # the client gives up in ~2 s, not ~1 min
    store, layout = Store.from_config({"root": str(root)}), RunLayout(PROJECT, "g")
    with local_server(tmp_path / "prefect") as api:
        api.wait_healthy()
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", "--config", "tiny-cpu", "--experiment", "g",
                                 *tiny_overrides(assets, root)], cwd=REPO, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**env, "PREFECT_API_URL": api.api_url, "PREFECT_HOME": str(tmp_path / "prefect")})
        try:
            deadline = time.time() + 300
            while read_manifest(store, layout, 1, "rollout") is None:
                assert proc.poll() is None and time.time() < deadline, "step 1's rollout did not finish"
                time.sleep(0.2)
            os.kill(api.proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=300)
        finally:
            kill_group(proc)  # the run's session: what it left running
    assert proc.returncode == 1, out[-3000:]
    assert all(read_manifest(store, layout, step, stage) for step in (1, 2) for stage in STAGES), out[-3000:]
    last = [line for line in out.splitlines() if line.startswith("error:")][-1]
    assert last.startswith(f"error: the Prefect API {api.api_url} stopped answering (ConnectError"), out[-3000:]
    command = last.split("`")[1]
    assert command == f"stagerl resume {PROJECT}/g --root {root}"
    resumed = subprocess.run([sys.executable, "-m", "flows.cli", *command.split()[1:]], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert folder_manifest(store, layout.weights(2))["checksum"] == reference_checksum


def test_each_step_as_its_own_subflow(server, assets, tmp_path, reference_checksum):
    """orchestration.step_subflow=true: every step is an rl-step subflow of rl-train (the default
    runs the stage tasks in the rl-train flow run itself), and the weights equal the default's.
    Credentials given as overrides reach no object in the store, no byte of Prefect's database
    and no console line; `stagerl resume` says where they come from instead. The run logs to
    TensorBoard and wandb (offline) too: both hold each step's update metrics, and no credential.
    With orchestration.log_completed_stages=true every stage task run logs its Completed line."""
    root = tmp_path / "runs"
    key, secret = "AKIAFAKEKEY7Q3Z9XW2M", "fakeSecret+9vQx/Zr7TtPpLmNnBbVvCcXx"
    sink_dirs = {"TENSORBOARD_DIR": str(tmp_path / "tb"), "WANDB_DIR": str(tmp_path / "wb")}
    run = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", "f", *tiny_overrides(assets, root),
                           "orchestration.step_subflow=true", "orchestration.log_completed_stages=true",
                           f"storage.key={key}", f"storage.secret={secret}",
                           "trainer.logger=[console,tensorboard,wandb]"], **sink_dirs)
    assert run.returncode == 0, run.stdout[-4000:]
    assert "Beginning subflow run 'step-2'" in run.stdout
    assert all(f"Task run '{s}-step-2' - Finished in state Completed()" in run.stdout for s in STAGES)
    store = Store.from_config({"root": str(root)})
    assert folder_manifest(store, RunLayout(PROJECT, "f").weights(2))["checksum"] == reference_checksum
    scalars, wandb = tensorboard_scalars(tmp_path / "tb"), wandb_run(tmp_path / "wb")
    for step in (1, 2):
        update = read_file(store, RunLayout(PROJECT, "f"), step, "update", "update/metrics.json")
        assert scalars["actor/pg_loss"][step] == pytest.approx(update["actor/pg_loss"], rel=1e-6)  # float32
        assert wandb["history"][step]["actor/pg_loss"] == update["actor/pg_loss"]
        assert wandb["history"][step]["actor/grad_norm"] == update["actor/grad_norm"]
    resumed = stagerl(server, ["resume", "f", "--root", str(root)], **sink_dirs)
    assert resumed.returncode == 0 and "storage.key, storage.secret held credentials" in resumed.stdout
    files = [p for p in [*root.rglob("*"), *server.home.rglob("*"), *(tmp_path / "tb").rglob("*"),
                         *(tmp_path / "wb").rglob("*")] if p.is_file()]
    assert any(b"orchestration.step_subflow=true" in p.read_bytes() for p in files if server.home in p.parents)
    for path in files:  # the flow's parameters are in the server's database: the public ones only
        data = path.read_bytes()
        assert key.encode() not in data and secret.encode() not in data, path
    assert key not in run.stdout + resumed.stdout and secret not in run.stdout + resumed.stdout


# ---- multi-pool mode and the retry policy (toy stages) -------------------------------------
@pytest.fixture(scope="module")
def stage_pools(server):
    """Process pools `inference` and `training` with a worker each, and the rl-stage/rollout and
    rl-stage/update deployments of prefect.yaml on them (toy stages)."""
    env = server.env(STAGERL_STAGES="_toy_stages", PYTHONPATH=f"{TESTS}{os.pathsep}{REPO}")
    for pool in ("inference", "training"):
        server.cli("work-pool", "create", pool, "--type", "process", "--overwrite")
        server.start_worker(pool, REPO, env)
    server.cli("deploy", "--name", "rollout", "--name", "update", cwd=REPO)


def test_multi_pool_step_runs_stages_on_two_pools_and_retries_storage_errors(
        server, stage_pools, assets, tmp_path):
    """orchestration.mode=deployments: one step whose rollout runs as a deployment on the
    inference pool's worker, logprob and update (the N-rank stages) on the training pool's (each
    stage flow its own process), reward and advantage in the flow's process; an injected storage
    error in reward is retried and the step completes."""
    root = tmp_path / "runs"
    run = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", "pools", *tiny_overrides(assets, root, 1),
                           "orchestration.mode=deployments"], toy=True,
                  fault="reward:start:storage@1")
    assert run.returncode == 0, run.stdout[-4000:]
    assert "injected storage error" in run.stdout and "Retry 1/" in run.stdout
    store, layout = Store.from_config({"root": str(root)}), RunLayout(PROJECT, "pools")
    pid = {s: read_manifest(store, layout, 1, s)["pid"] for s in STAGES}
    assert len({pid["rollout"], pid["logprob"], pid["reward"], pid["update"]}) == 4  # four processes
    assert pid["reward"] == pid["advantage"]  # the flow's own process
    assert store.exists(layout.weights(1))


def test_stage_deployment_on_the_wrong_pool_is_refused(server, stage_pools, assets, tmp_path):
    bad = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", "pools", *tiny_overrides(assets, tmp_path, 1),
                           "orchestration.mode=deployments", "orchestration.update_pool=gpu"],
                  toy=True)
    assert bad.returncode == 1 and "orchestration.update_pool='gpu'" in bad.stdout


def test_bad_input_is_not_retried(server, assets, tmp_path):
    bad = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", "bad", *tiny_overrides(assets, tmp_path, 1)],
                  toy=True, fault="advantage:start:value")
    assert bad.returncode == 1 and "injected bad input at advantage:start" in bad.stdout
    assert "Retry 1/" not in bad.stdout


# ---- cluster files -------------------------------------------------------------------------
@pytest.mark.skipif(not shutil.which("docker-compose"), reason="docker-compose not installed")
def test_docker_compose_config_is_valid():
    out = subprocess.run(["docker-compose", "--env-file", ".env.example", "config"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import yaml

    services = yaml.safe_load(out.stdout)["services"]
    assert {"postgres", "prefect-server", "minio", "minio-bucket", "cpu-worker",
            "gpu-worker"} <= set(services)
    for pool in ("inference", "training"):  # orchestration.mode=deployments (docs/cluster.md, make cluster-test)
        command = services[f"{pool}-worker"]["command"]
        assert f"--pool {pool}" in (command if isinstance(command, str) else " ".join(command))
        assert services[f"{pool}-worker"]["environment"]["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert services["gpu-worker"]["runtime"] == "nvidia"
    ports = [p for s in services.values() for p in s.get("ports", [])]
    assert ports and all(str(p).startswith("127.0.0.1:") or
                         (isinstance(p, dict) and p.get("host_ip") == "127.0.0.1") for p in ports)
    assert "change-me-postgres" in services["prefect-server"]["environment"][
        "PREFECT_API_DATABASE_CONNECTION_URL"]  # credentials come from the env file
    from flows.prefect_server import SERVER_SETTINGS  # the users' server records task runs as stagerl's own

    for key, value in SERVER_SETTINGS.items():
        assert services["prefect-server"]["environment"][f"PREFECT_SERVER_SERVICES_{key}"] == value, key
    assert subprocess.run(["docker-compose", "--env-file", ".env.example", "config", "-q"],
                          cwd=REPO, timeout=120).returncode == 0


def test_prefect_yaml_deployments():
    import yaml

    doc = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in doc["deployments"]}
    assert deps["tiny-cpu"]["parameters"]["config"] == "tiny-cpu"
    assert deps["gsm8k-qwen2.5-0.5b"]["work_pool"]["name"] == "gpu"
    assert set(deps["tiny-cpu"]["parameters"]) == {"config", "overrides", "experiment_name"}
    # its own experiment, not `make demo`'s (tiny-cpu's trainer.experiment_name)
    assert deps["tiny-cpu"]["parameters"]["experiment_name"] == "tiny-cpu-deployed"
    assert deps["rollout"]["work_pool"]["name"] == "inference"
    assert deps["update"]["work_pool"]["name"] == "training"
    pull = doc["pull"][0]["prefect.deployments.steps.set_working_directory"]
    assert pull["directory"] == "{{ checkout.stdout }}"
