"""Gradient checkpointing on a real-shaped model: peak memory and time of one update step, with
and without actor_rollout_ref.model.enable_gradient_checkpointing. Prints JSON and writes
bench/results/checkpointing.json.

    python bench/checkpointing.py [--layers 4] [--rows 8] [--tokens 256] [--threads 2]

The model is qwen2.5-0.5b's architecture (stages/model/shapes.py: hidden 896, 14 heads / 2 KV
heads, MLP 4864, vocab 151,936, tied embeddings) with --layers of its 24 layers, fp32, random
weights. One rank trains one mini-batch of --rows sequences of --tokens tokens each (prompt 32,
the rest response), in one micro-batch, ZeRO-2, AdamW. Each variant runs in a fresh process so
its peak resident memory (ru_maxrss) is its own; time is UpdateJob.train_step's wall time (the
second of two steps: the first pays one-time allocations). The weights after both steps are
compared across variants (checkpointing recomputes, it must not change results), and each
peak is printed beside the plan's estimate for the update stage (configs/memory.py).
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
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

PROMPT = 32


def variant(model: str, work: str, rows: int, tokens: int, checkpointing: bool) -> dict:
    """One process: two update steps; returns time, peak RSS and a checksum of the weights."""
    import hashlib
    import resource

    import numpy as np
    import torch

    from _update_inputs import make_ctx, write_inputs
    from configs.memory import estimate_memory
    from stages.ranks.launch import init_distributed
    from stages.training.worker import UpdateJob

    response = tokens - PROMPT
    overrides = [f"data.max_prompt_length={PROMPT}", f"data.max_response_length={response}",
                 f"data.train_batch_size={rows}", "actor_rollout_ref.rollout.n=1",
                 f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
                 f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows}",
                 f"actor_rollout_ref.model.enable_gradient_checkpointing={str(checkpointing).lower()}",
                 "actor_rollout_ref.actor.optim.lr=1e-5"]
    full = lambda rng, n, max_resp: np.full(n, max_resp)  # every row at full length
    init_distributed("cpu")
    job, seconds, estimate = None, [], None
    for step in (1, 2):
        ctx = make_ctx(Path(work), model, step, overrides)
        write_inputs(ctx, seed=5, vocab=400, response_lengths=full)
        if job is None:
            estimate = estimate_memory(ctx.cfg, ctx.plan)["update_actor"]
            job = UpdateJob(ctx, 0, 1)
        t0 = time.perf_counter()
        job.train_step(ctx)
        seconds.append(time.perf_counter() - t0)
    digest = hashlib.sha256()
    for name, tensor in sorted(job.actor.engine.module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
    return {"checkpointing": checkpointing,
            "is_gradient_checkpointing": bool(job.actor.engine.module.is_gradient_checkpointing),
            "step_s": round(seconds[1], 3), "first_step_s": round(seconds[0], 3),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
            "plan_estimate_gib": estimate["total_gib"], "plan_estimate_parts_gib": estimate["parts_gib"],
            "weights_sha256": digest.hexdigest()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.variant:  # a child process: one variant
        print(json.dumps(variant(args.model, args.work, args.rows, args.tokens, args.variant == "on")))
        return {}
    from stages.model.shapes import parameter_count, save_shaped_model

    with tempfile.TemporaryDirectory(prefix="stagerl-bench-ckpt-") as tmp:
        model = save_shaped_model("qwen2.5-0.5b", Path(tmp) / "model", "fp32", num_layers=args.layers)
        results = {}
        for name in ("off", "on"):
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            out = subprocess.run([sys.executable, __file__, "--variant", name, "--model", str(model),
                                  "--work", str(Path(tmp) / name), "--rows", str(args.rows),
                                  "--tokens", str(args.tokens)], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"variant {name} failed:\n{out.stderr[-3000:]}")
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    off, on = results["off"], results["on"]
    result = {"model": f"qwen2.5-0.5b shape, {args.layers} of 24 layers, fp32",
              "parameters": parameter_count("qwen2.5-0.5b", args.layers),
              "rows": args.rows, "tokens_per_row": args.tokens, "threads": args.threads,
              "without": off, "with": on,
              "peak_rss_saved_gib": round(off["peak_rss_gib"] - on["peak_rss_gib"], 3),
              "time_ratio_with_vs_without": round(on["step_s"] / off["step_s"], 3),
              "same_weights": off["weights_sha256"] == on["weights_sha256"],
              "estimate_error": {k: round(v["plan_estimate_gib"] / v["peak_rss_gib"] - 1, 3)
                                 for k, v in (("without", off), ("with", on))}}
    path = REPO / "bench" / "results" / "checkpointing.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
