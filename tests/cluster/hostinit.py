"""PID 1 of one cluster-test host (tests/cluster/hosts.py starts it in the host's own network, UTS,
mount and PID namespaces):

    hostinit.py NAME BASE

Gives the host its name (hostname), a private tmpfs at BASE/host (its HOME, TMPDIR, Prefect home,
caches: no other host sees it), a private /run, and /etc/hosts + an empty /etc/resolv.conf from
BASE/etc (names of the test hosts only, no DNS server). Then it reaps orphans until it is killed;
when it dies the kernel kills every process of the host (the PID namespace ends with it)."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    name, base = sys.argv[1], Path(sys.argv[2])
    socket.sethostname(name)
    for cmd in (["mount", "-t", "tmpfs", "-o", "size=4g,mode=0755", f"stagerl-{name}", str(base / "host")],
                ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", f"run-{name}", "/run"],
                ["mount", "--bind", str(base / "etc" / "hosts"), "/etc/hosts"],
                ["mount", "--bind", str(base / "etc" / "resolv.conf"), "/etc/resolv.conf"]):
        subprocess.run(cmd, check=True)
    for sub in ("home", "tmp", "work"):
        (base / "host" / sub).mkdir(parents=True, exist_ok=True)
    os.mkdir("/run/sshd", 0o755)
    (base / "run" / f"{name}.ready").write_text(str(os.getpid()))
    while True:  # reap every orphan of the host
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.5)


if __name__ == "__main__":
    main()
