"""Real Prefect processes for tests: `prefect server start` (SQLite in a scratch PREFECT_HOME,
analytics off, a free port) and process workers, each started in its own session and stopped
by PID (TERM to its process group, then KILL)."""
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _s3_server import free_port

PREFECT = str(Path(sys.executable).with_name("prefect"))


def prefect_env(home, api_url=None, **extra) -> dict:
    env = dict(os.environ)
    env.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1",
                "PREFECT_CLI_PROMPT": "false", "PREFECT_CLI_COLORS": "false",
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"})
    if api_url:
        env["PREFECT_API_URL"] = api_url
    env.update({k: str(v) for k, v in extra.items()})
    return env


def stop(*procs: subprocess.Popen, timeout: float = 10.0) -> None:
    """TERM the process groups the test started (each led by one of `procs`) all at once, then
    KILL what is left after `timeout` seconds (a worker may take long to wind down)."""
    procs = [p for p in procs if p is not None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None or _group_alive(p.pid)]
        if not live:
            return
        for proc in live:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + timeout
        while time.time() < deadline and any(p.poll() is None or _group_alive(p.pid) for p in live):
            time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class PrefectServer:
    """`with PrefectServer(tmp) as srv: srv.api_url` — a real server on SQLite."""

    def __init__(self, home):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.proc = None
        self.workers = []
        self.log = self.home / "server.log"

    def env(self, **extra) -> dict:
        return prefect_env(self.home, self.api_url, **extra)

    def start(self, timeout: float = 180.0) -> "PrefectServer":
        self.proc = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env=self.env(),
            start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited: {self.log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.api_url}/health", timeout=2).read()
                return self
            except Exception:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"prefect server did not answer on {self.api_url}")

    def cli(self, *args, cwd=None, timeout=300, check=True, env=None):
        out = subprocess.run([PREFECT, *args], cwd=cwd, env=env or self.env(), timeout=timeout,
                             capture_output=True, text=True)
        if check and out.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} failed ({out.returncode}):\n"
                               f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def start_worker(self, pool: str, cwd, env: dict) -> subprocess.Popen:
        log = self.home / f"worker-{pool}-{len(self.workers)}.log"
        proc = subprocess.Popen([PREFECT, "worker", "start", "--pool", pool, "--type", "process"],
                                cwd=cwd, env=env, stdout=open(log, "wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        proc.log = log
        self.workers.append(proc)
        return proc

    def stop(self) -> None:
        stop(*self.workers, self.proc)
        self.workers = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
