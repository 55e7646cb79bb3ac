"""Log-prob stage bench: static vs token-budget (dynamic) micro-batches, each padded and packed
(use_remove_padding), on a skewed length distribution: throughput in real tokens per second of
the actor forward (wall and CPU time), padding fraction, micro-batches; and the stage's peak RSS
at 720 and 2,880 rows (goal: within 10 %: memory follows the micro-batch, not the step). Each
case runs the real stage (stages.logprob.run, one in-process rank) in a fresh Python process over
a local store. Prints JSON and writes bench/results/logprob.json.

    python bench/logprob.py [--rows 720] [--repeat 7] [--processes 3] [--out bench/results/logprob.json]

Skewed lengths: prompts are tokenized arith questions (~20 tokens); responses are 4-32 tokens
for 75 % of rows, 32-128 for 20 %, 200-256 for 5 % (seeded).

Micro-batches are stages.batches.binning's (the update's grouping). Goal: token budget >= 1.5x static
(padded) tokens/s with <= 5 % padding, and packed (use_remove_padding) no slower than padded.
The budget of the dynamic cases gives about as many micro-batches as the static split; the
`*_same_peak` case uses the static split's largest micro-batch (padded tokens) as the budget,
the same memory peak (as bench/update.py compares).
"""
import argparse
import json
import os
import random
import resource
import statistics
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
    from stages.data.tools import make_arith_dataset
    from stages.model.models import load_tokenizer
    from storage.artifacts import write_table
    from storage.schemas import make_table

    prompts = rows // N
    overrides = [f"storage.root={root}", "trainer.experiment_name=bench", "trainer.n_gpus_per_node=1", "warmstart.enable=false",
                 f"actor_rollout_ref.model.path={model_dir}", f"data.train_batch_size={prompts}",
                 f"actor_rollout_ref.rollout.n={N}", f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts // 2}",  # 2 mini-batches: the actor pass runs
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
    timings = manifest["extra"]["rank_timings"][0]
    fwd, cpu = timings["actor_forward_s"], timings["actor_forward_cpu_s"]
    return {"rows": args.case_rows, "mode": "dynamic" if args.dynamic else "static", "packed": args.packed,
            "budget": args.budget if args.dynamic else None,
            "micro_batch_rows": None if args.dynamic else STATIC_MICRO,
            "micro_batches": load["micro_batches"], "real_tokens": load["real_tokens"],
            "padded_tokens": load["padded_tokens"], "padding_fraction": round(load["padding_fraction"], 4),
            "max_tokens_per_micro_batch": load["max_tokens_per_micro_batch"],
            "actor_forward_s": fwd, "tokens_per_s": round(load["real_tokens"] / fwd, 1),
            "actor_forward_cpu_s": cpu, "tokens_per_cpu_s": round(load["real_tokens"] / max(cpu, 1e-9), 1),
            "stage_wall_s": round(wall, 3),
            "peak_rss_mb_before_stage": round(rss_before / 1024, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def run_timing(args) -> dict:
    """Every case's forward, interleaved, `repeat` times in this (fresh) process: the rank's work
    of the stage (stages.logprob.rank_main: micro-batches, model load, forward). On a shared
    machine, load from other work then spreads over all cases alike."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from stages import logprob

    cases = json.loads(args.cases)
    ctxs = {name: make_step(Path(args.root) / name, Path(args.model), args.case_rows, dynamic, budget, packed)
            for name, (dynamic, budget, packed) in cases.items()}
    runs = {name: [] for name in cases}
    for _ in range(args.repeat):
        for name, ctx in ctxs.items():
            out = logprob.rank_main(ctx, 0, 1)
            load, timings = out["loads"]["actor"], out["timings"]
            fwd, cpu = timings["actor_forward_s"], timings["actor_forward_cpu_s"]
            runs[name].append({"actor_forward_s": fwd, "tokens_per_s": round(load["real_tokens"] / fwd, 1),
                               "actor_forward_cpu_s": cpu,
                               "tokens_per_cpu_s": round(load["real_tokens"] / max(cpu, 1e-9), 1)})
    return runs


def child(model: Path, rows: int, dynamic: bool, budget: int, packed: bool = False,
          timing: dict | None = None, repeat: int = 1) -> dict:
    with tempfile.TemporaryDirectory(prefix="lp-bench-") as root:
        cmd = [sys.executable, __file__, "--case", "--root", root, "--model", str(model),
               "--case-rows", str(rows), "--budget", str(budget)] + (["--dynamic"] if dynamic else []) \
            + (["--packed"] if packed else []) \
            + (["--cases", json.dumps(timing), "--repeat", str(repeat)] if timing else [])
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   TOKENIZERS_PARALLELISM="false")
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=1800)
        if out.returncode:
            raise RuntimeError(f"bench case failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=720)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--processes", type=int, default=3, help="timing processes (speed-ups: their median)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "logprob.json"))
    ap.add_argument("--case", action="store_true")
    ap.add_argument("--root"), ap.add_argument("--model")
    ap.add_argument("--case-rows", type=int), ap.add_argument("--dynamic", action="store_true")
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--cases", help="JSON {name: [dynamic, budget, packed]}: time them interleaved")
    args = ap.parse_args()
    if args.case:
        result = run_timing(args) if args.cases else run_case(args)
        sys.stdout.write("\n" + json.dumps(result) + "\n")
        return
    from stages.model.tiny import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="lp-bench-model-") as tmp:
        model = save_tiny_model(Path(tmp) / "tiny")
        first = child(model, args.rows, False, 0)
        # a budget giving about as many micro-batches as the static split, and one giving the
        # same peak micro-batch (padded tokens) as the static split
        budget = max(64 + MAX_RESPONSE, first["real_tokens"] // first["micro_batches"])
        peak = first["max_tokens_per_micro_batch"]
        cases = {"static_padded": (False, 0, False), "dynamic_padded": (True, budget, False),
                 "static_packed": (False, 0, True), "dynamic_packed": (True, budget, True),
                 "dynamic_packed_same_peak": (True, peak, True)}
        # one real stage run per case (its own process: loads, stage wall time, peak RSS) ...
        stage = {name: child(model, args.rows, *case) for name, case in cases.items()}
        # ... and the forward timed `repeat` times, all cases interleaved in one process
        per_process = [child(model, args.rows, False, 0, timing=cases, repeat=args.repeat)
                       for _ in range(args.processes)]
        runs = {name: [x for one in per_process for x in one[name]] for name in cases}
        rss = {str(n): child(model, n, False, 0) for n in (720, 2880)}
    best = {name: dict(stage[name], **max(r, key=lambda x: x["tokens_per_s"])) for name, r in runs.items()}
    best_cpu = {name: max(x["tokens_per_cpu_s"] for x in r) for name, r in runs.items()}

    median_cpu = {name: statistics.median(x["tokens_per_cpu_s"] for x in r) for name, r in runs.items()}

    def ratio(a: str, b: str, cpu: bool = False) -> float:
        """The median over the timing processes of each one's best-of-repeat ratio."""
        key = "tokens_per_cpu_s" if cpu else "tokens_per_s"
        return round(statistics.median(max(x[key] for x in one[a]) / max(x[key] for x in one[b])
                                       for one in per_process), 3)

    def median_ratio(a: str, b: str) -> float:
        return round(median_cpu[a] / median_cpu[b], 3)

    goal = {"speedup": 1.5, "padding_fraction": 0.05}
    budget_cases = ("dynamic_padded", "dynamic_packed", "dynamic_packed_same_peak")
    results = {
        "cpus": os.cpu_count(), "omp_threads": os.environ.get("OMP_NUM_THREADS", "1"),
        "model": "tiny Qwen2 (stages.model.tiny defaults)", "rows": args.rows, "rows_per_prompt": N,
        "length_distribution": "prompt ~20 tokens; response 4-32 (75 %), 32-128 (20 %), 200-256 (5 %)",
        "note": ("micro-batches from stages.batches.binning (the update's grouping). Static: 60 consecutive rows of the "
                 "rank's balanced order, one sequence per tensor row (padded) or packed into bins as wide as "
                 "the micro-batch's longest sequence (use_remove_padding). Token budget: at most `budget` "
                 "padded tokens, runs of rows sorted by length (stages.batches.binning), packed or not. Speed-ups are "
                 "best-of-repeat tokens/s of the actor forward (all cases timed in turn in one process, "
                 "forward_runs) against static padded, the median of `processes` such processes, in wall "
                 "time and in CPU time (the machine may be shared); stage_runs: one real stage run per case "
                 "in its own process (loads, peak RSS)."),
        "goal": goal,
        "summary": {name: {"tokens_per_s": b["tokens_per_s"], "tokens_per_cpu_s": best_cpu[name],
                           "tokens_per_cpu_s_median": median_cpu[name],
                           "padding_fraction": b["padding_fraction"], "micro_batches": b["micro_batches"],
                           "budget": b["budget"], "max_tokens_per_micro_batch": b["max_tokens_per_micro_batch"],
                           "speedup_vs_static_padded": ratio(name, "static_padded"),
                           "speedup_vs_static_padded_cpu_time": ratio(name, "static_padded", cpu=True)}
                    for name, b in best.items()},
        "goal_check": {
            **{f"{name}_vs_static_padded": {
                "speedup": ratio(name, "static_padded"), "speedup_cpu_time": ratio(name, "static_padded", True),
                "speedup_cpu_time_median": median_ratio(name, "static_padded"),
                "padding_fraction": best[name]["padding_fraction"],
                "meets_goal": ratio(name, "static_padded", True) >= goal["speedup"]
                and best[name]["padding_fraction"] <= goal["padding_fraction"]} for name in budget_cases},
            "static_packed_vs_static_padded": {
                "speedup": ratio("static_packed", "static_padded"),
                "speedup_cpu_time": ratio("static_packed", "static_padded", True),
                "speedup_cpu_time_median": median_ratio("static_packed", "static_padded"),
                "no_slower": ratio("static_packed", "static_padded", True) >= 1.0},
            "dynamic_packed_vs_dynamic_padded": {
                "speedup": ratio("dynamic_packed", "dynamic_padded"),
                "speedup_cpu_time": ratio("dynamic_packed", "dynamic_padded", True),
                "speedup_cpu_time_median": median_ratio("dynamic_packed", "dynamic_padded"),
                "note": "the same micro-batches (a token budget always packs): any difference is noise"}},
        "budget_tokens": budget, "budget_tokens_same_peak": peak, "repeat": args.repeat,
        "processes": args.processes,
        "best": best, "stage_runs": stage, "forward_runs": runs,
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
