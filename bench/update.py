"""Update bench: tokens/s of token-budget vs static micro-batches on a skewed length distribution
(the same peak micro-batch size: budget = micro rows x (max prompt + max response)), and launch
vs compute time of one 2-rank update job. Prints JSON and writes bench/results/update.json.

    python bench/update.py [--rows 64] [--repeat 2] [--skip-launch]

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


def skewed(rng, rows, max_resp):
    """Most responses short, a long tail to the maximum (lognormal, median ~30 tokens)."""
    import numpy as np

    return np.clip(rng.lognormal(np.log(30), 1.0, rows).astype(int), 1, max_resp)


def overrides(rows: int, mode: str, world: int = 1) -> list:
    common = [f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}",
              f"data.train_batch_size={rows // 4}", "actor_rollout_ref.rollout.n=4",
              f"actor_rollout_ref.actor.ppo_mini_batch_size={rows // 4}", f"trainer.n_gpus_per_node={world}"]
    if mode == "static":
        return common + [f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO}"]
    return common + ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                     f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={MICRO * (PROMPT + RESPONSE)}"]


def time_mode(tmp: Path, model: Path, rows: int, mode: str, repeat: int) -> dict:
    from _update_inputs import make_ctx, write_inputs
    from stages.launch import init_distributed
    from stages.update_worker import UpdateJob

    ctx = make_ctx(tmp / mode, model, 1, overrides(rows, mode))
    lengths = write_inputs(ctx, seed=7, response_lengths=skewed)
    init_distributed("cpu")
    best, out = None, None
    for _ in range(repeat):
        job = UpdateJob(ctx, 0, 1)
        t0 = time.perf_counter()
        out = job.train_step(ctx)
        elapsed = time.perf_counter() - t0
        best = elapsed if best is None else min(best, elapsed)
    recs = out["records"]
    real = sum(r["real_tokens"] for r in recs)
    padded = sum(r["padded_tokens"] for r in recs)
    return {"micro_batches": len(recs), "real_tokens": real, "padded_tokens": padded,
            "padding_fraction": round(1 - real / padded, 4), "seconds": round(best, 3),
            "tokens_per_s": round(real / best, 1), "response_length_mean": float(lengths.mean()),
            "response_length_max": int(lengths.max())}


def launch_vs_compute(tmp: Path, model: Path, rows: int) -> dict:
    from _update_inputs import make_ctx, write_inputs
    from stages import update
    from storage.artifacts import read_file

    ctx = make_ctx(tmp / "launch", model, 1, overrides(rows, "budget", world=2))
    write_inputs(ctx, seed=7, response_lengths=skewed)
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
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-launch", action="store_true")
    args = ap.parse_args(argv)
    from stages.tiny_model import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="stagerl-bench-update-") as d:
        tmp = Path(d)
        model = save_tiny_model(tmp / "model")
        static = time_mode(tmp, model, args.rows, "static", args.repeat)
        budget = time_mode(tmp, model, args.rows, "budget", args.repeat)
        result = {"rows": args.rows, "prompt_max": PROMPT, "response_max": RESPONSE,
                  "static_micro_rows": MICRO, "token_budget": MICRO * (PROMPT + RESPONSE),
                  "static": static, "token_budget_mode": budget,
                  "speedup": round(budget["tokens_per_s"] / static["tokens_per_s"], 3),
                  "goal": {"speedup": 1.5, "padding_fraction": 0.05}}
        if not args.skip_launch:
            result["launch_vs_compute"] = launch_vs_compute(tmp, model, args.rows)
    out = REPO / "bench" / "results" / "update.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
