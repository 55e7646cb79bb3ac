"""Persistent rank pool (stages.ranks.pool): one torchrun job reused by every N-rank stage.

Real torchrun jobs with 2 gloo ranks: each pool start costs ~10 s, each per-call launch 6-13 s."""
import os
import signal
import socket
import stat
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from _pool_steps import run_steps
from stages.ranks.pool import RankPool, launcher_ranks
from stages.ranks.procs import Doorbell
from stages.model.tiny import save_tiny_model
from flows.step import is_retryable
from storage.artifacts import read_file, read_manifest, read_table
from storage.store import StoreError

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(__import__("stages.ranks.deepspeed_ops", fromlist=["x"]).DEFAULT_DIR))


def gone(pid: int, wait_s: float = 20) -> bool:
    """The process no longer exists (or is a zombie about to be reaped by init)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.2)
    return False


def test_jobs_failure_dead_rank_restart_and_close(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the ranks work where the run does: relative paths mean the same
    with RankPool(2, "cpu", tmp_path / "pool") as pool:
        first = pool.submit("tests._pool_jobs", {"message": "hi"})
        assert [r["rank"] for r in first] == [0, 1] and {r["world"] for r in first} == {2}
        assert {r["cwd"] for r in first} == {str(tmp_path)}
        assert first[0]["ctx"] == {"message": "hi"}
        pids = [r["pid"] for r in first]
        assert sorted(pids) == sorted(pool.rank_pids()) and os.getpid() not in pids
        # the doorbells the client and the ranks ring (Doorbell): named pipes in the work dir
        assert all(stat.S_ISFIFO((tmp_path / "pool" / name).stat().st_mode) for name in ("wake_0", "wake_1", "done"))
        # a failing job: the rank's traceback, and the same processes run the next job
        with pytest.raises(RuntimeError) as err:
            pool.submit("tests._pool_jobs", {"message": "bad row 7", "fail_on_rank": 1})
        text = str(err.value)
        assert "error rank 1" in text and "ValueError: boom on rank 1: bad row 7" in text
        assert "Traceback" in text and "error rank 0" not in text
        assert not is_retryable(err.value)  # bad input is not retried
        # a storage error on a rank: raised here as a StoreError, which the flow's policy retries
        with pytest.raises(StoreError) as err:
            pool.submit("tests._pool_jobs", {"message": "outage", "store_outage_on_rank": 0})
        assert "connection refused on rank 0" in str(err.value) and is_retryable(err.value)
        again = pool.submit("tests._pool_jobs", {"message": "after"})
        assert [r["pid"] for r in again] == pids and pool.starts == 1
        assert not list((tmp_path / "pool").glob("result_*")) and not list((tmp_path / "pool").glob("job_*"))
        # a rank process dies: torchrun stops, the next submit starts a fresh pool
        launcher = pool.proc.pid
        os.kill(pids[1], signal.SIGKILL)
        assert gone(launcher, 60)
        restarted = pool.submit("tests._pool_jobs", {"message": "restarted"})
        assert pool.starts == 2 and [r["ctx"]["message"] for r in restarted] == ["restarted"] * 2
        new_pids = [r["pid"] for r in restarted]
        assert set(new_pids).isdisjoint(pids)
        launcher2 = pool.proc.pid
    for pid in pids + new_pids + [launcher, launcher2]:
        assert gone(pid), f"process {pid} is still running after close()"
    assert not pool.alive()


def test_a_doorbell_rung_before_its_wait_is_kept_and_one_nobody_waits_on_costs_nothing(tmp_path):
    path = tmp_path / "bell"
    Doorbell.ring(path)  # nothing there: no error, nothing made
    assert not path.exists()
    bell = Doorbell(path)
    assert stat.S_ISFIFO(path.stat().st_mode)
    assert bell.wait(0.01) is False  # not rung: the timeout
    Doorbell.ring(path)
    Doorbell.ring(path)  # rung twice before the wait (a result written before the client waits)
    assert bell.wait(60) is True
    assert bell.wait(0.01) is False  # drained: the two rings ended one wait
    ringer = threading.Timer(0.05, Doorbell.ring, args=(path,))
    ringer.start()  # rung while waiting
    assert bell.wait(60) is True
    ringer.join()
    bell.close()
    Doorbell.ring(path)  # a pipe nobody waits on (ENXIO): no error, no block
    plain = tmp_path / "file"
    plain.write_text("x")
    not_a_pipe = Doorbell(plain)  # the name is taken by a file: it polls, and a ring writes nothing
    assert not_a_pipe.fd is None and not_a_pipe.wait(0.01) is False
    Doorbell.ring(plain)
    assert plain.read_text() == "x"


def test_a_rank_killed_during_a_job_is_named(tmp_path):
    """Rank 1 SIGKILLed while a 60 s job runs: the job fails within seconds, naming the rank, its
    pid, its host and how it died (torchrun's first observed failure); the next job runs on a
    fresh pool."""
    with RankPool(2, "cpu", tmp_path / "pool") as pool:
        pids = [r["pid"] for r in pool.submit("tests._pool_jobs", {"message": "hi"})]
        threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            pool.submit("tests._pool_jobs", {"message": "long", "sleep_s": 60}, timeout_s=120)
        assert time.monotonic() - t0 < 30
        assert (f"tests._pool_jobs on the rank pool (2 ranks): rank 1 (pid {pids[1]}, host {socket.getfqdn()}) "
                f"died (killed by SIGKILL); the pool was stopped" in str(err.value)), str(err.value)[:2000]
        again = pool.submit("tests._pool_jobs", {"message": "after"})
        assert pool.starts == 2 and set(r["pid"] for r in again).isdisjoint(pids)


def test_a_frozen_rank_is_reported_within_its_heartbeat_timeout(tmp_path):
    """A rank SIGSTOPped during a 120 s job: reported after about heartbeat_timeout_s (5 s here),
    naming the rank, its pid and its stopped state, not at the job timeout; the next job runs on
    a fresh pool."""
    with RankPool(2, "cpu", tmp_path / "pool", heartbeat_timeout_s=5) as pool:
        pids = [r["pid"] for r in pool.submit("tests._pool_jobs", {"message": "hi"})]
        threading.Timer(1.0, os.kill, (pids[1], signal.SIGSTOP)).start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            pool.submit("tests._pool_jobs", {"message": "long", "sleep_s": 120}, timeout_s=300)
        waited = time.monotonic() - t0
        assert 5 < waited < 20, waited
        assert (f"rank 1 (pid {pids[1]}, process state T (stopped)) sent no heartbeat for"
                in str(err.value)), str(err.value)[:2000]
        assert gone(pids[1], 30) and gone(pids[0], 30)
        again = pool.submit("tests._pool_jobs", {"message": "after"})
        assert pool.starts == 2 and set(r["pid"] for r in again).isdisjoint(pids)


def test_a_rank_blocked_in_its_set_up_is_named_within_the_start_timeout(tmp_path):
    """Rank 1 stopped (SIGSTOP) as soon as torchrun started it, before it could write its ready
    file (rank 0 then waits for it in the process group): the first job fails rank_start_timeout_s
    (8 s here) after the start, naming rank 1, its pid, its host and its stopped state, not at the
    job timeout; no rank process is left behind."""
    pool = RankPool(2, "cpu", tmp_path / "pool", start_timeout_s=8)
    try:
        pool.start(wait=False)
        deadline = time.monotonic() + 20
        while 1 not in launcher_ranks(pool.proc.pid):
            assert time.monotonic() < deadline, "torchrun started no rank 1"
            time.sleep(0.01)
        pids = launcher_ranks(pool.proc.pid)
        os.kill(pids[1], signal.SIGSTOP)
        assert not (tmp_path / "pool" / "ready_1").exists()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            pool.submit("tests._pool_jobs", {"message": "hi"}, timeout_s=600)
        assert time.monotonic() - t0 < 15
        text = str(err.value)
        assert (f"rank pool: rank 0 (pid {pids[0]}, host {socket.gethostname()}, process state "
                in text and f"rank 1 (pid {pids[1]}, host {socket.gethostname()}, process state T (stopped)) "
                "not ready 8 s after the start (orchestration.rank_start_timeout_s)" in text), text[:2000]
    finally:
        pool.close()
    assert gone(pids[0], 30) and gone(pids[1], 30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_two_steps_through_the_pool_equal_per_call_launches(tmp_path, model_dir, capsys):
    """logprob values and update weights (bit for bit) of 2 steps: pool == 4 separate launches;
    the pool's step 2 reuses the DeepSpeed engines."""
    launched = run_steps(tmp_path / "launch", model_dir, 2)
    with RankPool(2, "cpu") as pool:
        pooled = run_steps(tmp_path / "pool", model_dir, 2, pool=pool)
        rank_pids = pool.rank_pids()
        assert pool.starts == 1
    assert all(gone(pid) for pid in rank_pids)
    assert "logprob step 2 actor rank 1" in capsys.readouterr().out  # ranks' lines relayed
    for step, (a, b) in enumerate(zip(launched, pooled), start=1):
        ta = read_table(a["ctx"].store, a["ctx"].layout, step, "logprob").to_pydict()
        tb = read_table(b["ctx"].store, b["ctx"].layout, step, "logprob").to_pydict()
        assert ta == tb, f"logprob of step {step} differs"
        ma = read_file(a["ctx"].store, a["ctx"].layout, step, "update", "update/metrics.json")
        mb = read_file(b["ctx"].store, b["ctx"].layout, step, "update", "update/metrics.json")
        assert ma["actor/grad_norm"] == mb["actor/grad_norm"] and ma["actor/pg_loss"] == mb["actor/pg_loss"]
        assert ma["update/engine_reused"] is False
        assert mb["update/engine_reused"] is (step == 2)
        wa = load_file(os.path.join(a["ctx"].store.path(a["ctx"].layout.weights(step)), "model.safetensors"))
        wb = load_file(os.path.join(b["ctx"].store.path(b["ctx"].layout.weights(step)), "model.safetensors"))
        assert wa.keys() == wb.keys()
        for name in wa:
            assert torch.equal(wa[name], wb[name]), f"step {step}: {name}"
        # per-call launches store a train state every step; the pooled run hands its weights to the
        # engines through a version folder and stores none before save_freq or the last step
        for run, stored in ((a, True), (b, False)):
            ctx = run["ctx"]
            assert ctx.store.exists(f"{ctx.layout.train_state}/step_{step:06d}/actor/_manifest.json") is stored
        assert read_manifest(b["ctx"].store, b["ctx"].layout, step, "update")["extra"]["handoff"] == "folder"
