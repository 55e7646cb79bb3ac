"""A local `prefect server start` that dies with the process that started it.

`stagerl train` without PREFECT_API_URL used to let Prefect start its temporary (ephemeral)
uvicorn server; when stagerl was SIGKILLed that server ran on forever. `local_server()` instead
starts `prefect server start --host 127.0.0.1 --port <free>` as a child in its own session
(terminal signals do not reach it) that receives SIGTERM when its parent exits, however it exits
(Linux PR_SET_PDEATHSIG), is stopped (TERM, then KILL) on a normal exit, and while it runs has
a record `$PREFECT_HOME/stagerl-server-<parent pid>.json` ({"pid", "port", "api_url", "parent"})
and its output in `.log` beside it (both removed on a clean stop, or by the next start once the
parent is dead). PR_SET_PDEATHSIG fires when the parent *thread* exits: call it from the main
thread.

The server is this run's alone, so it runs only the services a training run uses: it records
flow and task runs, logs and artifacts, and leaves out the ones that act on what such a run never
has (deployment schedules and late runs, work pools' workers, paused runs, automations,
concurrency leases, cancellation clean-up) and the event store (`prefect events`; the UI, which is
off). On this 2-core machine that cut the server's CPU from ~0.4 to ~0.25 s per training step
(bench/peer_trl.py's prefect_server_cpu_s). Its task run recorder writes the task runs' states in
batches, at least once a second (SERVER_SETTINGS), not one SQLite transaction per state change
(Prefect's default, batch size 1): a 20-step run of bench/peer_trl.py's work (five stage task
runs, 15 state changes a step) cost the server 3.4 s of CPU that way and 1.7 s batched, on a
machine whose step takes ~1 s. The states reach the API at most a second late; the ones still
queued are written when the server stops (SIGTERM). A PREFECT_SERVER_SERVICES_* variable in the
environment still wins.

If the server dies while the run goes on (killed, out of memory), `LocalServer.watch` stops the
run within seconds, naming the server, its exit code and its log, and saying how to continue
(every completed stage is in the store; a stopped run is like a SIGKILLed one)."""
from __future__ import annotations

import contextlib
import _thread
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
UNUSED_SERVICES = ("SCHEDULER", "LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS", "TRIGGERS", "REPOSSESSOR",
                   "CANCELLATION_CLEANUP", "CLEANUP_RECONCILER", "EVENT_PERSISTER")  # see above
SERVER_SETTINGS = {"TASK_RUN_RECORDER_BATCH_SIZE": "100",  # the default is 1: a transaction per event
                   "TASK_RUN_RECORDER_FLUSH_INTERVAL": "1"}  # seconds; Prefect truncates it to an int
PID_FILE_PREFIX = "stagerl-server-"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent_pid: int):
    """preexec_fn: SIGTERM this child when the thread that forked it exits (prctl is looked up
    here, before the fork, so the child only calls it)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    zero = ctypes.c_ulong(0)

    def set_pdeathsig() -> None:
        if prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM), zero, zero, zero) != 0:
            os._exit(126)  # cannot promise to die with the parent: do not run at all
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(0)
    return set_pdeathsig


def pid_file(home: Path, parent_pid: int | None = None) -> Path:
    return Path(home) / f"{PID_FILE_PREFIX}{parent_pid or os.getpid()}.json"


def _remove_stale_files(home: Path) -> None:
    """Records and logs left by a stagerl process that was killed (its server died with it)."""
    for path in Path(home).glob(f"{PID_FILE_PREFIX}*.json"):
        try:
            os.kill(int(path.stem[len(PID_FILE_PREFIX):]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            path.with_suffix(".log").unlink(missing_ok=True)
        except (ValueError, PermissionError):
            pass


def _stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class LocalServer:
    """A started server: `api_url`, `proc`, `log`, `started_s` (seconds until /api/health
    answered, counted from the start)."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path, t0: float):
        self.proc, self.port, self.log, self.t0 = proc, port, log, t0
        self.api_url = f"http://127.0.0.1:{port}/api"
        self.started_s: float | None = None

    died: str | None = None  # the message printed when the server died while watched

    def watch(self, next_step: str, grace_s: float = 10.0, poll_s: float = 0.5) -> None:
        """Check the server every `poll_s` in a daemon thread until `unwatch()`. When it has
        exited: print why the run stops and `next_step`, interrupt the main thread
        (KeyboardInterrupt), and if the process is still alive `grace_s` later, end it
        (os._exit(1)): Prefect's clients would otherwise retry against the closed port for
        minutes."""
        self._watching = threading.Event()

        def run() -> None:
            while not self._watching.wait(poll_s):
                code = self.proc.poll()
                if code is None:
                    continue
                self.died = (f"error: the local Prefect server (pid {self.proc.pid}, {self.api_url}) "
                             f"exited with code {code} during the run (its log: {self.log}); the "
                             f"run stops. Every completed stage is in the store: continue with "
                             f"`{next_step}`")
                print(self.died, flush=True)
                _thread.interrupt_main()
                if not self._watching.wait(grace_s):
                    print(f"error: the run did not stop within {grace_s:.0f}s of the Prefect "
                          f"server's exit: ending the process", flush=True)
                    sys.stdout.flush()
                    os._exit(1)
                return

        threading.Thread(target=run, name="prefect-server-watch", daemon=True).start()

    def unwatch(self) -> None:
        """Stop watching (before the server is stopped on purpose, or once the run has stopped)."""
        watching = getattr(self, "_watching", None)
        if watching is not None:
            watching.set()

    def wait_healthy(self, timeout: float = 120.0) -> "LocalServer":
        """Block until /api/health answers (counted from the start); raises if it exits first."""
        t0 = self.t0
        deadline = t0 + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
                raise RuntimeError(f"`prefect server start` exited with {self.proc.returncode} "
                                   f"before answering on {self.api_url} (log {self.log}):\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                    if response.status == 200:
                        self.started_s = round(time.perf_counter() - t0, 3)
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the local Prefect server did not answer on {self.api_url} within "
                           f"{timeout:.0f}s (log {self.log}); set PREFECT_API_URL to use a running "
                           f"server instead")


@contextlib.contextmanager
def local_server(home: str | os.PathLike):
    """Start `prefect server start` on a free port with PREFECT_HOME=home (analytics and UI off)
    and yield its LocalServer at once (its api_url is known before it answers: call
    `wait_healthy()`); stop it on exit. Sets nothing in os.environ: the caller does."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("local_server() must run in the main thread: the server is tied to "
                           "the thread that starts it (PR_SET_PDEATHSIG)")
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    _remove_stale_files(home)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_SERVER_UI_ENABLED": "false", "PREFECT_CLI_COLORS": "false"})
    for service in UNUSED_SERVICES:
        env.setdefault(f"PREFECT_SERVER_SERVICES_{service}_ENABLED", "false")
    for key, value in SERVER_SETTINGS.items():
        env.setdefault(f"PREFECT_SERVER_SERVICES_{key}", value)
    port = free_port()
    record = pid_file(home)
    log = record.with_suffix(".log")
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
             "--port", str(port)], stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()))
    server = LocalServer(proc, port, log, t0)
    try:
        record.write_text(json.dumps({"pid": proc.pid, "port": port, "api_url": server.api_url,
                                      "parent": os.getpid()}))
        yield server
    finally:
        server.unwatch()
        _stop(proc)
        record.unlink(missing_ok=True)
        if proc.returncode in (0, -signal.SIGTERM):  # a clean stop: its log is not needed
            log.unlink(missing_ok=True)
