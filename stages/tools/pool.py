"""ToolWorkerPool: tool worker processes that live for a run, with a deadline per call.

Each worker is a spawned process that builds every tool of the config once (tools keep their
instances' state in their own memory, as verl's do) and runs one job at a time: execute, calc
reward or release on an instance, or verl's agent-loop `call` (create, execute, release). The
worker creates an instance the first time a job names it, from the create kwargs every job
carries, so a job sent to a fresh worker still finds its instance (with fresh state: the outcome
says `created`).

A job goes to a given slot (calls on one instance must reach the process holding it; they run in
the order submitted) or to any idle worker. `submit` returns a concurrent.futures.Future at once;
one dispatcher thread sends jobs, waits for answers and deadlines, and resolves the futures
(callbacks run on that thread: keep them short). As in the reward scorer pool
(stages/scoring/pool.py): a job past its deadline (counted from when it was sent) gets a
"timeout" outcome and its worker is killed and replaced; a worker that dies fails only its job
("exception") and is replaced; workers start lazily, when a job needs one (`start()` spawns them
all early). A future's result is always an outcome dict, never an exception: `error` is None or a
kind of stages.tools.base.ERROR_KINDS, `text` the response, plus `latency_s` (sent to answered)
and `queued_s`. Workers get their own temporary directory (TMPDIR), removed at close.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any, Mapping, Sequence

from stages.tools.base import ERROR_KINDS, ToolResponse
from stages.tools.registry import ToolSpec, build_tools

WORKER_STARTUP_TIMEOUT_S = 120.0
WORKER_EXIT_GRACE_S = 2.0


def error_outcome(kind: str, message: str, detail: str = "") -> dict:
    """An outcome for a call that failed: verl's response text for a failed tool call."""
    return {"error": kind, "text": f"Error when executing tool: {message}", "detail": detail or message}


# ---------------------------------------------------------------------------------------------
# In the worker process

class _Runner:
    """Runs jobs on the tools of one worker, keeping the instances it created."""

    def __init__(self, tools: dict):
        self.tools = tools
        self.live: dict[tuple[str, str], str] = {}   # (tool, key) -> the instance id create returned
        self.loop = None

    def wait(self, value):
        """A coroutine (verl's async tools) runs to completion on the worker's own event loop."""
        if inspect.isawaitable(value):
            import asyncio
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
            return self.loop.run_until_complete(value)
        return value

    def run(self, job: Mapping) -> dict:
        op, name, key = job["op"], job["tool"], job["key"]
        tool = self.tools.get(name)
        if tool is None:
            return error_outcome("unknown_tool", f"unknown tool {name!r}")
        created = False
        try:
            if op == "release":
                instance = self.live.pop((name, key), None)
                if instance is not None:
                    self.wait(tool.release(instance, **job.get("release_kwargs", {})))
                return {"error": None, "text": "", "released": instance is not None}
            instance = self.live.get((name, key))
            if instance is None:
                instance, _ = self.wait(tool.create(key, create_kwargs=dict(job.get("create_kwargs") or {})))
                created = True
                if op != "call":
                    self.live[(name, key)] = instance
            if op == "calc_reward":
                value = self.wait(tool.calc_reward(instance, **job.get("calc_reward_kwargs", {})))
                return {"error": None, "text": "", "value": value, "created": created}
            try:
                result = self.wait(tool.execute(instance, job["arguments"], **job.get("execute_kwargs", {})))
            finally:
                if op == "call":
                    self.wait(tool.release(instance, **job.get("release_kwargs", {})))
            return {**_unpack(result), "error": None, "created": created}
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the tool's failure is the call's answer
            kind = getattr(exc, "tool_error_kind", "exception")
            outcome = error_outcome(kind if kind in ERROR_KINDS else "exception", str(exc),
                                    f"{type(exc).__name__}: {exc}")
            return {**outcome, "created": created}


def _unpack(result: Any) -> dict:
    """verl's execute result (response, reward, metrics) as plain values."""
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(f"execute must return (response, reward, metrics), got {type(result).__name__}")
    response, reward, metrics = result
    if isinstance(response, str) or response is None:
        response = ToolResponse(text=response)
    text = getattr(response, "text", None)
    if text is not None and not isinstance(text, str):
        raise TypeError(f"the tool response's text must be a string, got {type(text).__name__}")
    if reward is not None and not isinstance(reward, (int, float)):
        raise TypeError(f"execute's reward must be a number or None, got {type(reward).__name__}")
    return {"text": text or "", "image": getattr(response, "image", None), "video": getattr(response, "video", None),
            "reward": None if reward is None else float(reward),
            "metrics": dict(metrics) if isinstance(metrics, Mapping) else ({} if metrics is None else {"value": metrics})}


def _worker_main(conn, specs: Sequence[ToolSpec], tmpdir: str | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    if tmpdir:
        os.environ["TMPDIR"] = tmpdir
        tempfile.tempdir = tmpdir
    try:
        runner = _Runner(build_tools(list(specs)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which refuses the pool
        conn.send(("load_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        job_id, job = message
        outcome = runner.run(job)
        try:
            conn.send(("done", job_id, outcome))
        except OSError:   # the parent is gone
            return
        except Exception as exc:  # noqa: BLE001 - e.g. metrics that cannot be pickled
            conn.send(("done", job_id, error_outcome("exception", f"the tool's result could not be sent back: {exc}")))


# ---------------------------------------------------------------------------------------------
# In the parent

@dataclasses.dataclass
class _Job:
    id: int
    request: dict
    timeout_s: float
    slot: int | None
    future: Future
    submitted: float
    sent: float = math.nan


class _Worker:
    def __init__(self, context, specs, tmpdir):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, specs, tmpdir), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.started_at = time.monotonic()
        self.job: _Job | None = None

    def deadline(self, startup_timeout_s: float) -> float:
        if not self.ready:
            return self.started_at + startup_timeout_s
        return self.job.sent + self.job.timeout_s if self.job else math.inf

    def send(self, job: _Job) -> None:
        self.job, job.sent = job, time.monotonic()
        try:
            self.conn.send((job.id, job.request))
        except OSError:   # it died: its closed pipe is seen by the next wait()
            pass

    def stop(self, deadline: float) -> None:
        """Ask an idle worker to exit (kill a busy one), wait until `deadline`, then kill."""
        if self.job is None:
            try:
                self.conn.send(None)
            except OSError:
                pass
        elif self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class ToolWorkerPool:
    """Tool worker processes for one tool config; see the module docstring. Thread-safe."""

    def __init__(self, specs: Sequence[ToolSpec], num_workers: int = 4, *,
                 startup_timeout_s: float = WORKER_STARTUP_TIMEOUT_S):
        if num_workers < 1 or startup_timeout_s <= 0:
            raise ValueError(f"num_workers must be >= 1 and startup_timeout_s > 0, got {num_workers}, "
                             f"{startup_timeout_s}")
        self.specs, self.num_workers, self.startup_timeout_s = list(specs), int(num_workers), float(startup_timeout_s)
        self._context = multiprocessing.get_context("spawn")
        self.tmpdir = tempfile.mkdtemp(prefix="stagerl-tools-")
        os.chmod(self.tmpdir, 0o711)  # the sandbox's directories live here; a snippet's uid must reach them
        self._workers: list[_Worker | None] = [None] * self.num_workers
        self._queues: list[deque[_Job]] = [deque() for _ in range(self.num_workers)]
        self._shared: deque[_Job] = deque()
        self._inbox: list[_Job] = []
        self._outstanding = [0] * self.num_workers   # per slot: submitted, not yet answered
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closing = self._spawn_all = False
        self.broken: str | None = None
        self._all_ready = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.tmpdir, True)
        self._thread = threading.Thread(target=self._run, name="tool-worker-pool", daemon=True)
        self._thread.start()

    # ---- the caller's side --------------------------------------------------------------------
    def submit(self, request: dict, timeout_s: float, slot: int | None = None) -> Future:
        """Queue one job (for `slot`, or any worker); its future resolves to an outcome dict."""
        if slot is not None and not 0 <= slot < self.num_workers:
            raise ValueError(f"slot {slot} is not one of the pool's {self.num_workers}")
        job = _Job(next(self._ids), request, float(timeout_s), slot, Future(), time.monotonic())
        with self._lock:
            closed = self._closing
            if not closed:
                self._inbox.append(job)
                if slot is not None:
                    self._outstanding[slot] += 1
        if closed:  # resolved outside the lock: callbacks may take their own locks
            job.future.set_result(error_outcome("exception", "the tool pool is closed"))
        else:
            self._wake()
        return job.future

    def outstanding(self, slot: int) -> int:
        """Jobs submitted for `slot` and not answered yet."""
        with self._lock:
            return self._outstanding[slot]

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in list(self._workers) if w is not None]

    def start(self, wait: bool = False, timeout: float | None = None) -> bool:
        """Spawn every worker now (and from then on respawn a replaced one at once); with
        wait=True block until all are ready (True; False on a timeout, or when they cannot start)."""
        with self._lock:
            self._spawn_all = True   # from now on a replaced worker is spawned again at once
            self._all_ready.clear()
        self._wake()
        return bool(self._all_ready.wait(timeout) and not self.broken) if wait else False

    def close(self) -> None:
        """Stop the workers (a call in flight gets an "exception" outcome); idempotent."""
        with self._lock:
            self._closing = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._cleanup()

    def __enter__(self) -> "ToolWorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already woken, or closed

    # ---- the dispatcher thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as exc:   # a bug here: every call still gets an answer, then it is raised
            self.broken = f"the tool pool's dispatcher failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._shutdown()

    def _step(self) -> bool:
        with self._lock:
            new, self._inbox = self._inbox, []
            closing, spawn_all = self._closing, self._spawn_all
        if closing:
            for job in new:
                self._finish(job, error_outcome("exception", "the tool pool was closed before the call ran"))
            return False
        for job in new:
            (self._queues[job.slot] if job.slot is not None else self._shared).append(job)
        if self.broken:
            self._fail_queued(error_outcome("exception", f"the tool workers cannot start: {self.broken}"))
        else:
            self._spawn(spawn_all)
            self._dispatch()
        live = [w for w in self._workers if w is not None]
        deadline = min((w.deadline(self.startup_timeout_s) for w in live), default=math.inf)
        timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        for ready in wait([w.conn for w in live] + [self._wake_r], timeout=timeout):
            if ready is self._wake_r:
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass
            else:
                self._receive(next(w for w in live if w.conn is ready))
        self._check_deadlines()
        return True

    def _spawn(self, spawn_all: bool) -> None:
        idle = sum(1 for w in self._workers if w is not None and w.job is None)
        wanted_for_shared = len(self._shared) - idle
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                continue
            if self._queues[slot]:
                self._workers[slot] = _Worker(self._context, self.specs, self.tmpdir)
            elif spawn_all or wanted_for_shared > 0:
                self._workers[slot] = _Worker(self._context, self.specs, self.tmpdir)
                wanted_for_shared -= 1
        if all(w is not None and w.ready for w in self._workers):
            self._all_ready.set()

    def _dispatch(self) -> None:
        for slot, worker in enumerate(self._workers):
            if worker is None or not worker.ready or worker.job is not None:
                continue
            queue = self._queues[slot] or self._shared
            if queue:
                worker.send(queue.popleft())

    def _receive(self, worker: _Worker) -> None:
        slot = self._workers.index(worker)
        while True:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                message = ("died",)
            if message[0] == "ready":
                worker.ready = True
            elif message[0] == "done":
                job, worker.job = worker.job, None
                if job is not None and job.id == message[1]:
                    self._finish(job, message[2])
            elif message[0] == "load_error":
                self.broken = message[1]
                self._replace(slot)
                self._all_ready.set()
                return
            else:  # the process ended
                worker.process.join(timeout=WORKER_EXIT_GRACE_S)
                code = worker.process.exitcode
                if not worker.ready:
                    self.broken = f"a tool worker exited during startup (exit code {code})"
                    self._all_ready.set()
                job = worker.job
                self._replace(slot)
                if job is not None:
                    self._finish(job, error_outcome("exception", f"the tool worker process died (exit code {code})"))
                return
            if not worker.conn.poll():
                return

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for slot, worker in enumerate(self._workers):
            if worker is None or now < worker.deadline(self.startup_timeout_s) or worker.conn.poll():
                continue
            if not worker.ready:
                self.broken = f"a tool worker did not start within {self.startup_timeout_s:g}s"
                self._replace(slot)
                self._all_ready.set()
                continue
            job = worker.job
            self._replace(slot)
            self._finish(job, error_outcome(
                "timeout", f"the call took longer than {job.timeout_s:g}s (the tool worker was stopped)"))

    def _replace(self, slot: int) -> None:
        """Kill the slot's worker; the next job for the slot spawns a fresh one."""
        worker = self._workers[slot]
        self._workers[slot] = None
        if worker is not None:
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join(timeout=WORKER_EXIT_GRACE_S)
            worker.conn.close()

    def _finish(self, job: _Job, outcome: dict) -> None:
        now = time.monotonic()
        sent = job.sent if not math.isnan(job.sent) else now
        outcome = {**outcome, "latency_s": now - sent, "queued_s": sent - job.submitted}
        if job.slot is not None:
            with self._lock:
                self._outstanding[job.slot] -= 1
        if not job.future.done():
            job.future.set_result(outcome)

    def _fail_queued(self, outcome: dict) -> None:
        for queue in [*self._queues, self._shared]:
            while queue:
                self._finish(queue.popleft(), outcome)

    def _shutdown(self) -> None:
        with self._lock:
            self._closing = True
            new, self._inbox = self._inbox, []
        closed = error_outcome("exception", "the tool pool was closed before the call ran")
        for job in new:
            self._finish(job, closed)
        self._fail_queued(closed)
        deadline = time.monotonic() + WORKER_EXIT_GRACE_S
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                job = worker.job
                worker.stop(deadline)
                self._workers[slot] = None
                if job is not None:
                    self._finish(job, error_outcome("exception", "the tool pool was closed during the call"))
        self._all_ready.set()
        self._wake_r.close()
        self._wake_w.close()
