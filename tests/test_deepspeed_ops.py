"""DeepSpeed's prebuilt CPU comm op is built and loaded with one ninja: the Python environment's
own, whatever PATH says (two ninja versions over one build folder rebuild it each time); at run
time the op comes from `make install`'s prebuilt folder unless TORCH_EXTENSIONS_DIR says otherwise."""
import os
import subprocess
import sys

from stages.ranks.deepspeed_ops import DEFAULT_DIR, same_ninja


def test_the_environments_ninja_comes_first_on_path(monkeypatch):
    bindir = os.path.dirname(sys.executable)
    assert os.path.exists(os.path.join(bindir, "ninja"))  # pip's ninja, a dependency of the install
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", bindir, "/bin"]))
    same_ninja()
    assert os.environ["PATH"].split(os.pathsep) == [bindir, "/usr/bin", "/bin"]
    same_ninja()  # idempotent
    assert os.environ["PATH"].split(os.pathsep) == [bindir, "/usr/bin", "/bin"]


def test_run_time_uses_the_prebuilt_op_folder_unless_told_otherwise():
    assert (DEFAULT_DIR / "deepspeed_shm_comm").is_dir()  # built by make install
    code = ("import os; from stages.ranks.launch import init_distributed; init_distributed('cpu'); "
            "print(os.environ['TORCH_EXTENSIONS_DIR'])")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    run = lambda e: subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                                   cwd=DEFAULT_DIR.parent.parent, check=True).stdout.strip()
    assert run(env) == str(DEFAULT_DIR)
    assert run({**env, "TORCH_EXTENSIONS_DIR": "/tmp/elsewhere"}) == "/tmp/elsewhere"


def test_a_stale_build_lock_is_removed_and_a_live_build_waited_for(tmp_path, monkeypatch):
    """The reliability probe's hang: `touch .../deepspeed_shm_comm/lock` made every later update
    wait forever. Now: a lock no live process builds under is removed after the grace; while a
    process works in the build folder (a build) it is kept."""
    import threading
    import time

    from stages.ranks.deepspeed_ops import clear_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = tmp_path / "deepspeed_shm_comm"
    build.mkdir()
    (build / "lock").touch()
    t0 = time.time()
    assert clear_stale_build_locks(grace_s=1.0) == [build / "lock"]
    assert not (build / "lock").exists() and time.time() - t0 < 10
    (build / "lock").touch()
    ninja = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=build)
    try:
        done = []
        waiter = threading.Thread(target=lambda: done.append(clear_stale_build_locks(grace_s=1.0)))
        waiter.start()
        time.sleep(3)
        assert (build / "lock").exists() and not done  # a live build: waited for
    finally:
        ninja.kill()
        ninja.wait()
    waiter.join(timeout=20)
    assert done == [[build / "lock"]]


def private_op_folder(tmp_path):
    """A copy of `make install`'s prebuilt op folder (mtimes kept: nothing is rebuilt) to plant a
    lock in: one planted in the shared folder is every concurrent test's too (each run clears stale
    locks, after their grace), which both delayed those tests and raced this one's removal."""
    import shutil

    shutil.copytree(DEFAULT_DIR / "deepspeed_shm_comm", tmp_path / "deepspeed_shm_comm", symlinks=True)
    (tmp_path / "deepspeed_shm_comm" / "lock").unlink(missing_ok=True)
    return tmp_path, tmp_path / "deepspeed_shm_comm" / "lock"


def test_a_planted_build_lock_does_not_hang_the_update_set_up(tmp_path):
    """A lock planted in a prebuilt op folder (as an interrupted build leaves it): building an
    update's DeepSpeed engine (which loads the comm op) finishes and the lock is gone. Before,
    the load waited for the lock forever."""
    folder, lock = private_op_folder(tmp_path)
    code = ("import torch; from stages.ranks.launch import init_distributed; "
            "from stages.training.engine import make_engine; init_distributed('cpu'); "
            "make_engine(torch.nn.Linear(2, 2), {'lr': 1e-3}, {'train_micro_batch_size_per_gpu': 1, "
            "'gradient_accumulation_steps': 1, 'zero_optimization': {'stage': 2}, "
            "'zero_allow_untested_optimizer': True}); print('ready')")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder)}
    lock.touch()
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=180, cwd=DEFAULT_DIR.parent.parent)
    assert run.returncode == 0 and "ready" in run.stdout, run.stderr[-2000:]
    assert f"removed the stale DeepSpeed op build lock {lock}" in run.stderr and not lock.exists()


def test_a_planted_build_lock_does_not_hang_make_installs_prebuild(tmp_path):
    """`python -m stages.ranks.deepspeed_ops` (make install) after an interrupted build: the lock
    that build left is removed, naming it, and the op is ready (the prebuilt one: no build). Before,
    it waited forever."""
    folder, lock = private_op_folder(tmp_path)
    so = folder / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    built_at = so.stat().st_mtime
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder)}
    lock.touch()
    run = subprocess.run([sys.executable, "-m", "stages.ranks.deepspeed_ops"], env=env, capture_output=True,
                         text=True, timeout=180, cwd=DEFAULT_DIR.parent.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"removed the stale DeepSpeed op build lock {lock}" in run.stderr
    assert f"DeepSpeed CPU comm op ready: {so}" in run.stderr and so.stat().st_mtime == built_at
