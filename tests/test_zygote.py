"""The fork server (stages.ranks.zygote): CPU workers and ranks forked from one Python that imported
torch, transformers and DeepSpeed once. Real processes: the children's exit codes, output, env,
threads and passed fds; a 2-rank gloo pool forked from it runs jobs, survives a dead rank and
leaves nothing behind; an hf rollout worker forked from it gives the same rows as a fresh one."""
import os
import signal
import socket
import threading
import time

import pytest

from stages.ranks.pool import RankPool
from stages.ranks.zygote import ForkedProcess, Zygote
from test_rank_pool import gone


@pytest.fixture
def zygote():
    z = Zygote.start()
    yield z
    z.close()


def test_forked_children_behave_like_popen(zygote, tmp_path, monkeypatch):
    out = (tmp_path / "out.txt").open("ab")
    r, w = os.pipe()
    os.write(w, b"hello through fd")
    env = dict(os.environ, ZYGOTE_TEST="x1", OMP_NUM_THREADS="1", ZYGOTE_EXIT="7")
    child = zygote.popen("tests._zygote_jobs:report", ["{fd0}", "a", "b"], env, stdout=out, stderr=out,
                         pass_fds=(r,), cwd=tmp_path)
    assert isinstance(child, ForkedProcess)
    assert child.wait(120) == 7 and child.poll() == 7  # its return value is its exit code
    text = (tmp_path / "out.txt").read_text()
    assert f"args=['a', 'b'] env=x1 threads=1 fd_data=hello through fd tasks=1 cwd={tmp_path}" in text, text
    assert child.pid not in (os.getpid(), zygote.proc.pid)

    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    r2, w2 = os.pipe()
    os.write(w2, b"again")
    here = zygote.popen("tests._zygote_jobs:report", ["{fd0}", "c"], env, stdout=out, stderr=out, pass_fds=(r2,))
    assert here.wait(120) == 7  # no cwd given: the caller's working directory, as for a Popen
    assert f"args=['c'] env=x1 threads=1 fd_data=again tasks=1 cwd={tmp_path / 'sub'}" in (tmp_path / "out.txt").read_text()

    failing = zygote.popen("tests._zygote_jobs:fail", ["row 3"], dict(os.environ), stdout=out, stderr=out)
    assert failing.wait(60) == 1
    assert "ValueError: boom: ['row 3']" in (tmp_path / "out.txt").read_text()

    sleeper = zygote.popen("tests._zygote_jobs:sleep", [], dict(os.environ), stdout=out, stderr=out,
                           new_session=True)
    deadline = time.monotonic() + 60
    while "sleeping" not in (tmp_path / "out.txt").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sleeper.poll() is None and os.getpgid(sleeper.pid) == sleeper.pid  # its own session
    with pytest.raises(Exception):
        sleeper.wait(0.2)
    sleeper.kill()
    assert sleeper.wait(10) == -signal.SIGKILL
    out.close()


def test_children_die_with_the_zygote(zygote, tmp_path):
    out = (tmp_path / "out.txt").open("ab")
    sleeper = zygote.popen("tests._zygote_jobs:sleep", [], dict(os.environ), stdout=out, stderr=out)
    pid = sleeper.pid
    zygote.proc.kill()  # the server dies (as when its owner dies: it has PDEATHSIG on the owner)
    zygote.proc.wait()
    assert gone(pid, 20)
    assert sleeper.wait(10) == -signal.SIGKILL  # reported as killed: nobody reaped it for us
    out.close()


def test_a_launcher_hands_its_fork_server_to_the_run(tmp_path, monkeypatch):
    """`stagerl train` starts the fork server before Prefect (prestart) and the flow adopts it:
    taken once, only by the process it was offered to, and the run's close stops it."""
    from configs.loader import load_config
    from configs.suggest import make_plan
    from stages.ranks.zygote import HANDOVER_ENV, prestart, wanted

    monkeypatch.delenv(HANDOVER_ENV, raising=False)
    one_rank = load_config("tiny-cpu", ["trainer.n_gpus_per_node=1"])
    assert prestart(one_rank) is None and HANDOVER_ENV not in os.environ  # nothing to fork
    hf = ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf"]
    for extra, forks in (([], False), (["trainer.staleness=1"], True), (["actor_rollout_ref.rollout.cpu_affinity=[0]"], True)):
        one = load_config("tiny-cpu", hf + extra)  # one rank: only an hf engine in its own process is forked
        assert wanted(one, make_plan(one)) is forks, extra
    cfg = load_config("tiny-cpu", [])
    assert wanted(cfg, make_plan(cfg))
    launcher = prestart(cfg)
    try:
        fd, pid, owner = (int(x) for x in os.environ[HANDOVER_ENV].split(":"))
        assert (pid, owner) == (launcher.proc.pid, os.getpid())
        monkeypatch.setenv(HANDOVER_ENV, f"{fd}:{pid}:{os.getppid()}")
        assert Zygote.adopt() is None  # offered to another process (an inherited variable)
        monkeypatch.setenv(HANDOVER_ENV, f"{fd}:{pid}:{owner}")
        run = Zygote.adopt()
        assert run is not None and run.proc.pid == pid and run.alive()
        assert HANDOVER_ENV not in os.environ and Zygote.adopt() is None  # taken once
        out = (tmp_path / "out.txt").open("ab")
        r, w = os.pipe()
        os.write(w, b"via adopted")
        child = run.popen("tests._zygote_jobs:report", ["{fd0}"], dict(os.environ, ZYGOTE_TEST="adopted"),
                          stdout=out, stderr=out, pass_fds=(r,))
        assert child.wait(120) == 0 and "env=adopted" in (tmp_path / "out.txt").read_text()
        t0 = time.monotonic()
        run.close()  # the run's session closes it: the server stops though the launcher holds a copy
        assert not run.alive() and time.monotonic() - t0 < 5
    finally:
        launcher.close()
    assert launcher.proc.returncode is not None


def test_stagerl_train_starts_its_fork_server_before_it_imports_torch(tmp_path):
    """`stagerl train` starts the run's fork server before this process imports torch (the plan's
    modules do, ~1.5 s that the server's own imports would otherwise start behind): in a fresh
    interpreter, prestart is reached with torch not yet imported, and the command then goes on to
    check the config (here it refuses its missing local paths, exit 2)."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys, stages.ranks.zygote as z\n"
              "z.prestart = lambda cfg: print('torch at prestart:', 'torch' in sys.modules) or None\n"
              "from flows.cli import main\n"
              "sys.exit(main(['train', '--config', 'tiny-cpu', '--experiment', 'order']))\n")
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(repo)))
    assert "torch at prestart: False" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.returncode == 2 and "is not a folder" in out.stdout, out.stdout[-2000:]


def test_a_rank_pool_forked_from_the_zygote(zygote, tmp_path):
    """torchrun's role played by a forked leader: 2 gloo ranks run jobs; a failing job is
    reported and the pool goes on; a dead rank stops the group and the next job starts a fresh
    one; close() leaves no process."""
    with RankPool(2, "cpu", tmp_path / "pool", spawner=zygote) as pool:
        assert pool.forked()
        first = pool.submit("tests._pool_jobs", {"message": "hi"})
        assert [r["rank"] for r in first] == [0, 1] and {r["world"] for r in first} == {2}
        pids = [r["pid"] for r in first]
        assert sorted(pids) == sorted(pool.rank_pids()) and zygote.proc.pid not in pids
        with pytest.raises(RuntimeError, match="boom on rank 1"):
            pool.submit("tests._pool_jobs", {"message": "bad", "fail_on_rank": 1})
        assert [r["pid"] for r in pool.submit("tests._pool_jobs", {"message": "after"})] == pids
        leader = pool.proc.pid
        os.kill(pids[1], signal.SIGKILL)  # the leader stops rank 0 and exits, as torchrun does
        assert gone(leader, 60)
        restarted = pool.submit("tests._pool_jobs", {"message": "restarted"})
        assert pool.starts == 2 and set(r["pid"] for r in restarted).isdisjoint(pids)
        new = [r["pid"] for r in restarted] + [pool.proc.pid]
    for pid in pids + new + [leader]:
        assert gone(pid), f"process {pid} is still running after close()"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores: one for the server, one for the rank")
def test_a_one_rank_pool_forked_beside_a_pinned_engine_runs_on_the_training_cores(tmp_path):
    """A one-rank run whose engine is a forked worker trains in a rank forked from the same server
    (flows.train.start_rank_pool): the server runs on the engine's core, the rank on the cores and
    with the threads it is given: the flow's cores but a pinned engine's, its training threads."""
    engine, training = sorted(os.sched_getaffinity(0))[:2]
    with pytest.raises(ValueError, match="needs a fork server"):
        RankPool(1, "cpu", tmp_path / "nopool")
    server = Zygote.start(preload=("torch",), cpus=(engine,))
    try:
        with RankPool(1, "cpu", tmp_path / "pool", spawner=server, threads=1, cpus=(training,)) as pool:
            assert pool.forked()
            [result] = pool.submit("tests._pool_jobs", {"message": "one"})
            assert (result["rank"], result["world"]) == (0, 1)
            assert result["cpus"] == [training] and result["threads"] == 1
            assert result["pid"] != server.proc.pid and os.sched_getaffinity(server.proc.pid) == {engine}
        # the training flow's choice: a one-rank run with a fork server (its hf engine a forked
        # worker, here unpinned at staleness 1) gets such a pool, with the training's share of
        # the cores as threads; without a fork server its one rank trains in the flow's process
        from configs.loader import load_config
        from configs.suggest import make_plan
        from flows.train import start_rank_pool
        import torch

        from stages.engines import split_cores

        cfg = load_config("tiny-cpu", ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
                                       "trainer.staleness=1"])
        plan = make_plan(cfg)
        assert start_rank_pool(cfg, plan, None) is None
        pool = start_rank_pool(cfg, plan, server)
        try:
            share = min(torch.get_num_threads(), split_cores(len(os.sched_getaffinity(0)))[1])  # 1 of 2 cores
            assert (pool.world, pool.threads, pool.cpus) == (1, share, tuple(sorted(os.sched_getaffinity(0))))
        finally:
            pool.close()
        # the engine pinned to a core: the rank trains on the others (this process, which only
        # orchestrates, keeps them all), one thread per core at most
        pinned = load_config("tiny-cpu", ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
                                          f"actor_rollout_ref.rollout.cpu_affinity=[{engine}]"])
        pool = start_rank_pool(pinned, make_plan(pinned), server)
        try:
            rest = tuple(sorted(os.sched_getaffinity(0) - {engine}))
            assert (pool.cpus, pool.threads) == (rest, min(torch.get_num_threads(), len(rest)))
        finally:
            pool.close()
        # actor.cpu_affinity names the rank's cores (the flow may then run beside the engine)
        split = load_config("tiny-cpu", ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
                                         f"actor_rollout_ref.rollout.cpu_affinity=[{engine}]",
                                         f"actor_rollout_ref.actor.cpu_affinity=[{training}]"])
        pool = start_rank_pool(split, make_plan(split), server)
        try:
            assert (pool.cpus, pool.threads) == ((training,), 1)
            [result] = pool.submit("tests._pool_jobs", {"message": "split"})
            assert result["cpus"] == [training]
        finally:
            pool.close()
    finally:
        server.close()


def test_a_rank_of_a_forked_pool_killed_during_a_job_is_named(zygote, tmp_path):
    """The forked group's leader says which rank died first: the job fails naming its rank, pid,
    host and signal."""
    with RankPool(2, "cpu", tmp_path / "pool", spawner=zygote) as pool:
        pids = [r["pid"] for r in pool.submit("tests._pool_jobs", {"message": "hi"})]
        threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            pool.submit("tests._pool_jobs", {"message": "long", "sleep_s": 60}, timeout_s=120)
        assert time.monotonic() - t0 < 30
        assert (f"rank 1 (pid {pids[1]}, host {socket.gethostname()}) died (killed by SIGKILL)"
                in str(err.value)), str(err.value)[:2000]


def test_a_fork_server_for_a_pinned_engine_alone_runs_on_the_engines_cores():
    """With rollout.cpu_affinity and no ranks to fork, the server's imports run on the engine's
    cores (its workers pin themselves there anyway), not on the training's; a server that forks
    ranks stays on this process's cores."""
    from configs.loader import load_config
    from stages.ranks.zygote import engine_cpus

    pinned = ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.cpu_affinity=[0]"]
    assert engine_cpus(load_config("tiny-cpu", pinned + ["trainer.n_gpus_per_node=1"]), 1) == (0,)
    assert engine_cpus(load_config("tiny-cpu", pinned), 2) == ()  # it forks the two ranks
    assert engine_cpus(load_config("tiny-cpu", ["trainer.n_gpus_per_node=1"]), 1) == ()  # not pinned
    server = Zygote.start(preload=("json",), cpus=(0,))
    try:
        assert os.sched_getaffinity(server.proc.pid) == {0}
    finally:
        server.close()
