"""GPU check: transformers rollout and a DeepSpeed ZeRO update of a small Qwen2-shaped model in bf16,
through stagerl's own code (stages.model.models.response_log_probs, stages.training.engine, stages.algos.policy_losses).
Prints one JSON summary: tokens/s, step time, MFU estimate. Run by bench/gpu_check.sh on a GPU
machine; `--device cpu --preset tiny` runs the same path here as a smoke test.

No hub: the model is built from a config with random weights (speed does not depend on the values)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]  # bench/ off the path: bench/storage.py is not storage/
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))

PRESETS = {  # Qwen2.5-0.5B's shape, and a tiny one for the CPU smoke test
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=512),
}
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def build_model(preset: str, device: str, dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**PRESETS[preset], max_position_embeddings=4096, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype), config


def rollout(model, args, device) -> dict:
    prompts = torch.randint(10, model.config.vocab_size - 10, (args.rollout_prompts, args.prompt_len), device=device)
    model.eval()
    torch.manual_seed(1)
    with torch.inference_mode():
        model.generate(prompts[:2], max_new_tokens=4, do_sample=True)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.response_len,
                             min_new_tokens=args.response_len, do_sample=True, temperature=1.0, pad_token_id=0)
        sync(device)
    seconds = time.perf_counter() - t0
    tokens = (out.shape[1] - args.prompt_len) * out.shape[0]
    return {"rows": out.shape[0], "response_tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1)}


def update(model, args, device, n_params: int) -> dict:
    from stages.batches.batching import collate
    from stages.ranks.launch import init_distributed
    from stages.algos.policy_losses import compute_policy_loss_vanilla
    from stages.model.models import response_log_probs
    from stages.training.engine import deepspeed_config, make_engine

    init_distributed(device)
    model.train()
    ds = deepspeed_config(2, "bf16" if args.dtype == "bf16" else "fp32", 1.0, False, False, "actor")
    engine, _ = make_engine(model, {"lr": 1e-6, "betas": [0.9, 0.999], "weight_decay": 0.01}, ds)
    bs, P, R = args.update_rows, args.prompt_len, args.response_len
    ids = torch.randint(10, model.config.vocab_size - 10, (bs, P + R)).tolist()
    batch = collate([{"prompt_ids": row[:P], "response_ids": row[P:]} for row in ids], pad_id=0, device=device)
    adv = torch.randn(bs, R, device=device)
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.update_iters + 1):
        sync(device)
        t0 = time.perf_counter()
        logp, _ = response_log_probs(engine.module, batch)
        loss = compute_policy_loss_vanilla(logp.detach(), logp, adv, batch["response_mask"])[0]
        engine.backward(loss)
        engine.step()
        sync(device)
        if i:  # the first iteration is a warm-up
            times.append(time.perf_counter() - t0)
    step_s = sum(times) / len(times)
    tokens = bs * (P + R)
    out = {"rows": bs, "tokens_per_step": tokens, "step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s, 1)}
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    if peak:  # 6 N flops per token (forward + backward), attention ignored
        out["mfu"] = round(6 * n_params * tokens / step_s / peak, 4)
    if device == "cuda":
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    out["plan_estimate_gib"] = plan_estimate(model, args)
    return out


def plan_estimate(model, args) -> dict:
    """The plan's estimate (configs/memory.py) for this update: same shape, dtype, ZeRO-2, one
    rank, one micro-batch of update_rows × (prompt + response) tokens, no checkpointing. Without
    the 1 GiB runtime allowance, to compare with torch's allocated peak (no CUDA context)."""
    import tempfile

    from configs.loader import load_config
    from configs.memory import RUNTIME_GIB, estimate_memory
    from configs.suggest import make_plan

    with tempfile.TemporaryDirectory() as folder:
        model.config.save_pretrained(folder)
        rows = args.update_rows
        cfg = load_config("base", [f"actor_rollout_ref.model.path={folder}", "algorithm.adv_estimator=grpo",
                                   f"data.train_batch_size={rows}", "actor_rollout_ref.rollout.n=1",
                                   f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
                                   f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows}",
                                   f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={rows}",
                                   f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.response_len}",
                                   f"actor_rollout_ref.actor.deepspeed.dtype={args.dtype}",
                                   "actor_rollout_ref.model.enable_gradient_checkpointing=false",
                                   "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1"])
        est = estimate_memory(cfg, make_plan(cfg))["update_actor"]
    return {"training_without_runtime": round(est["train_gib"] - RUNTIME_GIB, 3), "parts": est["parts_gib"]}


def resident_engines(model, args, device) -> dict:
    """The rollout engines as a training run keeps them (stages.engines): started once, new weights
    loaded in place, asleep while the update trains (GPU memory freed), woken for the next step.
    hf always; vLLM (sleep mode level 2 + reload_weights) when vllm is importable here."""
    import importlib.util
    import tempfile
    from pathlib import Path

    from stages.engines import EngineOptions, Sampling, derive_seed, engine_class, make_spec
    from stages.model.tiny import train_tokenizer

    out = {}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as in a rollout worker process
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        model.save_pretrained(folder)
        train_tokenizer(512).save_pretrained(folder)  # ids below 512 are valid for the big vocab too
        prompts = [[11 + (i % 97)] * args.prompt_len for i in range(args.rollout_prompts)]
        model.generation_config.eos_token_id = [2]
        seeds = [derive_seed(0, i) for i in range(len(prompts))]
        sampling = Sampling(temperature=1.0, max_new_tokens=args.response_len, n=1)
        rollout = {"dtype": "bfloat16" if args.dtype == "bf16" else "float32", "hf_generate_batch_size": 64,
                   "gpu_memory_utilization": 0.3, "free_cache_engine": True, "enforce_eager": False}
        names = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
        for name in names:
            options = EngineOptions(model_dir=folder, rollout=rollout, device=device,
                                    max_model_len=args.prompt_len + args.response_len)
            engine = engine_class(name)()
            rec = {"start_s": engine.start(make_spec(options, name, 0, 1))["engine_start_s"]}
            t0 = time.perf_counter()
            engine.generate(prompts, seeds, sampling, 0, 1, rollout)
            rec["generate_s"] = round(time.perf_counter() - t0, 3)
            sync(device)
            free_awake = torch.cuda.mem_get_info()[0] if device == "cuda" else 0
            t0 = time.perf_counter()
            engine.sleep()
            sync(device)
            rec["sleep_s"] = round(time.perf_counter() - t0, 3)
            rec["freed_gib"] = round(((torch.cuda.mem_get_info()[0] if device == "cuda" else 0) - free_awake) / 2**30, 2)
            rec["load_weights_s"] = engine.load_weights(folder)["load_weights_s"]  # wakes it first
            t0 = time.perf_counter()
            engine.generate(prompts, seeds, sampling, 0, 1, rollout)
            rec["generate_after_reload_s"] = round(time.perf_counter() - t0, 3)
            engine.stop()
            del engine
            torch.cuda.empty_cache() if device == "cuda" else None
            out[name] = rec
        if "vllm" not in names:
            out["vllm"] = "not installed on this machine (its wheel is too large to carry): skipped"
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--rollout-prompts", type=int, default=256)
    p.add_argument("--update-rows", type=int, default=16)
    p.add_argument("--update-iters", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, _ = build_model(args.preset, args.device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    summary = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "preset": args.preset, "dtype": args.dtype, "params": n_params}
    summary["rollout_hf"] = rollout(model, args, args.device)
    summary["resident_engines"] = resident_engines(model, args, args.device)
    summary["update_deepspeed_zero2"] = update(model, args, args.device, n_params)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
