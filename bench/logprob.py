"""Log-prob stage bench: static vs token-budget (dynamic) micro-batches, each padded and packed
(use_remove_padding), on a skewed length distribution (throughput in real tokens/s of the actor
forward, padding fraction), and the
stage's peak RSS at 720 and 2,880 rows (goal: within 10 %: memory follows the micro-batch,
not the step). Each case runs the real stage (stages.logprob.run, one in-process rank) in a
fresh Python process over a local store. Prints JSON and writes bench/results/logprob.json.

    python bench/logprob.py [--rows 720] [--repeat 2] [--out bench/results/logprob.json]

Skewed lengths: prompts are tokenized arith questions (~20 tokens); responses are 4-32 tokens
for 75 % of rows, 32-128 for 20 %, 200-256 for 5 % (seeded).
"""
import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))

MAX_RESPONSE = 256
STATIC_MICRO = 60  # tiny-cpu's log_prob_micro_batch_size_per_gpu
N = 12


def response_length(rng: random.Random) -> int:
    u = rng.random()
    if u < 0.75:
        return rng.randint(4, 32)
    if u < 0.95:
        return rng.randint(32, 128)
    return rng.randint(200, MAX_RESPONSE)


def make_step(root: Path, model_dir: Path, rows: int, dynamic: bool, budget: int, packed: bool = False):
    from configs.loader import load_config
    from configs.suggest import make_plan
    from stages.context import StageContext
    from stages.data_tools import make_arith_dataset
    from stages.models import load_tokenizer
    from storage.artifacts import write_table
    from storage.schemas import make_table

    prompts = rows // N
    overrides = [f"storage.root={root}", "trainer.experiment_name=bench", "trainer.n_gpus_per_node=1", "warmstart.enable=false",
                 f"actor_rollout_ref.model.path={model_dir}", f"data.train_batch_size={prompts}",
                 f"actor_rollout_ref.rollout.n={N}", f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
                 "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
                 f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={STATIC_MICRO}",
                 "data.max_prompt_length=64", f"data.max_response_length={MAX_RESPONSE}"]
    if packed:
        overrides += ["actor_rollout_ref.model.use_remove_padding=true"]
    if dynamic:
        overrides += ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                      f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}"]
    cfg = load_config("tiny-cpu", overrides)
    ctx = StageContext.create(cfg, make_plan(cfg), 1)
    tok = load_tokenizer(model_dir)
    rng = random.Random(0)
    cols = {k: [] for k in ("uid", "sample_index", "prompt", "prompt_ids", "response", "response_ids",
                            "response_length", "finish_reason", "data_source", "ground_truth", "extra_info")}
    for p, rec in enumerate(make_arith_dataset(prompts, seed=0, difficulty=3)):
        text = tok.apply_chat_template(rec["prompt"], add_generation_prompt=True, tokenize=False)
        ids = tok(text)["input_ids"]
        for k in range(N):
            length = response_length(rng)
            for key, value in (("uid", f"u{p}"), ("sample_index", k), ("prompt", text), ("prompt_ids", ids),
                               ("response", ""), ("response_ids", [rng.randrange(3, len(tok)) for _ in range(length)]),
                               ("response_length", length), ("finish_reason", "stop"),
                               ("data_source", "stagerl/arith"), ("ground_truth", "0"), ("extra_info", "{}")):
                cols[key].append(value)
    write_table(ctx.store, ctx.layout, 1, "rollout", make_table("rollout", cols), fingerprint="bench")
    return ctx


def run_case(args) -> dict:
    """One stage run in this (fresh) process."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from stages import logprob

    ctx = make_step(Path(args.root), Path(args.model), args.case_rows, args.dynamic, args.budget, args.packed)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    manifest = logprob.run(ctx)
    wall = time.perf_counter() - t0
    load = manifest["extra"]["loads"]["actor"][0]
    fwd = manifest["extra"]["rank_timings"][0]["actor_forward_s"]
    return {"rows": args.case_rows, "mode": "dynamic" if args.dynamic else "static", "packed": args.packed,
            "budget": args.budget if args.dynamic else None,
            "micro_batch_rows": None if args.dynamic else STATIC_MICRO,
            "micro_batches": load["micro_batches"], "real_tokens": load["real_tokens"],
            "padded_tokens": load["padded_tokens"], "padding_fraction": round(load["padding_fraction"], 4),
            "max_tokens_per_micro_batch": load["max_tokens_per_micro_batch"],
            "actor_forward_s": fwd, "tokens_per_s": round(load["real_tokens"] / fwd, 1),
            "stage_wall_s": round(wall, 3),
            "peak_rss_mb_before_stage": round(rss_before / 1024, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def child(model: Path, rows: int, dynamic: bool, budget: int, packed: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="lp-bench-") as root:
        cmd = [sys.executable, __file__, "--case", "--root", root, "--model", str(model),
               "--case-rows", str(rows), "--budget", str(budget)] + (["--dynamic"] if dynamic else []) \
            + (["--packed"] if packed else [])
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   TOKENIZERS_PARALLELISM="false")
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=1800)
        if out.returncode:
            raise RuntimeError(f"bench case failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=720)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "logprob.json"))
    ap.add_argument("--case", action="store_true")
    ap.add_argument("--root"), ap.add_argument("--model")
    ap.add_argument("--case-rows", type=int), ap.add_argument("--dynamic", action="store_true")
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--packed", action="store_true")
    args = ap.parse_args()
    if args.case:
        result = run_case(args)
        sys.stdout.write("\n" + json.dumps(result) + "\n")
        return
    from stages.tiny_model import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="lp-bench-model-") as tmp:
        model = save_tiny_model(Path(tmp) / "tiny")
        static = [child(model, args.rows, False, 0) for _ in range(args.repeat)]
        # a budget giving about as many micro-batches as the static split
        budget = max(64 + MAX_RESPONSE, static[0]["real_tokens"] // static[0]["micro_batches"])
        runs = {"static_padded": static,
                "dynamic_padded": [child(model, args.rows, True, budget) for _ in range(args.repeat)],
                "static_packed": [child(model, args.rows, False, 0, True) for _ in range(args.repeat)],
                "dynamic_packed": [child(model, args.rows, True, budget, True) for _ in range(args.repeat)]}
        rss = {str(n): child(model, n, False, 0) for n in (720, 2880)}
    best = {name: max(r, key=lambda x: x["tokens_per_s"]) for name, r in runs.items()}
    base = best["static_padded"]["tokens_per_s"]
    results = {
        "cpus": os.cpu_count(), "omp_threads": os.environ.get("OMP_NUM_THREADS", "1"),
        "model": "tiny Qwen2 (stages.tiny_model defaults)", "rows": args.rows, "rows_per_prompt": N,
        "length_distribution": "prompt ~20 tokens; response 4-32 (75 %), 32-128 (20 %), 200-256 (5 %)",
        "note": ("static micro-batches are consecutive rows of the rank's balanced order (sorted by workload, "
                 "so similar lengths share a micro-batch); token-budget micro-batches balance workload, so "
                 "each mixes long and short rows: padded they waste most tokens, packed "
                 "(use_remove_padding) they have none"),
        "summary": {name: {"tokens_per_s": b["tokens_per_s"], "padding_fraction": b["padding_fraction"],
                           "micro_batches": b["micro_batches"], "speedup_vs_static_padded": round(b["tokens_per_s"] / base, 3)}
                    for name, b in best.items()},
        "budget_tokens": budget, "best": best, "runs": runs,
        "peak_rss": {n: {"rows": r["rows"], "peak_rss_mb": r["peak_rss_mb"],
                         "peak_rss_mb_before_stage": r["peak_rss_mb_before_stage"],
                         "micro_batches": r["micro_batches"]} for n, r in rss.items()},
        "peak_rss_ratio_2880_vs_720": round(rss["2880"]["peak_rss_mb"] / rss["720"]["peak_rss_mb"], 3),
    }
    text = json.dumps(results, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
