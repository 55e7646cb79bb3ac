"""DeepSpeed's prebuilt CPU comm op is built and loaded with one ninja: the Python environment's
own, whatever PATH says (two ninja versions over one build folder rebuild it each time)."""
import os
import sys

from stages.deepspeed_ops import same_ninja


def test_the_environments_ninja_comes_first_on_path(monkeypatch):
    bindir = os.path.dirname(sys.executable)
    assert os.path.exists(os.path.join(bindir, "ninja"))  # pip's ninja, a dependency of the install
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", bindir, "/bin"]))
    same_ninja()
    assert os.environ["PATH"].split(os.pathsep) == [bindir, "/usr/bin", "/bin"]
    same_ninja()  # idempotent
    assert os.environ["PATH"].split(os.pathsep) == [bindir, "/usr/bin", "/bin"]
