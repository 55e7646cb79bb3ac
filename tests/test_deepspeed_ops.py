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
