"""Generation engines for the rollout stage, chosen by `actor_rollout_ref.rollout.name`.

The extension point: an engine is a class with the `Engine` interface below (start, load_weights,
generate, sleep/wake, stop), registered by name in ENGINES; adding SGLang would be one new module
and one line here. Built in:
- `hf`: transformers `generate`, batched with left padding (stages/engines/hf.py);
- `vllm`: vLLM's offline `LLM` (stages/engines/vllm_engine.py).

Engines run inside rollout workers (stages/engines/worker.py), one process per rollout replica.
stages/engines/service.py keeps them for a whole training run when the run owns a session (the
engine starts once and takes each step's new weights in place), or starts and stops them around
one call otherwise; an hf engine without a session runs in the calling process (what a one-off
rollout or a test needs: no process start).

Every engine takes the same input: one row per response (the n responses of a prompt are n
adjacent copies of its prompt ids) with a 31-bit seed per row, and returns one `Generation` per
row. Responses keep their EOS token; finish_reason is "stop" (an EOS id was sampled) or "length"
(max_new_tokens). Rows are split over the plan's rollout replicas in prompt-sized shares (whole
prompts per replica). Given the same weights and seeds an engine's output does not depend on
whether it was just started or has served earlier steps (tests/test_engines_resident.py).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

# name -> "module:Class" implementing Engine (imported on first use: vLLM is an optional extra)
ENGINES = {"hf": "stages.engines.hf:HFEngine", "vllm": "stages.engines.vllm_engine:VLLMEngine"}


# in a weights version folder (stages.training.handoff): the version its weights are; a folder with
# this file and no *.safetensors holds only the small files of a version served from memory
VERSION_FILE = "stagerl_version.json"


class EngineError(RuntimeError):
    """A generation engine failed (the message carries the engine's own error)."""


def derive_seed(*parts) -> int:
    """A 31-bit seed from any tuple of values (e.g. (stage seed, replica, batch) or (seed, row))."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def row_seeds(base: int, rows: int) -> list[int]:
    """[derive_seed(base, row) for row in range(rows)]: the same seeds, in half the time (a
    step's 720 rows: 0.9 -> 0.5 ms)."""
    sha, from_bytes = hashlib.sha256, int.from_bytes
    return [from_bytes(sha(f"{base}/{row}".encode()).digest()[:4], "little") & 0x7FFFFFFF for row in range(rows)]


@dataclass(frozen=True)
class Sampling:
    """verl's sampling keys, resolved: greedy when do_sample is false or temperature is 0."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    max_new_tokens: int = 32
    n: int = 1
    log_probs: bool = False  # also return the engine's own per-token log-probs

    @property
    def greedy(self) -> bool:
        return (not self.do_sample) or self.temperature == 0

    @classmethod
    def from_rollout(cls, rollout: dict, response_length: int, validation: bool = False) -> "Sampling":
        """From the `actor_rollout_ref.rollout` section (its val_kwargs when validation)."""
        src = dict(rollout.get("val_kwargs") or {}) if validation else rollout
        where = "actor_rollout_ref.rollout" + (".val_kwargs" if validation else "")
        temperature = float(src.get("temperature", 1.0))
        do_sample = bool(src.get("do_sample", True))
        if temperature < 0:
            raise ValueError(f"{where}.temperature must be >= 0, got {temperature}")
        if validation and do_sample and temperature <= 0:
            raise ValueError(f"{where}.temperature must be > 0 when {where}.do_sample is true")
        top_p = float(src.get("top_p", 1.0))
        if not 0 < top_p <= 1:
            raise ValueError(f"{where}.top_p must be in (0, 1], got {top_p}")
        top_k = int(src.get("top_k", -1))
        if top_k == 0 or top_k < -1:
            raise ValueError(f"{where}.top_k must be -1 (off) or >= 1, got {top_k}")
        n = int(src.get("n", 1))
        if n < 1:
            raise ValueError(f"{where}.n must be >= 1, got {n}")
        if response_length < 1:
            raise ValueError(f"actor_rollout_ref.rollout.response_length must be >= 1, got {response_length}")
        return cls(temperature=temperature, top_p=top_p, top_k=top_k, do_sample=do_sample,
                   max_new_tokens=int(response_length), n=n,
                   log_probs=bool(rollout.get("calculate_log_probs", False)))


@dataclass
class Generation:
    response_ids: list[int]
    finish_reason: str  # "stop" | "length"
    log_probs: list[float] | None = None
    text: str | None = None  # the response decoded without special tokens (resident workers)


@dataclass
class EngineOptions:
    """What an engine needs beyond the rows: the model folder and the rollout section."""
    model_dir: Path
    rollout: dict
    device: str = "cpu"
    num_replicas: int = 1
    prompts_per_replica: int | None = None
    max_model_len: int | None = None
    engine_seed: int = 0  # the engine's own seed, fixed for a run (rows carry their own seeds)
    step_seed: int = 0  # this call's seed (hf: generation batches are reseeded from it)
    # the weights version the call must sample from (stages.training.handoff.version_id); None:
    # whatever model_dir holds (the initial model, a one-off call)
    weights_version: str | None = None
    own_process: bool = False  # never in the calling process (in_own_process: staleness or a pinned engine)
    cpus: tuple = ()  # CPU cores the engine's worker processes are pinned to (rollout.cpu_affinity; (): not pinned)
    timings: dict = field(default_factory=dict)


def eos_token_ids(model_dir) -> list[int]:
    """EOS ids from generation_config.json (a list or one id), else config.json / the tokenizer."""
    import json

    folder = Path(model_dir)
    ids = []
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                ids = value if isinstance(value, list) else [value]
                break
    if not ids:
        from stages.model.models import load_tokenizer

        tok = load_tokenizer(folder)
        ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if not ids:
        raise ValueError(f"{folder}: no eos_token_id in generation_config.json, config.json or the tokenizer")
    return [int(i) for i in ids]


def finish(tokens, eos_ids, max_new_tokens: int, log_probs=None) -> Generation:
    """Cut generated tokens at the first EOS (kept); "stop" if one was found, else "length"."""
    eos = set(eos_ids)
    tokens = [int(t) for t in tokens]
    for i, tok in enumerate(tokens):
        if tok in eos:
            lp = None if log_probs is None else [float(x) for x in log_probs[:i + 1]]
            return Generation(tokens[:i + 1], "stop", lp)
    tokens = tokens[:max_new_tokens]
    lp = None if log_probs is None else [float(x) for x in log_probs[:len(tokens)]]
    return Generation(tokens, "length", lp)


def replica_shares(num_rows: int, n: int, num_replicas: int, prompts_per_replica: int | None) -> list[range]:
    """Row ranges per replica: whole prompts (n adjacent rows), prompts_per_replica each (the plan's)."""
    prompts = num_rows // n
    per = prompts_per_replica or -(-prompts // max(num_replicas, 1))
    shares = []
    for r in range(max(num_replicas, 1)):
        start, stop = min(r * per, prompts), min((r + 1) * per, prompts)
        if r == num_replicas - 1:
            stop = prompts
        if stop > start:
            shares.append(range(start * n, stop * n))
    return shares


class Engine:
    """What a generation engine implements (one instance per rollout replica, in one process).

    start(spec)          load the model of spec.model_dir and get ready (the slow part: once per run)
    load_weights(dir)    take new weights of the same architecture in place (every step)
    generate(rows, seeds, sampling, replica, step_seed, rollout) -> [Generation]
    stream(add, sampling, max_steps) -> ([(key, Generation)], steps)   optional (STREAMS): continuous
                         batching across requests added at any call: add [(key, prompt ids, seed,
                         max new tokens)], run the engine until one request or more has finished
                         (or max_steps steps), return those and the steps taken
    end_stream()         the streamed batch is over: free what it holds (hf's kept turn caches)
    sleep() / wake()     free / retake device memory between steps (GPU; a no-op elsewhere)
    stop()               release everything
    process_env(spec, env)  the worker process's environment (devices, cores)
    START_KEYS           rollout keys read by start(): a change needs a fresh engine"""
    START_KEYS: tuple = ()
    STREAMS = False  # implements stream() (the multi-turn agent loop's continuous batching)

    @staticmethod
    def process_env(spec: "EngineSpec", env: dict) -> dict:
        """The environment of the worker process hosting this replica (devices, cores)."""
        return env

    def start(self, spec: "EngineSpec") -> dict:
        raise NotImplementedError

    def load_weights(self, model_dir) -> dict:
        raise NotImplementedError

    def generate(self, prompt_ids, seeds, sampling: Sampling, replica: int, step_seed: int,
                 rollout: dict) -> list[Generation]:
        raise NotImplementedError

    def end_stream(self) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is started with; equal specs can share one running engine."""
    engine: str
    model_dir: str
    rollout: tuple  # sorted (key, value) of the START_KEYS of the engine
    device: str = "cpu"
    max_model_len: int = 0
    replica: int = 0
    num_replicas: int = 1
    threads: int = 1  # CPU threads of the replica's process
    seed: int = 0  # engine-level seed; rows carry their own seeds
    own_process: bool = False  # a worker process even where hf would stay in the calling process
    cpus: tuple = ()  # the cores the worker process pins itself to (os.sched_setaffinity)

    def setting(self, key: str, default=None):
        return dict(self.rollout).get(key, default)

    def restart_key(self) -> tuple:
        """Everything but the weights: a different key needs a new engine, the same key only
        new weights."""
        return (self.engine, self.rollout, self.device, self.max_model_len, self.replica,
                self.num_replicas, self.threads, self.seed, self.own_process, self.cpus)


def engine_class(name: str):
    """The Engine class registered as `name` (ValueError naming the key and the choices)."""
    import importlib

    if name not in ENGINES:
        raise ValueError(f"actor_rollout_ref.rollout.name={name!r}: unknown engine; registered: "
                         f"{', '.join(sorted(ENGINES))}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_spec(options: EngineOptions, engine: str, replica: int, num_replicas: int) -> EngineSpec:
    """An EngineSpec for one replica from the stage's EngineOptions."""
    import os

    keys = engine_class(engine).START_KEYS
    rollout = tuple(sorted((k, options.rollout.get(k)) for k in keys))
    tp = int(options.rollout.get("tensor_model_parallel_size") or 1)
    cores = available_cores()
    if options.cpus:  # pinned: the replicas share these cores
        cores = len(options.cpus)
    elif options.own_process:  # beside the training (trainer.staleness), unpinned: its share of the cores
        cores = split_cores(cores)[0]
    threads = int(os.environ.get("STAGERL_ENGINE_THREADS") or 0) or max(1, cores // max(1, num_replicas * (tp if engine == "vllm" else 1)))
    return EngineSpec(engine=engine, model_dir=str(options.model_dir), rollout=rollout,
                      device=options.device, max_model_len=int(options.max_model_len or 0),
                      replica=replica, num_replicas=num_replicas, threads=threads,
                      seed=int(options.engine_seed), own_process=bool(options.own_process),
                      cpus=tuple(options.cpus))


def available_cores() -> int:
    """The cores this process may run on."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def split_cores(cores: int) -> tuple[int, int]:
    """(the engine's threads, the training's threads) when the rollout engine samples while the
    update trains (trainer.staleness > 0) on the same unpinned cores: half each, so the two never
    run more busy threads than there are cores (on 2 cores 2 + 2 threads made the pipelined step
    3x slower than the sequential one: OpenMP threads spinning against each other)."""
    engine = max(1, cores // 2)
    return engine, max(1, cores - engine)


def in_own_process(staleness: int, cpu_affinity) -> bool:
    """Whether the rollout engine never runs in the calling process, even an hf engine that would
    stay there: pipelined steps (trainer.staleness > 0: the update trains in the flow's process
    meanwhile) or a pinned engine (rollout.cpu_affinity)."""
    return int(staleness or 0) > 0 or bool(cpu_affinity)


def check_rows(prompt_ids: list[list[int]], row_seeds: list[int], model_dir) -> None:
    """Refuse what no engine can run, naming the row or the folder."""
    from stages.model.models import check_model_folder

    if len(prompt_ids) != len(row_seeds):
        raise ValueError(f"{len(prompt_ids)} rows but {len(row_seeds)} seeds")
    for row, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"row {row}: empty prompt (no token ids)")
    try:
        check_model_folder(model_dir, "policy model")
    except FileNotFoundError as err:
        raise FileNotFoundError(f"actor_rollout_ref.model.path (or the step's weights): {err}") from None
