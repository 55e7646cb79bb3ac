"""Load reward functions (verl's custom_reward_function) and score rows safely in worker processes.

A reward function has verl's signature `compute_score(data_source, solution_str, ground_truth,
extra_info)` and returns a number or a dict with "score" (an "acc" key fills the acc column; other
keys are kept as extras). `score_batch` runs it in spawned worker processes with a per-row timeout:
a row whose function raises, returns something unusable or runs too long scores 0 with the reason
in its `error` field (the hung worker is killed and replaced), unless `strict` makes it fatal.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import multiprocessing
import os
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import wait
from typing import Any, Callable, Mapping, Sequence

from stages.scorers import default_compute_score

DEFAULT_FN_NAME = "compute_score"
WORKER_STARTUP_TIMEOUT_S = 120.0


class RewardFunctionNotFound(LookupError):
    """custom_reward_function.path or .name does not point at a callable."""


class RewardScoringError(RuntimeError):
    """A row failed to score under strict mode, or the workers could not start."""


@dataclass(frozen=True)
class RewardFnSpec:
    """Which reward function to use: verl's custom_reward_function.{path, name, reward_kwargs}.
    No path means the built-in rule scorers (stages.scorers.default_compute_score)."""
    path: str | None = None
    name: str = DEFAULT_FN_NAME
    reward_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: "RewardFnSpec | Mapping | None") -> "RewardFnSpec":
        if isinstance(config, cls):
            return config
        config = dict(config or {})
        return cls(path=config.get("path") or None, name=config.get("name") or DEFAULT_FN_NAME,
                   reward_kwargs=dict(config.get("reward_kwargs") or {}))


def load_reward_fn(spec: "RewardFnSpec | Mapping | None") -> Callable[..., Any]:
    """The scoring callable for a spec; raises RewardFunctionNotFound naming path and name."""
    spec = RewardFnSpec.from_config(spec)
    if spec.path is None:
        fn = default_compute_score
    else:
        path = os.path.abspath(os.path.expanduser(spec.path))
        if not os.path.isfile(path):
            raise RewardFunctionNotFound(
                f"custom_reward_function.path {spec.path!r} does not exist (looked for {path})")
        module_name = "stagerl_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise RewardFunctionNotFound(f"custom_reward_function.path {path!r} is not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # as verl does; dataclasses and pickling need it
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(module_name, None)
            raise RewardFunctionNotFound(
                f"custom_reward_function.path {path!r} failed to import: {describe_error(exc)}") from exc
        fn = getattr(module, spec.name, None)
        if not callable(fn):
            available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise RewardFunctionNotFound(
                f"reward function {spec.name!r} not found in custom_reward_function.path {path!r} "
                f"(callables there: {', '.join(available) or 'none'})")
    return partial(fn, **spec.reward_kwargs) if spec.reward_kwargs else fn


def describe_error(exc: BaseException) -> str:
    """'Type: message (at file:line)' for the innermost frame of the exception."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _failed(error: str) -> dict:
    return {"score": 0.0, "acc": None, "extras": {}, "error": error}


def normalise_result(result: Any) -> dict:
    """A reward function's return value as {score, acc, extras, error}."""
    extras: dict = {}
    acc = None
    if isinstance(result, Mapping):
        if "score" not in result:
            return _failed(f"reward function returned a dict without 'score' (keys: {sorted(result)})")
        extras = {k: v for k, v in result.items() if k not in ("score", "acc")}
        acc = None if result.get("acc") is None else bool(result["acc"])
        result = result["score"]
    try:
        score = float(result)
    except (TypeError, ValueError):
        return _failed(f"reward function returned {type(result).__name__} {result!r:.80}, "
                       "expected a number or a dict with 'score'")
    if not math.isfinite(score):
        return _failed(f"reward function returned a non-finite score {score}")
    return {"score": score, "acc": acc, "extras": extras, "error": None}


def score_row(fn: Callable[..., Any], row: Mapping) -> dict:
    """Score one row in this process; exceptions become the row's error."""
    try:
        result = fn(row["data_source"], row["solution_str"], row["ground_truth"], row.get("extra_info"))
    except (Exception, SystemExit) as exc:
        return _failed(describe_error(exc))
    return normalise_result(result)


def _worker_main(conn, spec: RewardFnSpec) -> None:
    """Worker process: load the function, say ready, then score (index, row) messages until EOF."""
    try:
        fn = load_reward_fn(spec)
    except Exception as exc:
        conn.send(("load_error", str(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        index, row = message
        outcome = score_row(fn, row)
        try:
            conn.send(("result", index, outcome))
        except Exception as exc:  # e.g. extras that cannot be pickled
            conn.send(("result", index, _failed(f"result could not be sent back: {describe_error(exc)}")))


class _Worker:
    """One spawned scoring process and the row it is working on."""

    def __init__(self, context, spec: RewardFnSpec):
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child_conn, spec), daemon=True)
        self.process.start()
        child_conn.close()
        self.ready = False
        self.started_at = time.monotonic()
        self.index: int | None = None
        self.deadline = math.inf

    def assign(self, index: int, row: Mapping, timeout_s: float) -> None:
        self.index, self.deadline = index, time.monotonic() + timeout_s
        try:
            self.conn.send((index, dict(row)))
        except OSError:  # the process is gone; its closed pipe is reported by the next wait()
            pass

    def stop(self, kill: bool = False) -> None:
        if not kill:
            try:
                self.conn.send(None)
            except OSError:
                kill = True
        if kill and self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def score_batch(rows: Sequence[Mapping], fn_spec: "RewardFnSpec | Mapping | None" = None,
                num_workers: int = 4, timeout_s: float = 30.0, strict: bool = False
                ) -> tuple[list[dict], dict[str, float]]:
    """Score rows (data_source, solution_str, ground_truth, optional extra_info) in worker processes.

    Returns one {score, acc, extras, error} dict per row, in order, and metrics
    reward/errors (raised, bad return value, worker died), reward/timeouts and reward/rows.
    With strict=True the first failure raises RewardScoringError naming the row index.
    """
    spec = RewardFnSpec.from_config(fn_spec)
    load_reward_fn(spec)  # fail fast, in this process, on a missing file or function
    if num_workers < 1 or timeout_s <= 0:
        raise ValueError(f"num_workers must be >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
    results: list[dict | None] = [None] * len(rows)
    counts = {"errors": 0, "timeouts": 0}

    def record(index: int, outcome: dict, kind: str = "errors") -> None:
        results[index] = outcome
        if outcome["error"] is not None:
            counts[kind] += 1
            if strict:
                raise RewardScoringError(f"reward scoring failed on row {index} "
                                         f"(data_source={rows[index].get('data_source')!r}): {outcome['error']}")

    context = multiprocessing.get_context("spawn")
    pending = deque(range(len(rows)))
    workers = [_Worker(context, spec) for _ in range(min(num_workers, len(rows)))]
    try:
        while pending or any(w.index is not None for w in workers):
            for worker in workers:
                if worker.ready and worker.index is None and pending:
                    index = pending.popleft()
                    worker.assign(index, rows[index], timeout_s)
            now = time.monotonic()
            deadlines = [w.deadline if w.ready else w.started_at + WORKER_STARTUP_TIMEOUT_S for w in workers]
            by_conn = {w.conn: w for w in workers}
            for conn in wait(list(by_conn), timeout=max(0.0, min(deadlines) - now)):
                worker = by_conn[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    message = ("died",)
                if message[0] == "ready":
                    worker.ready = True
                elif message[0] == "result":
                    worker.index, worker.deadline = None, math.inf
                    record(message[1], message[2])
                elif message[0] == "load_error":
                    raise RewardScoringError(f"reward worker could not load the function: {message[1]}")
                else:  # the process ended without answering
                    if not worker.ready:
                        raise RewardScoringError(f"reward worker exited during startup "
                                                 f"(exit code {worker.process.exitcode})")
                    index = worker.index
                    workers[workers.index(worker)] = _replace(worker, context, spec)
                    if index is not None:
                        record(index, _failed(f"reward worker process died while scoring "
                                              f"(exit code {worker.process.exitcode})"))
            now = time.monotonic()
            for position, worker in enumerate(workers):
                if worker.index is not None and now >= worker.deadline:
                    index = worker.index
                    workers[position] = _replace(worker, context, spec)
                    record(index, _failed(f"timeout: scoring took longer than {timeout_s}s "
                                          "(worker killed)"), kind="timeouts")
                elif not worker.ready and now >= worker.started_at + WORKER_STARTUP_TIMEOUT_S:
                    raise RewardScoringError(
                        f"reward worker did not start within {WORKER_STARTUP_TIMEOUT_S:.0f}s")
    finally:
        for worker in workers:
            worker.stop(kill=True)
    metrics = {"reward/errors": float(counts["errors"]), "reward/timeouts": float(counts["timeouts"]),
               "reward/rows": float(len(rows))}
    return results, metrics  # type: ignore[return-value]


def _replace(worker: _Worker, context, spec: RewardFnSpec) -> _Worker:
    """Kill a hung or dead worker and start a fresh one in its place."""
    worker.stop(kill=True)
    return _Worker(context, spec)
