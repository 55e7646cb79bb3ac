"""What a per-call rank launch (stages.ranks.launch) and the rank pool (stages.ranks.pool) share: the
checkout root ranks run in, free ports, the context payload a rank rebuilds its StageContext
from, stopping a launcher's process group, the exception a failed job raises (a storage
error on a rank stays retryable by the training flow), and the pool's doorbells."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

from storage.store import StoreError

REPO_ROOT = Path(__file__).resolve().parents[2]
# The last line of a rank's traceback names the exception: these are storage I/O (an S3 outage),
# retried by the training flow as if raised in its own process; these others never are.
STORAGE_ERRORS = ("storage.store.StoreError", "ConnectionError", "ConnectionResetError",
                  "ConnectionRefusedError", "ConnectionAbortedError", "TimeoutError",
                  "botocore.exceptions.EndpointConnectionError", "botocore.exceptions.ConnectTimeoutError",
                  "botocore.exceptions.ReadTimeoutError", "aiohttp.client_exceptions.ClientConnectorError")
NEVER_RETRIED = ("ValueError", "KeyError", "TypeError", "MemoryError", "torch.OutOfMemoryError")


# How a launcher says which rank died first: torchrun's "Root Cause (first observed failure)" block
# (torch.distributed.elastic: host, rank, exit code and pid), the fork server's group leader's line
# (stages.ranks.zygote_server._lead_group).
TORCHRUN_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?host\s*:\s*(\S+)\s*"
                                 r"rank\s*:\s*(\d+)[^\n]*\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)", re.S)
FORKED_RANK_EXIT = re.compile(r"zygote group: rank (\d+) \(pid (\d+), host (\S+)\) exited with code (-?\d+)")


def exit_meaning(code: int) -> str:
    """"killed by SIGKILL" for a negative exit code (a signal), else "exit code N"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def dead_rank(launcher_stderr: str) -> str | None:
    """"rank R (pid P, host H) died (killed by SIGKILL)" for the first rank whose process ended
    badly, from what its launcher (torchrun, or the fork server's group leader) wrote on stderr;
    None when it says nothing of one."""
    found = [(m.start(), m.group(2), m.group(4), m.group(1), int(m.group(3)))
             for m in TORCHRUN_ROOT_CAUSE.finditer(launcher_stderr)]
    found += [(m.start(), m.group(1), m.group(2), m.group(3), int(m.group(4)))
              for m in FORKED_RANK_EXIT.finditer(launcher_stderr)]
    if not found:
        return None
    _, rank, pid, host, code = min(found)
    return f"rank {rank} (pid {pid}, host {host}) died ({exit_meaning(code)})"


class RankStorageError(StoreError):
    """A job failed on its ranks with a storage error: retryable like a StoreError raised here."""


def job_error(message: str, error_texts: list[str]) -> RuntimeError:
    """The exception for a failed job: RankStorageError when a rank failed on storage I/O and no
    rank on bad input or memory (the others then only lost their peer), else RuntimeError."""
    names = []
    for text in error_texts:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        if lines:
            names.append(lines[-1].split(":", 1)[0].strip())
    storage = any(n in STORAGE_ERRORS for n in names) and not any(n in NEVER_RETRIED for n in names)
    return (RankStorageError if storage else RuntimeError)(message)


def free_port() -> int:
    """A port free on every local address: torch's TCPStore listens on the wildcard address, so a
    port free on 127.0.0.1 alone can still be taken on another interface (EADDRINUSE at init)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def context_payload(ctx) -> dict:
    """What a rank process needs to rebuild `ctx`: a StageContext, or any JSON-able object."""
    if hasattr(ctx, "to_json"):
        return {"kind": "stage_context", "data": json.loads(ctx.to_json())}
    return {"kind": "json", "data": ctx}


def context_from_payload(payload: dict):
    if payload["kind"] == "stage_context":
        from stages.context import StageContext

        return StageContext.from_json(json.dumps(payload["data"]))
    return payload["data"]


def kill_group(proc: subprocess.Popen) -> None:
    """Stop the launcher and its rank processes (their own session, started by us)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


POLL_S = 0.005  # a Doorbell without its pipe: seconds between looks at the folder


class Doorbell:
    """A named pipe in a rank pool's work dir that wakes the process waiting on it at once.

    The pool's protocol stays its files (job_<id>.json, result_<id>_<rank>.json, stop): a writer
    writes its file first, then rings (`Doorbell.ring`: one byte, never blocking, nothing when no
    one listens); the reader checks its files, then waits in select() on the pipe for at most
    `timeout_s`. A ring between the check and the wait stays in the pipe, so it is never lost,
    and a missing ring (another reader that took the byte) only leaves the reader to its
    timeout. Where no pipe can be made (a file system without them), wait() sleeps POLL_S, the
    old polling: both sides slept 5 ms between looks at the folder, 2.5 ms on average to see a
    job and as long to see its result.
    A pipe is local to one machine, as the pool's work dir is read on the pool's machine only."""

    def __init__(self, path):
        self.path, self.fd = Path(path), None
        try:
            os.mkfifo(self.path)
        except FileExistsError:
            pass
        except OSError:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)  # read-write: never blocks, never EOF
        except OSError:
            return
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            self.fd = fd
        else:  # something else has the name: poll
            os.close(fd)

    def wait(self, timeout_s: float) -> bool:
        """Until a ring (True: the pipe is drained) or timeout_s (False)."""
        if self.fd is None:
            time.sleep(min(timeout_s, POLL_S))
            return False
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if not ready:
            return False
        try:
            os.read(self.fd, 65536)
        except BlockingIOError:
            pass
        return True

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @staticmethod
    def ring(path) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no pipe there, or no one waits on it (ENXIO)
            return
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, b"\0")
        except OSError:  # a full pipe (EAGAIN) wakes its reader anyway
            pass
        finally:
            os.close(fd)
