"""The rollout replicas of a run: engines started once and reused, or started for one call.

    engines = RolloutEngines(resident=True)          # owned by the run's session (stages.session)
    gens = engines.generate("vllm", prompt_ids, seeds, sampling, options)   # every step
    engines.sleep()                                   # GPU: free memory for the update
    engines.close()                                   # end of the run

Resident (a training run's session): one worker process per replica (stages.engines.worker),
started at the first call and kept. A later call with the same engine settings only loads the
step's weights into it (in place) when the weights folder changed; other settings (another engine,
dtype, replicas, ...) restart it. A worker that died is restarted, its weights loaded, and its
share generated again (once): a restarted engine gives the same rows as a resident one, since
every row carries its own seed and the batches are fixed.

Not resident (no session: a one-off rollout, a stage deployment, tests): hf runs in this process
and is dropped after the call; vLLM gets one worker per replica for the call (its process exit
frees GPU memory), all replicas started at once. One exception to worker processes: a run's hf
engine with a single replica on a CPU is kept in the calling process (in_process_resident).
"""
from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

from stages.engines import (VERSION_FILE, EngineOptions, Generation, Sampling, check_rows, engine_class,
                            make_spec, replica_shares)
from stages.engines.worker import EngineWorker, WorkerDied
from stages.scratch import scratch_dir


def needs_load(loaded, held, model_dir, version) -> bool:
    """Whether an engine holding `held` (loaded from folder `loaded`) must load `model_dir` to
    sample from weights `version`. A version held is never reloaded; a folder that only names a
    version held in memory (a handoff's small files, not yet stored) cannot be loaded, so a call
    for any other version is refused before it samples (EngineError naming both)."""
    from stages.engines import EngineError

    if version is not None and held == version:
        return False
    if version is None and held is None and str(loaded) == str(model_dir):
        return False
    folder = Path(str(model_dir))
    if (folder / VERSION_FILE).exists() and not any(folder.glob("*.safetensors")):
        raise EngineError(f"the rollout must sample from weights version {version} (in memory only, "
                          f"not yet stored: {folder}), but the engine holds {held}: refusing to sample "
                          f"from another version")
    return True


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to n inside (an engine in this process computes with the
    threads its worker process would have: float sums depend on the thread count)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_process_resident(specs) -> bool:
    """hf with one replica on a CPU stays in the calling process even in a run: a worker process
    would add a Python with torch and transformers to import (seconds of CPU on a small machine)
    for no parallelism, and nothing needs freeing for the update. vLLM, several replicas and GPUs
    get worker processes."""
    return len(specs) == 1 and specs[0].engine == "hf" and specs[0].device == "cpu" and not specs[0].own_process


class RolloutEngines:
    def __init__(self, resident: bool = True, log_dir=None, spawner=None):
        self.resident = resident
        self.spawner = spawner  # stages.ranks.zygote.Zygote: hf CPU workers are forked from it
        self._own_log_dir = log_dir is None  # removed on close (a failure quotes its log tail)
        self.log_dir = str(log_dir or scratch_dir("engines"))
        self.workers: dict[int, EngineWorker] = {}
        self.local = None  # (restart key, engine, weights folder) of an engine in this process
        self.local_version = None  # the weights version self.local holds (stages.training.handoff)
        self.warm_start = None  # warm_up's start timings of self.local, reported by the first call
        self.starts = 0  # worker processes started (a resident run: once per replica)
        self.restarts = 0  # of which after a worker died

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, engine: str, prompt_ids: list[list[int]], row_seeds: list[int], sampling: Sampling,
                 options: EngineOptions) -> list[Generation]:
        """One Generation per row; options.timings gets engine_start_s, load_weights_s,
        generate_s, wall_s and one entry per replica."""
        check_rows(prompt_ids, row_seeds, options.model_dir)
        engine_class(engine)  # unknown name: refused before anything starts
        t0 = time.perf_counter()
        shares = replica_shares(len(prompt_ids), sampling.n, options.num_replicas, options.prompts_per_replica)
        specs = [make_spec(options, engine, r, len(shares)) for r in range(len(shares))]
        if engine == "hf" and (not self.resident or in_process_resident(specs)):
            return self._in_process(specs, shares, prompt_ids, row_seeds, sampling, options, t0)
        timings = {"engine_start_s": 0.0, "load_weights_s": 0.0, "started": 0, "replicas": []}
        slots = [self.slot_spec(spec) for spec in specs]
        try:
            for slot in slots:  # every worker starts at once
                self._launch(slot)
            for slot, spec in zip(slots, specs):
                self._settle(slot, timings, spec.model_dir, options.weights_version)
            results: list[Generation] = [None] * len(prompt_ids)
            sent = []
            for slot, spec, share in zip(slots, specs, shares):
                request = self._request(spec, share, prompt_ids, row_seeds, sampling, options)
                worker = self.workers[slot.replica]
                worker.send("generate", request)
                sent.append((slot, spec, share, request, worker))
            for slot, spec, share, request, worker in sent:
                reply = self._reply(slot, spec, request, worker, timings)
                for offset, (ids, reason, lps, text) in enumerate(reply["rows"]):
                    results[share.start + offset] = Generation(list(ids), reason, lps, text)
                timings["replicas"].append({"replica": spec.replica, "rows": len(share),
                                            "generate_s": reply["generate_s"],
                                            "decode_s": reply.get("decode_s"),
                                            "pid": self.workers[slot.replica].proc.pid})
        finally:
            if not self.resident:
                self.close()
        timings["generate_s"] = max(r["generate_s"] for r in timings["replicas"])
        timings["wall_s"] = round(time.perf_counter() - t0, 4)
        options.timings.update(timings)
        return results

    def streams(self, engine: str, options: EngineOptions) -> bool:
        """Whether the agent loop can batch continuously across turns (Engine.stream): an engine
        that streams, one replica, resident (a worker process, or hf in this process)."""
        return self.resident and engine_class(engine).STREAMS and max(1, options.num_replicas) == 1

    def stream(self, engine: str, add: list, sampling: Sampling, options: EngineOptions, first: bool,
               max_steps: int | None = None) -> tuple[list, int]:
        """One Engine.stream request to the replica's worker (`first`: a new batch; the worker is
        started and given the weights first): ([(key, Generation)] of the requests that finished,
        the engine steps taken).
        options.timings gets engine_start_s, load_weights_s and generate_s (summed over the calls).
        A worker that dies mid-batch is not restarted here: the stage fails and a resume reruns it."""
        timings = options.timings
        for key in ("engine_start_s", "load_weights_s", "generate_s"):
            timings.setdefault(key, 0.0)
        timings.setdefault("started", 0)
        spec = self.slot_spec(make_spec(options, engine, 0, 1))
        if first:
            check_rows([ids for _, ids, _, _ in add], [seed for _, _, seed, _ in add], options.model_dir)
        if engine == "hf" and in_process_resident([spec]):  # in this process (_in_process's engine)
            local = self._local_engine(spec, options.weights_version, timings) if first else self.local[1]
            t0 = time.perf_counter()
            with torch_threads(spec.threads):
                done, steps = local.stream(add, sampling, max_steps, first)
            timings["generate_s"] += round(time.perf_counter() - t0, 4)
            return done, steps
        if first:
            self._launch(spec)
            self._settle(spec, timings, spec.model_dir, options.weights_version)
        reply = self.workers[spec.replica].call("stream", {"add": add, "sampling": dict(sampling.__dict__),
                                                           "max_steps": max_steps, "new_batch": first})
        timings["generate_s"] += reply["generate_s"]
        return [(key, Generation(list(ids), reason, lps)) for key, ids, reason, lps in reply["rows"]], reply["steps"]

    def end_stream(self, engine: str, options: EngineOptions) -> None:
        """The agent loop's streamed batch is over (or failed): the engine frees what it held
        for it, before the other stages run."""
        spec = self.slot_spec(make_spec(options, engine, 0, 1))
        if engine == "hf" and in_process_resident([spec]):
            if self.local is not None:
                self.local[1].end_stream()
        elif spec.replica in self.workers and self.workers[spec.replica].alive():
            self.workers[spec.replica].call("end_stream")

    @staticmethod
    def slot_spec(spec):
        """The spec of the worker process serving a replica: each replica has its own process
        (its own engine, devices or cores), so replicas generate in parallel. Measured on the
        CPU demo: one shared hf process running the replicas in turn took ~1.4x as long (twice
        the decode steps of half the rows), which outweighed its single model load."""
        return spec

    def _request(self, spec, share, prompt_ids, row_seeds, sampling: Sampling, options) -> dict:
        return {"prompt_ids": prompt_ids[share.start:share.stop], "seeds": row_seeds[share.start:share.stop],
                "sampling": dict(sampling.__dict__), "replica": spec.replica,
                "step_seed": int(options.step_seed), "rollout": dict(options.rollout), "decode": True}

    def _reply(self, slot, spec, request: dict, worker, timings: dict) -> dict:
        """The replica's answer; a worker that died is restarted and asked once more (also for
        requests that were queued on the dead worker)."""
        current = self.workers[slot.replica]
        try:
            if current is not worker:  # sent to a worker that died meanwhile
                return current.call("generate", request)
            return worker.result()
        except WorkerDied as died:
            print(f"rollout: {died}\nrestarting replica {spec.replica}", flush=True)
            self.restarts += 1
            self._launch(slot)
            self._settle(slot, timings, spec.model_dir)
            return self.workers[slot.replica].call("generate", request)

    def decode(self, id_lists: list[list[int]], skip_special_tokens: bool) -> list[str] | None:
        """Texts of token ids by a running worker's tokenizer (None: no worker; decode here)."""
        worker = next((w for w in self.workers.values() if w.alive() and w.started), None)
        if worker is None:
            return None
        return worker.call("decode", {"ids": id_lists, "skip_special_tokens": skip_special_tokens})

    def warm_up(self, engine: str, options: EngineOptions) -> None:
        """Start the replicas' engines (a run calls this before its first step): worker processes
        in the background, so their start-up overlaps the rest of the set-up; the in-process hf
        engine (in_process_resident) here and now, reported by the first call's timings."""
        if not self.resident:
            return
        specs = [make_spec(options, engine, r, max(1, options.num_replicas)) for r in range(max(1, options.num_replicas))]
        if engine == "hf" and in_process_resident(specs):
            if self.local is None:  # in this process, now: a thread would only contend for the GIL
                self.warm_start = self._start_local(specs[0])
            return
        for r in range(max(1, options.num_replicas)):
            self._launch(self.slot_spec(make_spec(options, engine, r, max(1, options.num_replicas))))

    def _start_local(self, spec) -> dict:
        engine = engine_class("hf")()
        started = engine.start(spec)
        self.local = (spec.restart_key(), engine, spec.model_dir)
        self.starts += 1
        return started

    def _launch(self, spec) -> None:
        """A worker for `spec`: the running one if its engine settings match and it lives, else
        a new process asked to start (without waiting for it)."""
        worker = self.workers.get(spec.replica)
        if worker is not None and worker.alive() and worker.spec.restart_key() == spec.restart_key():
            return
        if worker is not None:
            worker.close()
        worker = EngineWorker(spec, self.log_dir, spawner=self.spawner)
        worker.send("start", spec)
        worker.started = False
        self.workers[spec.replica] = worker
        self.starts += 1

    def _settle(self, spec, timings: dict, model_dir, version=None) -> None:
        """Wait until the worker's engine has started, then give it the weights in `model_dir`
        unless it holds `version` already."""
        worker = self.workers[spec.replica]
        if not worker.started:
            started = worker.result()
            worker.started, worker.loaded = True, worker.spec.model_dir
            worker.version = None
            timings["engine_start_s"] = max(timings["engine_start_s"], started["engine_start_s"])
            timings["started"] += 1
            if started.get("notes"):
                timings["notes"] = started["notes"]
        held = getattr(worker, "version", None)
        if needs_load(worker.loaded, held, model_dir, version):
            loaded = worker.call("load", str(model_dir))
            worker.loaded, worker.version = str(model_dir), version
            timings["load_weights_s"] = max(timings["load_weights_s"], loaded["load_weights_s"])

    # ---- the update's handoff (stages.training.handoff) ----------------------------------------
    def take_tensors(self, named, version: str, folder) -> float:
        """The update's new weights, (name, tensor) pairs, copied into the engine in this process;
        it then holds `version` (its small files in `folder`). Returns the seconds it took."""
        if self.local is None:
            raise RuntimeError("no rollout engine in this process to hand the weights to")
        key, engine, _ = self.local
        self.local_version = None  # half-copied weights are no version
        took = engine.load_tensors(named)["load_weights_s"]
        self.local, self.local_version = (key, engine, str(folder)), version
        return took

    def take_folder(self, folder, version: str) -> float:
        """Load a version folder into every engine started so far (the others load it when they
        start), the workers all at once; returns the seconds of the slowest."""
        took = 0.0
        loading = [w for w in self.workers.values() if w.alive() and getattr(w, "started", False)]
        for worker in loading:
            worker.version = None
            worker.send("load", str(folder))
        failed = None
        try:
            if self.local is not None:
                key, engine, _ = self.local
                self.local_version = None
                took = engine.load_weights(str(folder))["load_weights_s"]
                self.local, self.local_version = (key, engine, str(folder)), version
        finally:
            for worker in loading:  # every reply is read, so each worker's next reply is its next request's
                try:
                    took = max(took, worker.result()["load_weights_s"])
                    worker.loaded, worker.version = str(folder), version
                except Exception as exc:  # noqa: BLE001 - the first failure is raised below
                    failed = failed or exc
        if failed is not None:
            raise failed
        return took

    def _in_process(self, specs, shares, prompt_ids, row_seeds, sampling, options, t0) -> list[Generation]:
        """hf in this process: every replica in turn, with the threads a worker process would
        have (float sums depend on the thread count, so the rows equal a worker's bit for bit).
        Resident (in_process_resident), the engine is kept and takes new weights in place;
        otherwise it is dropped after the call."""
        timings = {"engine_start_s": 0.0, "load_weights_s": 0.0, "started": 0}
        engine = self._local_engine(specs[0], options.weights_version, timings)
        results: list[Generation] = [None] * len(prompt_ids)
        replicas = []
        try:
            with torch_threads(self.slot_spec(specs[0]).threads):
                for spec, share in zip(specs, shares):
                    t = time.perf_counter()
                    results[share.start:share.stop] = engine.generate(
                        prompt_ids[share.start:share.stop], row_seeds[share.start:share.stop], sampling, spec.replica,
                        int(options.step_seed), dict(options.rollout))
                    replicas.append({"replica": spec.replica, "rows": len(share),
                                     "generate_s": round(time.perf_counter() - t, 4)})
        finally:
            if not self.resident:
                self.close()
        options.timings.update({**timings, "in_process": True, "replicas": replicas,
                                "generate_s": round(sum(r["generate_s"] for r in replicas), 4),
                                "wall_s": round(time.perf_counter() - t0, 4)})
        return results

    def _local_engine(self, spec, version, timings: dict):
        """The engine in this process, started (other settings: restarted) and holding the
        weights `version` of spec.model_dir; timings get engine_start_s, started, load_weights_s."""
        key = spec.restart_key()
        if self.local is not None and self.local[0] != key:  # other settings: a new engine
            self.local[1].stop()
            self.local, self.warm_start = None, None
        if self.local is None:
            self.warm_start = self._start_local(spec)
        if self.warm_start is not None:  # started by this call or by warm_up before it
            timings["engine_start_s"], timings["started"] = self.warm_start["engine_start_s"], 1
            self.warm_start = None
        key, engine, loaded = self.local
        if needs_load(loaded, self.local_version, spec.model_dir, version):
            self.local_version = None
            timings["load_weights_s"] = engine.load_weights(spec.model_dir)["load_weights_s"]
            self.local, self.local_version = (key, engine, spec.model_dir), version
        return engine

    # ---- between steps and at the end ---------------------------------------------------------
    def sleep(self) -> None:
        """Free device memory while other stages run (GPU engines; a no-op on CPU). The weights
        are reloaded before the next generation."""
        for worker in self.workers.values():
            if worker.alive() and worker.spec.device == "cuda" and worker.spec.setting("free_cache_engine", True):
                worker.call("sleep")
                worker.loaded, worker.version = None, None

    def close(self) -> None:
        for worker in self.workers.values():  # all tear down at once ...
            worker.request_stop()
        for worker in self.workers.values():  # ... and each is waited for
            worker.close()
        self.workers.clear()
        if self.local is not None:
            self.local[1].stop()
            self.local = None
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers.values() if w.alive()]
