"""Scratch folders (stages.scratch): named after their process and host, so that a run removes the
ones a killed process left behind, and only those; `stagerl resume` refuses a name with '..'."""
import subprocess
import sys
from pathlib import Path

from flows.cli import main
from stages.scratch import _host, remove_orphans, scratch_dir


def test_orphans_of_dead_processes_on_this_host_are_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)  # that process has exited
    host = _host()
    orphan = tmp_path / f"stagerl-update-{dead_pid}-{host}-000003-abc"
    other_host = tmp_path / f"stagerl-update-{dead_pid}-otherhost-000003-abc"
    unrelated = tmp_path / f"stagerl-notes-{dead_pid}-{host}-x"
    for folder in (orphan, other_host, unrelated):
        (folder / "actor").mkdir(parents=True)
        (folder / "actor" / "model.safetensors").write_bytes(b"x" * 1000)
    mine = scratch_dir("pool")  # this (live) process's folder
    assert mine.parent == tmp_path and mine.name.startswith("stagerl-pool-") and f"-{host}-" in mine.name
    shm = Path("/dev/shm") / f"stagerl-update-{dead_pid}-{host}-000003-version-test"  # a handoff's folder
    if shm.parent.is_dir():
        shm.mkdir()
    removed = remove_orphans()
    assert [p for p in removed if p.parent == tmp_path] == [orphan]
    assert not shm.exists() and (shm in removed or not shm.parent.is_dir())
    assert not orphan.exists() and other_host.exists() and unrelated.exists() and mine.exists()


def test_resume_with_a_path_for_a_name_is_refused(tmp_path, capsys):
    assert main(["resume", "../../etc", "--root", str(tmp_path)]) == 2
    assert "error: experiment '../../etc': invalid project name '..'" in capsys.readouterr().out
