"""`stagerl train` whose local Prefect server's disk fills up mid-run (PREFECT_HOME on a small
tmpfs, then filled): the server answers HTTP 500 (SQLite cannot write) and the run ends with a
message that names the full disk and the resume command, not a bare "500 Internal Server Error";
once there is room, that command completes the run."""
import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.artifacts import read_manifest
from storage.layout import RunLayout
from storage.store import Store
from storage.weights import list_weights
from test_flows import PROJECT, tiny_overrides

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MB tmpfs (root only: the CI machine runs the tests as root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not root?): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)



def run_then_fill_disk(cmd, env, root, experiment, stage, small_disk, before_fill=None):
    """Start `cmd` (a training run of `experiment`), wait until step 1's `stage` is committed, then
    (after `before_fill()`, when given) fill the disk (after the advantage: while the update
    trains). (process, store, layout)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    store, layout = Store.from_config({"root": str(root)}), RunLayout(PROJECT, experiment)
    deadline = time.time() + 300
    while read_manifest(store, layout, 1, stage) is None:
        assert proc.poll() is None and time.time() < deadline, f"step 1's {stage} did not finish"
        time.sleep(0.02)
    if before_fill is not None:
        before_fill()
    fill_disk(small_disk)
    return proc, store, layout


def truncate_wal(db: Path) -> None:
    """Checkpoint the server's SQLite database and truncate its write-ahead log to nothing: a WAL
    file keeps its size for reuse, so without this the run's few writes after the disk is full
    may fit in space the file already has (the server records task runs in batches: it writes
    little) and never meet the full disk."""
    with contextlib.closing(sqlite3.connect(db, timeout=60)) as con:
        busy, _, _ = con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    assert busy == 0, f"{db}: the checkpoint could not truncate the write-ahead log"
    assert db.with_name(db.name + "-wal").stat().st_size == 0


def fill_disk(small_disk) -> None:
    """Write zeros into small_disk/filler until the disk is full."""
    with open(small_disk / "filler", "wb") as filler:
        try:
            while True:
                filler.write(b"\0" * (1 << 20))
                filler.flush()
        except OSError:
            pass

def test_a_full_disk_under_the_prefect_server_is_named(small_disk, tmp_path):
    from stages.data.tools import write_arith_dataset
    from stages.model.tiny import save_tiny_model

    assets = tmp_path / "assets"
    save_tiny_model(assets / "model")
    write_arith_dataset(assets / "train.parquet", n=40)
    write_arith_dataset(assets / "test.parquet", n=8, split="test")
    root = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "STAGERL_"))}
    env.update(PREFECT_HOME=str(small_disk / "prefect"), PYTHONUNBUFFERED="1")
    cli = [sys.executable, "-m", "flows.cli"]
    args = ["train", "--config", "tiny-cpu", "--experiment", "d", *tiny_overrides(assets, root, steps=4)]
    proc, store, layout = run_then_fill_disk([*cli, *args], env, root, "d", "rollout", small_disk,
                                             before_fill=lambda: truncate_wal(small_disk / "prefect" / "prefect.db"))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-4000:]
    assert ("error: the local Prefect server (http://127.0.0.1:" in out
            and f"cannot write its database: the disk of PREFECT_HOME {small_disk / 'prefect'} is full"
            in out), out[-4000:]
    command = out.split("then `", 1)[1].split("`", 1)[0]
    assert command == f"stagerl resume {PROJECT}/d --root {root}"
    (small_disk / "filler").unlink()
    resumed = subprocess.run([*cli, *command.split()[1:]], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert list_weights(store, layout) == [4]


def test_a_full_store_disk_names_the_failed_commit_and_the_resume_command(small_disk, tmp_path):
    """The store's disk fills up while step 1's update trains: its background commit fails (retried,
    then given up), then the next write of the run (the lock's refresh at step 2) fails too. The
    run's last line names the commit that failed (the update of step 1, the object being written)
    and the resume command, not the lock write; once there is room, that command completes the run."""
    from stages.data.tools import write_arith_dataset
    from stages.model.tiny import save_tiny_model

    assets = tmp_path / "assets"
    save_tiny_model(assets / "model")
    write_arith_dataset(assets / "train.parquet", n=40)
    write_arith_dataset(assets / "test.parquet", n=8, split="test")
    root = small_disk / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "STAGERL_"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PYTHONUNBUFFERED="1")  # Prefect has room
    cli = [sys.executable, "-m", "flows.cli"]
    args = ["train", "--config", "tiny-cpu", "--experiment", "full", *tiny_overrides(assets, root, steps=2),
            f"storage.cache_dir={tmp_path / 'cache'}"]
    proc, store, layout = run_then_fill_disk([*cli, *args], env, root, "full", "advantage", small_disk)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-4000:]
    assert read_manifest(store, layout, 1, "update") is None
    last = out.strip().splitlines()[-1]
    command = f"stagerl resume {PROJECT}/full --root {root}"
    assert last.startswith("error: the update of step 1 trained, but its commit to the store failed "
                           "(StoreError: "), out[-4000:]
    assert f"{root}/{PROJECT}/full/" in last  # the object being written
    assert "No space left on device" in last and last.endswith(f"`{command}` runs it again"), last
    (small_disk / "filler").unlink()
    resumed = subprocess.run([*cli, *command.split()[1:]], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert list_weights(store, layout) == [2]
