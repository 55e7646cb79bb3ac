"""Update bench: tokens/s of token-budget vs static micro-batches on skewed length distributions
(the same peak micro-batch size: budget = micro rows x (max prompt + max response)), and launch
vs compute time of one 2-rank update job. Prints JSON and writes bench/results/update.json.

    python bench/update.py [--rows 120] [--dists lognormal,mixture] [--repeat 3] [--skip-launch]

Rows: one rank's mini-batch. 120 is the seed example users bring (verl-command-lines.md: 60
prompts x 12 = 720 rows over 6 GPUs, ppo_mini_batch_size=60, use_dynamic_bsz). Distributions of
response lengths (prompts 3-32 tokens, responses at most 256):
  lognormal  median ~30 tokens, sigma 1 (a long tail; 1.6 % reach the maximum)
  mixture    4-32 tokens for 75 %, 32-128 for 20 %, 200-256 for 5 % (as bench/logprob.py: most
             answers short, a few running to the length limit, as RL rollouts do)
Goal (issue 6): token-budget >= 1.5x static tokens/s with <= 5 % padding. Compute is timed
in-process (one rank, UpdateJob.train_step, fastest of --repeat); the launch row runs the whole
stage (stages.update.run) on 2 ranks and reports the job's wall time against the ranks' training time.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

PROMPT, RESPONSE, MICRO = 32, 256, 4


def lognormal(rng, rows, max_resp):
    """Most responses short, a long tail to the maximum (lognormal, median ~30 tokens)."""
    import numpy as np

    return np.clip(rng.lognormal(np.log(30), 1.0, rows).astype(int), 1, max_resp)


def mixture(rng, rows, max_resp):
    """75 % 4-32 tokens, 20 % 32-128, 5 % 200-max (bench/logprob.py's distribution)."""
    import numpy as np

    u = rng.random(rows)
    return np.where(u < 0.75, rng.integers(4, 33, rows),
                    np.where(u < 0.95, rng.integers(32, 129, rows),
                             rng.integers(200, max_resp + 1, rows)))


DISTRIBUTIONS = {"lognormal": lognormal, "mixture": mixture}


def overrides(rows: int, mode: str, world: int = 1) -> list:
    common = [f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}",
              f"data.train_batch_size={rows // 4}", "actor_rollout_ref.rollout.n=4",
              f"actor_rollout_ref.actor.ppo_mini_batch_size={rows // 4}", f"trainer.n_gpus_per_node={world}"]
    if mode == "static":
        return common + [f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO}"]
    return common + ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                     f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={MICRO * (PROMPT + RESPONSE)}"]


def time_mode(tmp: Path, model: Path, rows: int, mode: str, repeat: int, dist: str) -> dict:
    from _update_inputs import make_ctx, write_inputs
    from stages.ranks.launch import init_distributed
    from stages.training.worker import UpdateJob

    ctx = make_ctx(tmp / f"{dist}-{mode}", model, 1, overrides(rows, mode))
    lengths = write_inputs(ctx, seed=7, response_lengths=DISTRIBUTIONS[dist])
    init_distributed("cpu")
    best, best_cpu, out = None, None, None
    for _ in range(repeat):
        job = UpdateJob(ctx, 0, 1)
        t0, c0 = time.perf_counter(), time.process_time()
        out = job.train_step(ctx)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        best = elapsed if best is None else min(best, elapsed)
        best_cpu = cpu if best_cpu is None else min(best_cpu, cpu)
    recs = out["records"]
    real = sum(r["real_tokens"] for r in recs)
    padded = sum(r["padded_tokens"] for r in recs)
    return {"micro_batches": len(recs), "real_tokens": real, "padded_tokens": padded,
            "padding_fraction": round(1 - real / padded, 4), "seconds": round(best, 3),
            "tokens_per_s": round(real / best, 1), "cpu_seconds": round(best_cpu, 3),
            "tokens_per_cpu_s": round(real / best_cpu, 1), "response_length_mean": float(lengths.mean()),
            "response_length_max": int(lengths.max())}


def launch_vs_compute(tmp: Path, model: Path, rows: int) -> dict:
    from _update_inputs import make_ctx, write_inputs
    from stages import update
    from storage.artifacts import read_file

    ctx = make_ctx(tmp / "launch", model, 1, overrides(rows, "budget", world=2))
    write_inputs(ctx, seed=7, response_lengths=lognormal)
    t0 = time.perf_counter()
    update.run(ctx)
    wall = time.perf_counter() - t0
    m = read_file(ctx.store, ctx.layout, 1, "update", "update/metrics.json")
    keys = ("timing/launch_s", "timing/rank_init_s", "timing/rank_train_s", "timing/rank_save_export_s",
            "timing/launch_overhead_s", "timing/upload_s")
    return {"world": 2, "stage_wall_s": round(wall, 3), **{k: round(m[k], 3) for k in keys},
            "compute_fraction": round(m["timing/rank_train_s"] / wall, 4)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=120)
    ap.add_argument("--dists", default="lognormal,mixture")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-launch", action="store_true")
    args = ap.parse_args(argv)
    from stages.model.tiny import save_tiny_model

    goal = {"speedup": 1.5, "padding_fraction": 0.05}
    with tempfile.TemporaryDirectory(prefix="stagerl-bench-update-") as d:
        tmp = Path(d)
        model = save_tiny_model(tmp / "model")
        result = {"rows": args.rows, "prompt_max": PROMPT, "response_max": RESPONSE,
                  "static_micro_rows": MICRO, "token_budget": MICRO * (PROMPT + RESPONSE),
                  "goal": goal, "distributions": {}}
        for dist in args.dists.split(","):
            static = time_mode(tmp, model, args.rows, "static", args.repeat, dist)
            budget = time_mode(tmp, model, args.rows, "budget", args.repeat, dist)
            speedup = round(budget["tokens_per_s"] / static["tokens_per_s"], 3)
            result["distributions"][dist] = {
                "static": static, "token_budget_mode": budget, "speedup": speedup,
                "speedup_cpu_time": round(budget["tokens_per_cpu_s"] / static["tokens_per_cpu_s"], 3),
                "meets_goal": speedup >= goal["speedup"]
                and budget["padding_fraction"] <= goal["padding_fraction"]}
        if not args.skip_launch:
            result["launch_vs_compute"] = launch_vs_compute(tmp, model, 64)
    out = REPO / "bench" / "results" / "update.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
