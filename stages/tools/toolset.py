"""ToolSet: the tools of one tool config, as a rollout loop uses them.

    tools = ToolSet.from_config("gsm8k_tool_config.yaml", num_workers=4)   # or a session's, for a run
    tools.schemas                                    # for the chat template's `tools=`
    tools.create(sample_id, row["extra_info"]["tools_kwargs"])
    content, calls = parse_hermes(text)              # stages/tools/parser.py
    results = tools.execute([(sample_id, call) for call in calls])   # or submit(): a Future each
    rewards = tools.calc_reward(sample_id)           # {tool name: reward}
    tools.release(sample_id)
    tools.close()

Instances follow verl. With instance_per="sample" (the default: verl's SGLang multi-turn
rollout) each sample gets one instance of each tool, created on its first use with the
sample's `tools_kwargs[tool]["create_kwargs"]`, kept between its calls (the GSM8K tool remembers
the last answer), read by calc_reward and dropped by release. With instance_per="call" (verl's
ToolAgentLoop) every call creates an instance, executes and releases it; calc_reward is then
empty. `execute_kwargs`, `calc_reward_kwargs` and `release_kwargs` in tools_kwargs are passed on.

Calls on one instance run one after another in the order submitted (they share its state); all
others run in parallel, up to num_workers at a time. Every call answers a ToolResult: a call the
parser could not read ("bad_json"), a name no tool has ("unknown_tool"), a call past its deadline
("timeout": the tool config's `timeout_s`, else the tool's own, else the ToolSet's), a tool that
raised or whose worker died ("exception") and a sandbox that cannot run ("sandbox") each become
verl's "Error when executing tool: ..." text and a counted error (`metrics()`); nothing raises.
After a timeout or a death the worker is replaced and the instances it held start afresh on
their next use (counted as tools/instances_restarted).
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import weakref
from collections import Counter
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

from stages.tools.base import ERROR_KINDS
from stages.tools.parser import ToolCall
from stages.tools.pool import ToolWorkerPool, error_outcome
from stages.tools.registry import ToolSpec, build_tools, read_tool_config

INSTANCE_PER = ("sample", "call")


@dataclasses.dataclass
class ToolResult:
    """The answer to one call. `text` is the tool message's content; `reward` verl's step reward
    (execute's second value; None when the tool gives none or the call failed); `error` None or one
    of ERROR_KINDS, with `detail` saying what happened."""

    tool: str | None
    arguments: str
    text: str
    reward: float | None = None
    metrics: dict = dataclasses.field(default_factory=dict)
    latency_s: float = 0.0
    error: str | None = None
    detail: str = ""
    image: list | None = None
    video: list | None = None
    instance_restarted: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass
class _Sample:
    tools_kwargs: dict
    homes: dict = dataclasses.field(default_factory=dict)     # tool -> worker slot of its instance
    created: set = dataclasses.field(default_factory=set)     # tools whose instance exists on a worker


def truncate_response(text: str, max_length: int, side: str = "middle") -> str:
    """verl's cut of a long tool response (ToolAgentLoop: max_tool_response_length,
    tool_response_truncate_side): "left" keeps the start, "right" the end, else both halves."""
    if not text or len(text) <= max_length:
        return text
    if side == "left":
        return text[:max_length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_length:]
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class ToolSet:
    """The tools of one config, their worker processes and the instances of the samples in
    flight. Thread-safe; close it (or use it as a context manager) to stop the workers."""

    def __init__(self, specs: Sequence[ToolSpec], *, num_workers: int | None = None, timeout_s: float = 30.0,
                 instance_per: str = "sample", startup_timeout_s: float = 120.0):
        if instance_per not in INSTANCE_PER:
            raise ValueError(f"instance_per must be one of {INSTANCE_PER}, got {instance_per!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.specs = list(specs)
        # built here once to check the config and read names, schemas and notes; never called
        tools = build_tools(self.specs)
        self.names = list(tools)
        self.schemas = [tool.tool_schema.model_dump() for tool in tools.values()]
        self.notes = [note for tool in tools.values() for note in getattr(tool, "notes", ())]
        spec_of = dict(zip(self.names, self.specs))
        self.timeouts = {name: float(spec_of[name].config.get("timeout_s") or tool.call_timeout_s or timeout_s)
                         for name, tool in tools.items()}
        self.instance_per = instance_per
        workers = num_workers if num_workers is not None else max(1, min(8, os.cpu_count() or 1))
        self._pool = ToolWorkerPool(self.specs, workers, startup_timeout_s=startup_timeout_s)
        self._finalizer = weakref.finalize(self, self._pool.close)
        self._samples: dict[str, _Sample] = {}
        self._homes_per_slot = [0] * workers
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._latency_sum = self._latency_max = 0.0

    @classmethod
    def from_config(cls, source: "str | os.PathLike | Mapping", **kwargs) -> "ToolSet":
        """A ToolSet from verl's tool config YAML (a path, or the mapping it holds)."""
        return cls(read_tool_config(source), **kwargs)

    # ---- life cycle ---------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        return self._pool.num_workers

    @property
    def worker_pids(self) -> list[int]:
        return self._pool.worker_pids

    def start(self, wait: bool = False, timeout: float | None = None) -> bool:
        """Start every worker now (e.g. to overlap a rollout's start); wait=True blocks until ready."""
        return self._pool.start(wait=wait, timeout=timeout)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "ToolSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- one sample's instances ---------------------------------------------------------------
    def create(self, sample_id: str, tools_kwargs: Mapping | None = None) -> None:
        """Start a sample: remember its verl tools_kwargs ({tool: {create_kwargs, execute_kwargs,
        calc_reward_kwargs, release_kwargs}}); its instances are created on first use."""
        with self._lock:
            if sample_id in self._samples:
                raise ValueError(f"sample {sample_id!r} already has tool instances; release it first")
            self._samples[sample_id] = _Sample(tools_kwargs=dict(tools_kwargs or {}))

    def submit(self, sample_id: str, call: ToolCall, timeout_s: float | None = None) -> "Future[ToolResult]":
        """Run one call of a created sample; the future resolves to its ToolResult."""
        sample = self._sample(sample_id)
        done: Future = Future()
        name = call.name
        if call.error is not None:
            return self._answer(done, name, call.arguments, error_outcome(
                call.error if call.error in ERROR_KINDS else "bad_json", call.detail or "the tool call cannot be read"))
        if name not in self.timeouts:
            return self._answer(done, name, call.arguments, error_outcome(
                "unknown_tool", f"unknown tool {name!r} (tools: {', '.join(self.names)})"))
        try:
            arguments = json.loads(call.arguments)
        except (json.JSONDecodeError, TypeError) as exc:
            return self._answer(done, name, call.arguments, error_outcome("bad_json", f"the arguments are not JSON: {exc}"))
        if not isinstance(arguments, dict):
            return self._answer(done, name, call.arguments, error_outcome(
                "bad_json", f"the arguments must be a JSON object, got {type(arguments).__name__}"))
        op = "call" if self.instance_per == "call" else "execute"
        future = self._job(sample_id, sample, name, op, {"arguments": arguments}, timeout_s)
        future.add_done_callback(lambda f: self._answer(done, name, call.arguments, f.result(), sample))
        return done

    def execute(self, calls: Sequence[tuple[str, ToolCall]], timeout_s: float | None = None) -> list[ToolResult]:
        """Run (sample_id, call) pairs, in parallel where they may; the results in order."""
        futures = [self.submit(sample_id, call, timeout_s) for sample_id, call in calls]
        return [future.result() for future in futures]

    def calc_reward(self, sample_id: str) -> dict[str, Any]:
        """{tool: calc_reward} for every tool the sample named in tools_kwargs or called (verl's
        reward_scores); a failing one reads 0.0 and is counted. Empty with instance_per="call"."""
        return self.finish(sample_id, release=False).result()

    def release(self, sample_id: str) -> None:
        """Release the sample's instances and forget it (an unknown sample: nothing to do)."""
        if sample_id in self._samples:
            self.finish(sample_id, reward=False).result()

    def finish(self, sample_id: str, reward: bool = True, release: bool = True) -> "Future[dict]":
        """calc_reward and/or release without waiting: a Future of the reward dict."""
        sample = self._sample(sample_id)
        names = [] if self.instance_per == "call" else \
            [n for n in self.names if n in sample.tools_kwargs or n in sample.homes]
        jobs = []
        if reward:
            jobs += [(n, self._job(sample_id, sample, n, "calc_reward", {}, None)) for n in names]
        if release:
            jobs += [(None, self._job(sample_id, sample, n, "release", {}, None)) for n in sample.homes]
            with self._lock:
                self._samples.pop(sample_id, None)
                for slot in sample.homes.values():
                    self._homes_per_slot[slot] -= 1
        done: Future = Future()
        pending = [len(jobs)]
        if not jobs:
            done.set_result({})

        def one_done(_):
            with self._lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                rewards = {}
                for name, future in jobs:
                    outcome = future.result()
                    with self._lock:
                        restarted = bool(name and outcome.get("created") and name in sample.created)
                    self._count(outcome, call=False, restarted=restarted)
                    if name is not None:
                        rewards[name] = outcome.get("value", 0.0) if outcome.get("error") is None else 0.0
                done.set_result(rewards)

        for _, future in jobs:
            future.add_done_callback(one_done)
        return done

    # ---- counts ---------------------------------------------------------------------------------
    def metrics(self, reset: bool = False) -> dict[str, float]:
        """tools/calls, tools/errors (and tools/errors/<kind> for every kind), tools/latency_mean_s,
        tools/latency_max_s, tools/instances_restarted, tools/calls/<tool>: since the start or the
        last reset."""
        with self._lock:
            counts = Counter(self._counts)
            mean = self._latency_sum / counts["calls"] if counts["calls"] else 0.0
            out = {"tools/calls": float(counts["calls"]),
                   "tools/errors": float(sum(counts[f"errors/{k}"] for k in ERROR_KINDS)),
                   **{f"tools/errors/{k}": float(counts[f"errors/{k}"]) for k in ERROR_KINDS},
                   "tools/latency_mean_s": mean, "tools/latency_max_s": self._latency_max,
                   "tools/instances_restarted": float(counts["instances_restarted"]),
                   **{f"tools/{key}": float(v) for key, v in counts.items() if key.startswith("calls/")}}
            if reset:
                self._counts.clear()
                self._latency_sum = self._latency_max = 0.0
        return out

    # ---- internals ------------------------------------------------------------------------------
    def _sample(self, sample_id: str) -> _Sample:
        with self._lock:
            sample = self._samples.get(sample_id)
        if sample is None:
            raise KeyError(f"sample {sample_id!r} was not created (ToolSet.create) or was released")
        return sample

    def _job(self, sample_id: str, sample: _Sample, name: str, op: str, extra: dict,
             timeout_s: float | None) -> Future:
        kwargs = sample.tools_kwargs.get(name) or {}
        request = {"op": op, "tool": name, "key": sample_id, "create_kwargs": kwargs.get("create_kwargs") or {},
                   **{k: dict(kwargs[k]) for k in ("execute_kwargs", "calc_reward_kwargs", "release_kwargs")
                      if kwargs.get(k)}, **extra}
        slot = None
        if op != "call":
            with self._lock:
                slot = sample.homes.get(name)
                if slot is None:
                    if op == "release":   # never created: nothing to release
                        done: Future = Future()
                        done.set_result({"error": None, "text": ""})
                        return done
                    slot = min(range(self._pool.num_workers),
                               key=lambda s: (self._pool.outstanding(s), self._homes_per_slot[s], s))
                    sample.homes[name] = slot
                    self._homes_per_slot[slot] += 1
        return self._pool.submit(request, timeout_s or self.timeouts[name], slot)

    def _answer(self, done: Future, name: str | None, arguments: str, outcome: dict,
                sample: _Sample | None = None) -> Future:
        restarted = False
        if sample is not None and self.instance_per == "sample":
            with self._lock:
                if outcome.get("created") and name in sample.created:
                    restarted = True
                if outcome.get("created") or outcome.get("error") is None:
                    sample.created.add(name)
        result = ToolResult(tool=name, arguments=arguments, text=outcome.get("text") or "",
                            reward=outcome.get("reward"), metrics=outcome.get("metrics") or {},
                            latency_s=float(outcome.get("latency_s", 0.0)), error=outcome.get("error"),
                            detail=outcome.get("detail", ""), image=outcome.get("image"),
                            video=outcome.get("video"), instance_restarted=restarted)
        self._count(outcome, call=True, tool=name, restarted=restarted)
        done.set_result(result)
        return done

    def _count(self, outcome: dict, call: bool, tool: str | None = None, restarted: bool = False) -> None:
        with self._lock:
            if call:
                self._counts["calls"] += 1
                if tool in self.timeouts:
                    self._counts[f"calls/{tool}"] += 1
                latency = float(outcome.get("latency_s", 0.0))
                self._latency_sum += latency
                self._latency_max = max(self._latency_max, latency)
            if outcome.get("error") is not None:
                self._counts[f"errors/{outcome['error']}"] += 1
            if restarted:
                self._counts["instances_restarted"] += 1
