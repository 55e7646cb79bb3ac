"""Launch bench: per-step overhead of the two N-rank stages (logprob + update) on 2 CPU ranks,
with one persistent rank pool (stages.ranks.pool) vs a torchrun launch per call, 3 steps each.
Prints JSON and writes bench/results/launch.json.

    python bench/launch.py [--steps 3] [--small]
    python bench/launch.py --hostfile H --store s3://... --model DIR    # across hosts: launch_multinode.json

Sizes are the CPU default's (configs/tiny-cpu.yaml: 60 prompts x n=12 = 720 rows, prompt <= 64,
response <= 32 tokens, 2 ranks) on hand-made inputs (tests/_update_inputs.py); --small uses the
tests' 8 rows. Per step: wall time of logprob.run + update.run, the ranks' compute (logprob
forwards, update training; max over ranks) and overhead = wall - compute. Goal (issues 4 and 7):
everything but compute <= 10 % of a step, i.e. launches no longer dominate.
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

DEFAULT_SIZES = ["data.max_prompt_length=64", "data.max_response_length=32", "data.train_batch_size=60",
                 "actor_rollout_ref.rollout.n=12", "actor_rollout_ref.actor.ppo_mini_batch_size=60",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=30",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=60",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=60"]


def step_rows(steps: list) -> list:
    from storage.artifacts import read_file

    rows = []
    for s in steps:
        ctx, step = s["ctx"], s["ctx"].step
        lp_compute = max(sum(v for k, v in t.items() if k.endswith("_forward_s"))
                         for t in s["logprob"]["extra"]["rank_timings"])
        m = read_file(ctx.store, ctx.layout, step, "update", "update/metrics.json")
        wall = s["logprob_s"] + s["update_s"]
        compute = lp_compute + m["timing/rank_train_s"]
        rows.append({"step": step, "logprob_s": round(s["logprob_s"], 3), "update_s": round(s["update_s"], 3),
                     "compute_s": round(compute, 3), "overhead_s": round(wall - compute, 3),
                     "overhead_fraction": round((wall - compute) / wall, 4),
                     "logprob_rank_total_s": round(max(sum(v for k, v in t.items() if not k.endswith("_forward_s"))
                                                 for t in s["logprob"]["extra"]["rank_timings"]), 3),
                     "update_ranks_s": round(m["timing/launch_s"], 3),
                     "update_rank_init_s": round(m["timing/rank_init_s"], 3),
                     "update_rank_save_export_s": round(m["timing/rank_save_export_s"], 3),
                     "update_upload_s": round(m["timing/upload_s"], 3),
                     "engine_reused": m["update/engine_reused"]})
    return rows


def summary(rows: list, extra_s: float = 0.0) -> dict:
    wall = sum(r["logprob_s"] + r["update_s"] for r in rows) + extra_s
    compute = sum(r["compute_s"] for r in rows)
    return {"steps": rows, "mean_overhead_s": round(sum(r["overhead_s"] for r in rows) / len(rows), 3),
            "total_wall_s": round(wall, 3), "total_compute_s": round(compute, 3),
            "overhead_fraction_incl_start": round((wall - compute) / wall, 4)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="the tests' 8 rows instead of the CPU default's 720")
    ap.add_argument("--hostfile", help="multi-node: DeepSpeed's launcher over this hostfile (one rank per "
                    "host, 2 hosts) for both the per-call launches and the pool; needs --store and --model")
    ap.add_argument("--store", help="the store both runs write to (s3://...: every host reaches it)")
    ap.add_argument("--model", help="the tiny model folder, at the same path on every host")
    args = ap.parse_args(argv)
    if args.hostfile:
        return main_multinode(args)
    from _pool_steps import run_steps
    from stages.ranks.pool import RankPool
    from stages.model.tiny import save_tiny_model

    sizes = [] if args.small else DEFAULT_SIZES
    with tempfile.TemporaryDirectory(prefix="stagerl-bench-launch-") as d:
        tmp = Path(d)
        model = save_tiny_model(tmp / "model")
        launched = step_rows(run_steps(tmp / "launch", model, args.steps, sizes))
        t0 = time.perf_counter()
        with RankPool(2, "cpu") as pool:
            start_s = time.perf_counter() - t0
            pooled = step_rows(run_steps(tmp / "pool", model, args.steps, sizes, pool=pool))
    per_call, pool_sum = summary(launched), summary(pooled, start_s)
    result = {"world": 2, "rows_per_step": 8 if args.small else 720, "steps": args.steps,
              "per_call_launch": per_call, "rank_pool": {"pool_start_s": round(start_s, 3), **pool_sum},
              "overhead_saved_per_step_s": round(per_call["mean_overhead_s"] - pool_sum["mean_overhead_s"], 3),
              "goal": {"overhead_fraction": 0.10}}
    out = REPO / "bench" / "results" / "launch.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


def main_multinode(args) -> dict:
    """The same comparison across machines (tests/cluster/run_cluster.py --bench-launch runs it on
    network-namespace hosts): per-call DeepSpeed launches over the hostfile (pdsh, ssh) vs one
    multi-node rank pool started once; the two runs' final weights must be identical."""
    from _pool_steps import run_steps
    from stages.ranks.pool import RankPool
    from storage.weights import folder_manifest

    sizes = ([] if args.small else DEFAULT_SIZES) + [
        "trainer.launcher=deepspeed", f"trainer.hostfile={args.hostfile}", "trainer.nnodes=2", "trainer.n_gpus_per_node=1"]
    with tempfile.TemporaryDirectory(prefix="stagerl-bench-launch-") as d:
        tmp = Path(d)

        def steps(name, pool=None):
            return run_steps(tmp / name, Path(args.model), args.steps,
                             sizes + [f"storage.root={args.store}/{name}", f"storage.cache_dir={tmp / 'cache'}"], pool=pool)

        launched_runs = steps("launch")
        launched = step_rows(launched_runs)
        t0 = time.perf_counter()
        with RankPool(2, "cpu", hostfile=args.hostfile) as pool:
            start_s = time.perf_counter() - t0
            pooled_runs = steps("pool", pool)
            pooled = step_rows(pooled_runs)
        sums = [folder_manifest(r[-1]["ctx"].store, r[-1]["ctx"].layout.weights(args.steps))["checksum"]
                for r in (launched_runs, pooled_runs)]
    per_call, pool_sum = summary(launched), summary(pooled, start_s)
    result = {"world": 2, "hosts": 2, "hostfile": Path(args.hostfile).read_text().split("\n")[:2],
              "rows_per_step": 8 if args.small else 720, "steps": args.steps,
              "per_call_launch": per_call, "rank_pool": {"pool_start_s": round(start_s, 3), **pool_sum},
              "overhead_saved_per_step_s": round(per_call["mean_overhead_s"] - pool_sum["mean_overhead_s"], 3),
              "final_weights_identical": sums[0] == sums[1]}
    out = REPO / "bench" / "results" / "launch_multinode.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
