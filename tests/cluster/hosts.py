"""Hosts in a box: each test host is a Linux network namespace on a private bridge, with its own
hostname, PID namespace and a private tmpfs for its HOME and TMPDIR (tests/cluster/hostinit.py).

    with Cluster(["ctl", "inf", "trn1", "trn2"]) as c:     # root only
        proc = c["ctl"].spawn(["prefect", "server", "start", ...], env=..., log="server")
        c["trn2"].link(False)                               # pull trn2's cable; link(True) plugs it back

- The bridge lives in a namespace of its own (`<prefix>-sw`): nothing is added to the machine's
  own network namespace, the hosts have no default route and no NAT, so their traffic can only
  reach each other (addresses SUBNET.10+i) and their own loopback.
- Host names resolve through a private /etc/hosts (bind-mounted inside each host), no DNS.
- The checkout and its .venv are shared read-only between hosts, like an image; BASE/image holds
  what every host may read (model, data, hostfile). BASE/host is each host's own tmpfs (the same
  path on every host, different contents): the only data path between hosts is the network.
- Everything is removed by close() (also on an exception, SIGTERM or SIGINT): killing a host's
  PID 1 ends every process of that host; then the namespaces and the folder go. A cluster left
  by a killed test (its owner process gone) is removed by the next Cluster() (remove_stale).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUBNET = "10.213.18"  # addresses exist only inside this cluster's own namespaces
STATE = "cluster.json"
BASE_PREFIX = "stagerl-cluster-"


def sh(*cmd, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({out.returncode}): {out.stderr.strip()}")
    return out


class Host:
    def __init__(self, cluster: "Cluster", name: str, index: int):
        self.cluster, self.name = cluster, name
        self.addr = f"{SUBNET}.{10 + index}"
        self.netns = f"{cluster.prefix}-{name}"
        self.port = f"v{index}"  # its switch port (the veth end in the bridge's namespace)
        self.pid1: int | None = None
        self.holder: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []

    # ---- life cycle ---------------------------------------------------------------------------
    def boot(self, timeout: float = 30.0) -> None:
        """Start the host's PID 1 (hostinit.py) in its namespaces and wait until it is ready."""
        base = self.cluster.base
        ready = base / "run" / f"{self.name}.ready"
        ready.unlink(missing_ok=True)
        self.holder = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount", "--pid", "--fork",
             "--mount-proc", "--propagation", "private", "--kill-child=SIGKILL",
             sys.executable, str(HERE / "hostinit.py"), self.name, str(base)],
            stdout=open(base / "logs" / f"{self.name}-init.log", "ab"), stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.time() + timeout
        while not ready.exists():
            if self.holder.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"host {self.name} did not boot: "
                                   f"{(base / 'logs' / f'{self.name}-init.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.pid1 = _child_of(self.holder.pid)
        self.cluster.save_state()

    def crash(self) -> None:
        """Every process of the host dies at once, as in a power loss: the processes started here
        (SIGKILL to their groups, while the host's PID 1 still reaps them), then its PID 1 (the
        kernel kills whatever else lives in its PID namespace)."""
        for p in self.procs:
            _kill_group(p)
        if self.pid1:
            _kill(self.pid1)
        if self.holder is not None:
            _kill(self.holder.pid)
            self.holder.wait()
        self.procs, self.pid1, self.holder = [], None, None
        reap_orphans(0.5)

    def link(self, up: bool) -> None:
        """Plug (True) or pull (False) the host's cable: its switch port up or down."""
        sh("ip", "-n", self.cluster.switch, "link", "set", self.port, "up" if up else "down")

    # ---- running things -----------------------------------------------------------------------
    def command(self, cmd: list, cwd=None) -> list:
        if not self.pid1:
            raise RuntimeError(f"host {self.name} is down")
        return ["nsenter", "-t", str(self.pid1), "-n", "-m", "-u", "-p", f"--wd={cwd or '/'}", "--",
                *[str(c) for c in cmd]]

    def spawn(self, cmd: list, env: dict, log: str, cwd=None) -> subprocess.Popen:
        """Start `cmd` on this host in the background; its output goes to BASE/logs/<host>-<log>.log."""
        path = self.cluster.base / "logs" / f"{self.name}-{log}.log"
        proc = subprocess.Popen(self.command(cmd, cwd), env=env, stdout=open(path, "ab"),
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        proc.log = path
        self.procs.append(proc)
        return proc

    def run(self, cmd: list, env: dict, cwd=None, timeout: float = 300, check: bool = True):
        out = subprocess.run(self.command(cmd, cwd), env=env, capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)
        if check and out.returncode != 0:
            raise RuntimeError(f"{self.name}$ {' '.join(map(str, cmd))} failed ({out.returncode}):\n"
                               f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def path(self, private: str) -> Path:
        """A path of this host's private tmpfs (BASE/host/...) as seen from outside the host."""
        return Path(f"/proc/{self.pid1}/root") / str(self.cluster.base / "host").lstrip("/") / private

    @property
    def home(self) -> Path:
        return self.cluster.base / "host" / "home"

    @property
    def tmp(self) -> Path:
        return self.cluster.base / "host" / "tmp"


class Cluster:
    def __init__(self, names: list[str]):
        if os.geteuid() != 0:
            raise PermissionError("network-namespace hosts need root")
        remove_stale()
        self.prefix = f"srl{secrets.token_hex(3)}"
        self.switch = f"{self.prefix}-sw"
        self.base = Path(tempfile.mkdtemp(prefix=BASE_PREFIX))
        self.base.chmod(0o755)
        self.hosts = {n: Host(self, n, i) for i, n in enumerate(names)}
        self._closed = False

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def save_state(self) -> None:
        state = {"owner": os.getpid(), "netns": [h.netns for h in self.hosts.values()] + [self.switch],
                 "pids": [p for h in self.hosts.values() for p in (h.pid1, h.holder and h.holder.pid) if p]}
        (self.base / STATE).write_text(json.dumps(state))

    def start(self) -> "Cluster":
        become_subreaper()
        for sub in ("run", "logs", "etc", "host", "image"):
            (self.base / sub).mkdir(exist_ok=True)
        (self.base / "etc" / "hosts").write_text(
            "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in self.hosts.values()))
        (self.base / "etc" / "resolv.conf").write_text("")
        self.save_state()
        sh("ip", "netns", "add", self.switch)
        self.save_state()
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts.values():
            sh("ip", "netns", "add", host.netns)
            self.save_state()
            sh("ip", "-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0",
               "netns", host.netns)
            sh("ip", "-n", self.switch, "link", "set", host.port, "master", "br0", "up")
            sh("ip", "-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
            sh("ip", "-n", host.netns, "link", "set", "lo", "up")
            host.boot()
        return self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            host.crash()
        reap_orphans()
        _teardown(json.loads((self.base / STATE).read_text()) if (self.base / STATE).exists() else
                  {"netns": [h.netns for h in self.hosts.values()] + [self.switch], "pids": []}, self.base)

    def __enter__(self) -> "Cluster":
        self._old = {s: signal.signal(s, _raise_exit) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
        for s, handler in self._old.items():
            signal.signal(s, handler)


def become_subreaper() -> None:
    """Orphans of the hosts' killed processes become this process's children (not the machine's
    init's), so reap_orphans() collects them: no zombie is left behind."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reap_orphans(wait_s: float = 3.0) -> None:
    """Collect exited children for up to `wait_s` (until none is left to wait for)."""
    deadline = time.time() + wait_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.time() > deadline:
                return
            time.sleep(0.05)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)  # runs close() through the with block


def _child_of(pid: int) -> int:
    """The PID (in this namespace) of `pid`'s only child: the host's PID 1 made by unshare --fork."""
    for _ in range(100):
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            except OSError:
                continue
            if fields.get("PPid", "").strip() == str(pid):
                return int(fields["Pid"])
        time.sleep(0.05)
    raise RuntimeError(f"no child of {pid}")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _teardown(state: dict, base: Path) -> None:
    for pid in state.get("pids", []):
        try:  # only this cluster's own PID 1s and holders (their command line names its folder)
            mine = str(base).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if mine:
            _kill(pid)  # a host's PID 1: every process of the host goes with it
    time.sleep(0.2)
    for ns in state.get("netns", []):
        sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(base, ignore_errors=True)


def remove_stale() -> list[str]:
    """Remove clusters whose owner process is gone (a test killed before its clean-up)."""
    removed = []
    for base in Path(tempfile.gettempdir()).glob(f"{BASE_PREFIX}*"):
        try:
            state = json.loads((base / STATE).read_text())
        except (OSError, ValueError):
            continue
        try:
            os.kill(int(state["owner"]), 0)
            continue  # its test still runs
        except ProcessLookupError:
            pass
        _teardown(state, base)
        removed.append(str(base))
    return removed
