"""ScorerPool: reward scorer processes that stay alive for a whole training run.

Spawning the scorer processes (a Python interpreter each, importing stagerl's scorers or the user's
custom_reward_function file) costs far more than scoring one step's rows, so a training run keeps
one pool and scores every step's batch (and validation) through it. What a one-shot
`score_batch` guarantees is kept per row:

- per-sample timeout: rows go to a worker in chunks and come back in one message per chunk, while
  the worker counts its finished rows in shared memory; the deadline of the row in progress
  restarts whenever a row finishes; on a timeout that row scores 0 (counted in reward/timeouts),
  the worker is killed and replaced, and the other rows of its chunk (those it finished too: their
  results died with it) go back to the queue for another worker;
- isolation: a worker that dies fails only the row it was scoring (its shared count says which)
  and is replaced;
- the user's reward file is watched (size, mtime, inode; then its SHA-256 when those change): an
  edit between steps or before a resume restarts the workers so they import the new code, as the
  reward stage's fingerprint already changed with the file's content. Modules that file imports
  are not watched.

Workers start lazily, on the first `score` call that has rows, and never more than that call's row
count: a pool created up front by a training flow that might not score anything (or scores two
rows) holds no idle processes, and a one-shot pool behaves exactly like the old per-call workers.
`start()` spawns all of them early (without waiting), so their start-up can overlap a rollout.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import wait
from typing import Mapping, Sequence

from stages.scoring.reward_fns import (
    RewardFnSpec, RewardScoringError, _failed, describe_error, load_reward_fn, reward_file_sha256, score_row)

WORKER_STARTUP_TIMEOUT_S = 120.0
WORKER_EXIT_GRACE_S = 2.0   # a worker asked to exit that has not within this is killed
MAX_CHUNK_ROWS = 64         # rows per message; chunks also shrink as the queue empties (balance)


def _worker_main(conn, spec: RewardFnSpec, progress=None) -> None:
    """Worker process: load the function, say ready, then score chunks of (index, row) until EOF
    or None. Each chunk's results go back in one message at its end; meanwhile `progress` (shared
    memory: rows of the chunk finished, monotonic time of the last) tells the parent which row is
    in progress, so its per-row deadline and the blame for a death stay per row."""
    try:
        fn = load_reward_fn(spec)
    except Exception as exc:
        conn.send(("load_error", str(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        results = []
        for index, row in chunk:
            results.append((index, score_row(fn, row)))
            if progress is not None:
                progress[1] = time.monotonic()
                progress[0] = len(results)
        try:
            conn.send(("results", results))
        except OSError:   # the parent is gone
            return
        except Exception:  # noqa: BLE001 - e.g. extras that cannot be pickled: row by row
            for index, outcome in results:  # nothing was written: pickling fails before any byte
                try:
                    conn.send(("results", [(index, outcome)]))
                except OSError:
                    return
                except Exception as exc:  # noqa: BLE001
                    conn.send(("results", [(index, _failed(f"result could not be sent back: "
                                                           f"{describe_error(exc)}"))]))


class _Worker:
    """One spawned scoring process and the rows sent to it that it has not reported yet (the
    first of them is the one in progress)."""

    def __init__(self, context, spec: RewardFnSpec):
        self.conn, child_conn = context.Pipe()
        self.progress = context.Array("d", 2, lock=False)  # [rows of the chunk done, time of the last]
        self.process = context.Process(target=_worker_main, args=(child_conn, spec, self.progress), daemon=True)
        self.process.start()
        child_conn.close()
        self.ready = False
        self.started_at = time.monotonic()
        self.assigned: deque[int] = deque()
        self.chunk_done = 0  # rows of the current chunk already reported
        self.assigned_at = math.inf

    def assign(self, indices: list[int], rows: Sequence[Mapping], timeout_s: float) -> None:
        self.progress[0], self.progress[1] = 0.0, 0.0  # the worker is idle: no race
        self.assigned, self.chunk_done, self.assigned_at = deque(indices), 0, time.monotonic()
        try:
            self.conn.send([(i, dict(rows[i])) for i in indices])
        except OSError:  # the process is gone; its closed pipe is reported by the next wait()
            pass

    def deadline(self, timeout_s: float) -> float:
        """When the row in progress times out: timeout_s after the chunk was sent or after the
        worker last finished a row (its shared progress), whichever is later."""
        if not self.assigned:
            return math.inf
        return max(self.assigned_at, self.progress[1]) + timeout_s

    def in_progress(self) -> int:
        """How many of the rows still assigned the worker finished before the one it is on (their
        results are in its memory until the chunk ends)."""
        return min(len(self.assigned) - 1, max(0, int(self.progress[0]) - self.chunk_done))

    def reported(self, index: int, timeout_s: float) -> None:
        """A result came back."""
        if not self.assigned or self.assigned[0] != index:
            raise RewardScoringError(f"reward worker {self.process.pid} reported row {index}, "
                                     f"expected {self.assigned[0] if self.assigned else 'none'}")
        self.assigned.popleft()
        self.chunk_done += 1

    def take_failed(self, pending: deque) -> int:
        """The worker is killed or died: the row it was on (returned, to be blamed); the rows it
        finished but had not reported yet and the rows after it go back to `pending`."""
        rows = list(self.assigned)
        k = self.in_progress()
        pending.extendleft(reversed(rows[:k] + rows[k + 1:]))
        self.assigned.clear()
        return rows[k]

    def request_exit(self) -> None:
        """Ask an idle worker to exit normally (its atexit handlers run); kill a busy one."""
        if self.assigned:
            self.kill()
            return
        try:
            self.conn.send(None)
        except OSError:
            self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()

    def finish(self, deadline: float) -> None:
        """Wait for the process until `deadline` (monotonic), then kill it; close the pipe."""
        self.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def _stop_workers(workers: list[_Worker]) -> None:
    """Stop every worker of the list (asked first, killed after a grace period) and empty it."""
    for worker in workers:
        worker.request_exit()
    deadline = time.monotonic() + WORKER_EXIT_GRACE_S
    for worker in workers:
        worker.finish(deadline)
    workers.clear()


def _reward_file_state(path: str | None) -> tuple:
    """(cheap stat key, SHA-256 of the content) of the reward file; (None, None) when missing."""
    digest = reward_file_sha256(path)
    return (None, None) if digest is None else (_stat_key(path), digest)


def _stat_key(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _same_spec(a: RewardFnSpec, b: RewardFnSpec) -> bool:
    norm = lambda p: None if p is None else os.path.abspath(os.path.expanduser(p))  # noqa: E731
    return (norm(a.path), a.name, a.reward_kwargs) == (norm(b.path), b.name, b.reward_kwargs)


class ScorerPool:
    """Reward scorer processes kept alive across `score` calls (one pool per training run).

    `score(rows, strict)` returns exactly what `score_batch` returns. Not for concurrent use from
    several threads at once: calls are serialised by a lock. Close it (or use it as a context
    manager); workers are daemon processes, so they also end with the interpreter.
    """

    def __init__(self, spec: "RewardFnSpec | Mapping | None", num_workers: int, timeout_s: float,
                 *, max_chunk_rows: int = MAX_CHUNK_ROWS):
        self.spec = RewardFnSpec.from_config(spec)
        path = self.spec.path and os.path.abspath(os.path.expanduser(self.spec.path))
        # workers get the absolute path: one replaced later imports the same file after a chdir
        self._worker_spec = dataclasses.replace(self.spec, path=path)
        self._file_key, self._file_digest = _reward_file_state(path)  # before loading: an edit
        load_reward_fn(self._worker_spec)  # made meanwhile is seen as a change; fail fast here
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"num_workers must be >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
        if max_chunk_rows < 1:
            raise ValueError(f"max_chunk_rows must be >= 1, got {max_chunk_rows}")
        self.num_workers, self.timeout_s, self.max_chunk_rows = int(num_workers), float(timeout_s), max_chunk_rows
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # ---- life cycle -----------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        return [worker.process.pid for worker in self._workers]

    def matches(self, spec: "RewardFnSpec | Mapping | None", num_workers: int, timeout_s: float) -> list[str]:
        """What differs between this pool and the given settings (empty: it can score them)."""
        spec = RewardFnSpec.from_config(spec)
        wrong = []
        if not _same_spec(spec, self.spec):
            wrong.append(f"custom_reward_function {spec} (pool: {self.spec})")
        if int(num_workers) != self.num_workers:
            wrong.append(f"reward.num_workers {num_workers} (pool: {self.num_workers})")
        if float(timeout_s) != self.timeout_s:
            wrong.append(f"reward.timeout_s {timeout_s} (pool: {self.timeout_s})")
        return wrong

    def start(self) -> None:
        """Spawn all num_workers now without waiting for them (e.g. to overlap a rollout)."""
        with self._lock:
            self._check_open()
            self._restart_if_reward_file_changed()
            self._grow(self.num_workers)

    def close(self) -> None:
        """Stop the workers; idempotent. The pool cannot score afterwards."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> "ScorerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ScorerPool is closed; create a new one to score")

    def _grow(self, target: int) -> None:
        while len(self._workers) < min(target, self.num_workers):
            self._workers.append(_Worker(self._context, self._worker_spec))

    def _replace(self, worker: _Worker) -> None:
        """Kill a hung or dead worker and start a fresh one in its place."""
        worker.kill()
        worker.finish(time.monotonic())
        self._workers[self._workers.index(worker)] = _Worker(self._context, self._worker_spec)

    def _discard(self, worker: _Worker) -> None:
        """Kill a worker and drop it (the next call spawns what it needs)."""
        worker.kill()
        worker.finish(time.monotonic())
        self._workers.remove(worker)

    def _restart_if_reward_file_changed(self) -> None:
        """Stop all workers when the reward file's content changed since they were started (they
        are spawned again, importing the new code, by the scoring that follows)."""
        path = self._worker_spec.path
        if path is None:
            return
        key = _stat_key(path)
        if key is not None and key == self._file_key:
            return
        key, digest = _reward_file_state(path)
        changed = digest is None or digest != self._file_digest   # None: the file is gone
        self._file_key, self._file_digest = key, digest
        if changed:
            _stop_workers(self._workers)
            load_reward_fn(self._worker_spec)  # a deleted or broken file: a clear error here

    # ---- scoring --------------------------------------------------------------------------
    def score(self, rows: Sequence[Mapping], strict: bool = False) -> tuple[list[dict], dict[str, float]]:
        """Score rows (data_source, solution_str, ground_truth, optional extra_info).

        Returns one {score, acc, extras, error} dict per row, in order, and metrics reward/errors
        (raised, bad return value, worker died), reward/timeouts and reward/rows. With strict=True
        the first failure raises RewardScoringError naming the row index; the workers busy at that
        moment are killed (the rest stay for the next call).
        """
        with self._lock:
            self._check_open()
            self._restart_if_reward_file_changed()
            results: list[dict | None] = [None] * len(rows)
            counts = {"errors": 0, "timeouts": 0}

            def record(index: int, outcome: dict, kind: str = "errors") -> None:
                results[index] = outcome
                if outcome["error"] is not None:
                    counts[kind] += 1
                    if strict:
                        raise scoring_failed(index, rows[index], outcome)

            if rows:
                self._replace_idle_dead_workers()
                self._grow(len(rows))
                try:
                    self._score_all(rows, record)
                except BaseException:  # their late results must not reach the next call
                    for worker in [w for w in self._workers if w.assigned]:
                        self._discard(worker)
                    raise
            missing = [i for i, r in enumerate(results) if r is None]
            if missing:  # a bug here, never the user's function: refuse rather than drop rows
                raise RuntimeError(f"ScorerPool lost rows {missing[:20]} of {len(rows)}")
        return results, scoring_metrics(counts["errors"], counts["timeouts"], len(rows))  # type: ignore[return-value]

    def _replace_idle_dead_workers(self) -> None:
        """A worker that ended between calls (killed from outside) must not be blamed on the first
        row it is given next."""
        for worker in list(self._workers):
            if worker.ready and not worker.process.is_alive():
                self._replace(worker)

    def _chunk(self, pending: deque) -> list[int]:
        """The next rows for an idle worker: a share of the queue that shrinks as it empties, so
        the last chunks are small and the workers finish together."""
        size = max(1, min(self.max_chunk_rows, math.ceil(len(pending) / (2 * len(self._workers)))))
        return [pending.popleft() for _ in range(min(size, len(pending)))]

    def _score_all(self, rows: Sequence[Mapping], record) -> None:
        pending = deque(range(len(rows)))
        while pending or any(w.assigned for w in self._workers):
            for worker in self._workers:
                if worker.ready and not worker.assigned and pending:
                    worker.assign(self._chunk(pending), rows, self.timeout_s)
            deadline = min(w.deadline(self.timeout_s) if w.ready else w.started_at + WORKER_STARTUP_TIMEOUT_S
                           for w in self._workers)
            by_conn = {w.conn: w for w in self._workers}
            timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
            for conn in wait(list(by_conn), timeout=timeout):
                self._receive(by_conn[conn], pending, record)
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.assigned and now >= worker.deadline(self.timeout_s) and not worker.conn.poll():
                    index = worker.take_failed(pending)  # the rest of the chunk: next
                    self._replace(worker)
                    record(index, _failed(f"timeout: scoring took longer than {self.timeout_s}s "
                                          "(worker killed)"), kind="timeouts")
                elif not worker.ready and now >= worker.started_at + WORKER_STARTUP_TIMEOUT_S:
                    self._discard(worker)
                    raise RewardScoringError(
                        f"reward worker did not start within {WORKER_STARTUP_TIMEOUT_S:.0f}s")

    def _receive(self, worker: _Worker, pending: deque, record) -> None:
        """Handle every message the worker has sent so far (results arrive in chunk order)."""
        while True:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                message = ("died",)
            if message[0] == "ready":
                worker.ready = True
            elif message[0] == "results":
                for index, outcome in message[1]:
                    worker.reported(index, self.timeout_s)
                    record(index, outcome)
            elif message[0] == "load_error":
                self._discard(worker)
                raise RewardScoringError(f"reward worker could not load the function: {message[1]}")
            else:  # the process ended without answering
                worker.finish(time.monotonic() + WORKER_EXIT_GRACE_S)  # for its exit code
                if not worker.ready:
                    self._workers.remove(worker)
                    raise RewardScoringError(f"reward worker exited during startup "
                                             f"(exit code {worker.process.exitcode})")
                index = worker.take_failed(pending) if worker.assigned else None
                self._workers[self._workers.index(worker)] = _Worker(self._context, self._worker_spec)
                if index is not None:
                    record(index, _failed(f"reward worker process died while scoring "
                                          f"(exit code {worker.process.exitcode})"))
                return
            if not worker.conn.poll():
                return


def score_batch(rows: Sequence[Mapping], fn_spec: "RewardFnSpec | Mapping | None" = None,
                num_workers: int = 4, timeout_s: float = 30.0, strict: bool = False,
                pool: "ScorerPool | None" = None) -> tuple[list[dict], dict[str, float]]:
    """Score rows (data_source, solution_str, ground_truth, optional extra_info) in worker processes;
    the built-in rule scorers (no custom_reward_function.path), or any function with num_workers=0,
    in this process (score_in_process).

    Returns one {score, acc, extras, error} dict per row, in order, and metrics
    reward/errors (raised, bad return value, worker died), reward/timeouts and reward/rows.
    With strict=True the first failure raises RewardScoringError naming the row index.
    With `pool` (a training run's resident stages.scoring.pool.ScorerPool) the rows are scored by
    its workers, which must have been made for the same function, num_workers and timeout_s;
    without, a pool is started for this call and closed at its end.
    """
    if num_workers < 0 or timeout_s <= 0:
        raise ValueError(f"num_workers must be >= 0 and timeout_s > 0, got {num_workers}, {timeout_s}")
    if in_process(fn_spec, num_workers):
        return score_in_process(rows, fn_spec, strict)
    if pool is None:
        with ScorerPool(fn_spec, num_workers, timeout_s) as one_shot:
            return one_shot.score(rows, strict=strict)
    mismatches = pool.matches(fn_spec, num_workers, timeout_s)
    if mismatches:
        raise ValueError("score_batch: the ScorerPool passed was made for other settings: "
                         + "; ".join(mismatches))
    return pool.score(rows, strict=strict)


def in_process(fn_spec, num_workers: int) -> bool:
    """Whether score_batch scores in the calling process: the built-in rule scorers always
    (stages.scoring.scorers: string and regular-expression rules, linear in the response), a
    custom function when reward.num_workers=0 (as verl's reward manager and TRL's reward_funcs
    run: no isolation, no timeout)."""
    return num_workers == 0 or RewardFnSpec.from_config(fn_spec).path is None


def score_in_process(rows: Sequence[Mapping], fn_spec=None, strict: bool = False) -> tuple[list[dict], dict[str, float]]:
    """Score rows in this process (see in_process): no worker round trip (on the 720 short rows
    of the peer bench's step the workers' messages cost 15-50 ms of a 20-55 ms stage). Results,
    errors, metrics and strict are as ScorerPool.score's; no timeout is enforced (no worker to
    stop). A custom file is imported again when its content changed, so an edit between steps is
    used."""
    fn = load_reward_fn(fn_spec)
    results, errors = [], 0
    for index, row in enumerate(rows):
        outcome = score_row(fn, row)
        if outcome["error"] is not None:
            errors += 1
            if strict:
                raise scoring_failed(index, row, outcome)
        results.append(outcome)
    return results, scoring_metrics(errors, 0, len(rows))


def scoring_failed(index: int, row: Mapping, outcome: dict) -> RewardScoringError:
    """strict scoring's error for a row that failed (ScorerPool.score, score_in_process)."""
    return RewardScoringError(f"reward scoring failed on row {index} "
                              f"(data_source={row.get('data_source')!r}): {outcome['error']}")


def scoring_metrics(errors: int, timeouts: int, rows: int) -> dict[str, float]:
    return {"reward/errors": float(errors), "reward/timeouts": float(timeouts), "reward/rows": float(rows)}
