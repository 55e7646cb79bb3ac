"""Real size on the CPU: two RL steps with Qwen2.5-0.5B's architecture (random weights, `stagerl
model qwen2.5-0.5b`, fp32), each stage of each step in a fresh process, its peak resident memory
beside the plan's estimate (configs/memory.py). Prints JSON and writes bench/results/scale.json.

    python bench/scale.py [--variants full,lora16,...] [--threads 2]
    python bench/scale.py --estimates-only   # the stored peaks beside the current plan's estimates

The config is seed example A's (configs/gsm8k-qwen2.5-0.5b.yaml) with the paths made local, the
sizes cut to a CPU budget (4 prompts × 2 samples, prompts ≤ 32 tokens, responses ≤ 16, one
mini-batch of micro-batches of 4 rows), the hf engine and fp32. Variants (VARIANTS):
- `full`, `lora16` (actor_rollout_ref.model.lora_rank=16): GRPO without KL, no critic (full
  fine-tuning of actor and critic at 0.5B in fp32 does not fit this 24 GiB machine: the plan says so);
- `gae-lora16`: seed example A's estimator, GAE with the critic, LoRA rank 16 on actor and critic
  (critic.model.lora_rank; the critic's value head trains in full); `gae-lora16-bf16`: the same in
  bf16 (actor_rollout_ref.actor.deepspeed.dtype, which the critic follows; this CPU has AVX512-BF16);
- `*-nockpt`: gradient checkpointing off for actor and critic (it is on in base.yaml).
A stage runs as `stages.<stage>.run(ctx)` without a run session (it starts and stops what it
needs), so its process's peak (VmHWM, with its child processes' ru_maxrss) is that stage's alone:
imports, model load, compute. The estimate of a stage is the largest of its passes (the logprob
stage runs them one after another); with a critic the update's is the plan's `update` entry (both
roles in one process). Results are merged into scale.json by variant.
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
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

STAGES = ("rollout", "logprob", "reward", "advantage", "update")
NO_CKPT = ["actor_rollout_ref.model.enable_gradient_checkpointing=false",
           "critic.model.enable_gradient_checkpointing=false"]
LORA = ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32"]
GAE_LORA = LORA + ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4",
                   "critic.model.lora_rank=16", "critic.model.lora_alpha=32"]
BF16 = ["actor_rollout_ref.actor.deepspeed.dtype=bf16"]  # actor and critic (stages/training/engine.py)
VARIANTS = {"full": [], "full-nockpt": NO_CKPT, "lora16": LORA, "lora16-nockpt": LORA + NO_CKPT,
            "gae-lora16": GAE_LORA, "gae-lora16-bf16": GAE_LORA + BF16}
DEFAULT = "full,full-nockpt,lora16,lora16-nockpt,gae-lora16,gae-lora16-bf16"


def overrides(model: Path, data: Path, root: Path, variant: str) -> list:
    return [f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
            f"data.train_files={data}", f"data.val_files={data}", f"storage.root={root}",
            f"storage.cache_dir={root}/.cache", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "data.max_prompt_length=32", "data.max_response_length=16", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.hf_generate_batch_size=8",
            "actor_rollout_ref.actor.deepspeed.dtype=fp32", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
            "trainer.total_training_steps=2", "warmstart.enable=false", "trainer.logger=[console]",
            "reward.num_workers=1"] + VARIANTS[variant]


def stage_process(args) -> dict:
    """Child: run one stage of one step; its peak memory and time."""
    import resource

    from configs.loader import load_config
    from configs.suggest import make_plan
    from stages.context import StageContext

    t0 = time.perf_counter()
    cfg = load_config("gsm8k-qwen2.5-0.5b", json.loads(args.overrides))
    ctx = StageContext.create(cfg, make_plan(cfg), args.step)
    __import__(f"stages.{args.stage}", fromlist=["run"]).run(ctx)
    seconds = time.perf_counter() - t0
    hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"seconds": round(seconds, 2), "peak_rss_gib": round(max(hwm, children) / 2**20, 3)}


def stage_estimates(cfg_overrides: list) -> dict:
    from configs.loader import load_config
    from configs.memory import estimate_memory
    from configs.suggest import make_plan

    cfg = load_config("gsm8k-qwen2.5-0.5b", cfg_overrides)
    est = estimate_memory(cfg, make_plan(cfg))
    out = {"rollout": est["rollout"]["total_gib"], "update": est.get("update", est["update_actor"])["total_gib"]}
    passes = [v["total_gib"] for k, v in est.items() if k.startswith("logprob") and isinstance(v, dict)]
    out["logprob"] = max(passes) if passes else None
    return out


def run_variant(variant: str, model: Path, data: Path, tmp: Path, threads: int) -> dict:
    ov = overrides(model, data, tmp / variant, variant)
    estimate = stage_estimates(ov)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    steps = []
    for step in (1, 2):
        row = {}
        for stage in STAGES:
            out = subprocess.run([sys.executable, __file__, "--stage", stage, "--step", str(step),
                                  "--overrides", json.dumps(ov)], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{variant} step {step} {stage} failed:\n{out.stderr[-3000:]}")
            row[stage] = json.loads(out.stdout.strip().splitlines()[-1])
        steps.append(row)
    table = {stage: {"seconds": [s[stage]["seconds"] for s in steps],
                     "peak_rss_gib": max(s[stage]["peak_rss_gib"] for s in steps)} for stage in STAGES}
    return with_estimates(table, estimate)


def with_estimates(table: dict, estimate: dict) -> dict:
    for stage in STAGES:
        est, peak = estimate.get(stage), table[stage]["peak_rss_gib"]
        table[stage].update(plan_estimate_gib=est, estimate_error=round(est / peak - 1, 3) if est else None)
    return table


def estimates_only(path: Path) -> dict:
    """The stored measurements beside the current plan's estimates (no run: config.json only)."""
    from stages.model.shapes import shaped_config

    result = json.loads(path.read_text())
    with tempfile.TemporaryDirectory(prefix="stagerl-bench-scale-") as tmp_name:
        folder = Path(tmp_name)
        shaped_config("qwen2.5-0.5b").save_pretrained(folder)
        for variant, table in result["variants"].items():
            if "error" not in table:
                with_estimates(table, stage_estimates(overrides(folder, folder / "none.parquet", folder, variant)))
    result["estimates_from"] = "the plan at the time of --estimates-only (configs/memory.py)"
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=DEFAULT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--estimates-only", action="store_true",
                    help="rewrite scale.json's estimate columns from the current plan; run nothing")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--step", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--overrides", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stage:
        print(json.dumps(stage_process(args)))
        return {}
    path = REPO / "bench" / "results" / "scale.json"
    if args.estimates_only:
        result = estimates_only(path)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return result
    from stages.data.tools import write_arith_dataset
    from stages.model.shapes import save_shaped_model

    result = {"model": "qwen2.5-0.5b shape (494,032,768 parameters), fp32, random weights",
              "rows_per_step": 8, "threads": args.threads, "variants": {}}
    with tempfile.TemporaryDirectory(prefix="stagerl-bench-scale-") as tmp_name:
        tmp = Path(tmp_name)
        model = save_shaped_model("qwen2.5-0.5b", tmp / "model", "fp32")
        data = write_arith_dataset(tmp / "train.parquet", n=16)
        for variant in args.variants.split(","):
            t0 = time.perf_counter()
            try:
                result["variants"][variant] = run_variant(variant, model, data, tmp, args.threads)
            except SystemExit as failed:  # the others still run; the failure is the finding
                result["variants"][variant] = {"error": str(failed)[-3000:]}
            result["variants"][variant].update(wall_s=round(time.perf_counter() - t0, 1),
                                               date=time.strftime("%Y-%m-%d"), overrides=VARIANTS[variant])
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():  # variants not run this time keep their last figures
        result["variants"] = {**json.loads(path.read_text()).get("variants", {}), **result["variants"]}
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
