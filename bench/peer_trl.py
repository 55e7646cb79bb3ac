"""Peer bench: stagerl's real `rl-train` flow against TRL's GRPOTrainer on the same GRPO work,
interleaved, several fresh-process runs each. Writes bench/results/peer_trl.json.

    python bench/peer_trl.py [--runs 3] [--full-rounds 2] [--steps 10] [--micro-batches 120 360 720]
                             [--variants trl trl-2rank stagerl-hf-1rank stagerl-hf-2rank ...] [--with-vllm]

`make bench-peer` builds TRL's own virtual environment (.venv-peer: torch + trl; TRL is never a
dependency of stagerl) and runs this with stagerl's .venv.

The work (the same on both sides): the demo's tiny model (flows.demo.MODEL_OPTIONS, random init,
no warm start), single-digit addition prompts "What is a + b?" (exactly 16 tokens after the chat
template), 60 prompts x 12 samples = 720 completions per step, at most 16 response tokens,
temperature 1.0, top_p 1, no top-k, GRPO advantages (group mean and std), no KL (stagerl:
use_kl_loss=false, use_kl_in_reward=false; TRL: beta=0), the PPO clipped loss (epsilon 0.2)
averaged over all tokens of the step (stagerl: token-mean, the exact global token mean; TRL:
loss_type="dapo", which divides by the active tokens of the whole generation batch), one AdamW
step per RL step (lr 1e-3, betas 0.9/0.999, weight decay 0.01, constant schedule, grad clip 1.0),
micro-batches swept over 120, 360 and 720 rows per optimizer step's micro-batch over all ranks
(stagerl ppo_micro_batch_size_per_gpu = rows / ranks; TRL per_device_train_batch_size = rows / ranks
with 720 / rows accumulation steps = steps_per_generation), the reward of bench/peer/reward.py (on
both sides in the trainer's process: stagerl's reward.num_workers=0, TRL's reward_funcs), no
validation, evaluation or checkpoints, fp32. TRL generates the step's rows in one transformers
`generate` call; stagerl's hf engine in its own decode loop over the same transformers model, all
rows at once (hf_generate_batch_size=120 prompts covers the 60), each row leaving as it ends.

Variants: trl (one process) and trl-2rank (two processes under torchrun, gloo, as TRL runs data
parallel); stagerl-{hf|vllm}-{N}rank (trainer.n_gpus_per_node=N; vllm: rollout.name=vllm,
enforce_eager=true, only with --with-vllm or named), with stagerl's default orchestration (stage
tasks in the rl-train flow run); a `-subflow` suffix sets orchestration.step_subflow=true, `-s<N>`
trainer.staleness=N (stagerl-hf-1rank-s1@mb360, in the default set: step k+1's rollout beside step
k's update, the hf engine then in its own process; "warm step" is then the period between step ends;
in the first --staleness-runs rounds only, 1 by default, which keeps the sweep under 15 minutes). Each is
run at every --micro-batches size (named variant@mbM; a variant named with @mbM runs at that size
only). Threads: 2 per side: TRL OMP_NUM_THREADS=2 + torch.set_num_threads(2) with one process, 1
each with two; stagerl's flow process OMP_NUM_THREADS=2 (rollout, and logprob/update with 1 rank);
with 2 ranks the rank pool gives each rank 1 thread.

Per run, from one instant t0 (the parent's time.time() just before it starts the process):
  startup_s    t0 -> step 1 begins (TRL: on_step_begin of step 1, before its generation; stagerl:
               the top of the flow's step-1 loop iteration = its log time minus timing_s/step)
  warm_step_s  mean period of steps 2..N: (end of step N - end of step 1) / (N - 1)
  wall_s       begin of step 1 -> end of step N (TRL: on_step_end; stagerl: the flow logs the step)
  startup_and_wall_s  t0 -> end of step N: the N-step wall with start-up included (issue 34's)
  split_s      mean over steps 2..N of the phases (stagerl: timing_s/{stage} as bench/step.py reads
               them, "other" = the rest of the step; TRL: generate, reward, the rest of
               generate-and-score, and the rest of the step = forward/backward/optimizer)
  time_split_s stagerl: flows.step_report.time_split of each step (generate, update_train, and
               everything outside them by part), mean over steps 2..N
Rounds: every setting runs once per round, interleaved, in the first --full-rounds rounds (2);
the rounds after them, up to --runs (3), run each variant's fastest setting so far only (the one
best vs best compares), so those settings get 3 runs and the others 2 (the full sweep in every
round took 16 minutes, 37 runs of ~25 s). Best vs best takes the lowest median as it stands after
all rounds: a third run can leave another setting (of 2 runs) the fastest.
Medians over runs per variant; ratio_vs_trl = variant median / the median of TRL at the same ranks
and micro-batch (< 1: faster); best_vs_best = each side at its fastest micro-batch per rank count
(its lowest median warm s/step) against the other's, which is what a user comparing the two runs."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))
PEER = REPO / "bench" / "peer"
# -s1: trainer.staleness=1 (step k+1's rollout beside step k's update), at stagerl's best 1-rank micro-batch
DEFAULT_VARIANTS = ("trl", "trl-2rank", "stagerl-hf-1rank", "stagerl-hf-2rank", "stagerl-hf-1rank-s1@mb360")
DEFAULT_MICRO_BATCHES = (120, 360, 720)
VLLM_VARIANT = "stagerl-vllm-1rank"
VARIANT_RE = re.compile(r"^stagerl-(hf|vllm)-(\d+)rank(-subflow)?(?:-s(\d+))?$")
TRL_RE = re.compile(r"^trl(?:-(\d+)rank)?$")
STAGES = ("rollout", "logprob", "reward", "advantage", "update")
WORK = {"prompts": 60, "n": 12, "micro_batch": 120, "max_prompt_tokens": 16, "max_response_tokens": 16,
        "temperature": 1.0, "top_p": 1.0, "lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.01,
        "grad_clip": 1.0, "clip_epsilon": 0.2, "seed": 1, "train_prompts": 1000}


def parse_variant(name: str) -> dict:
    """`<variant>@mb<M>`: M rows per micro-batch over all ranks (each of N ranks takes M / N)."""
    base, _, micro = name.partition("@mb")
    micro_rows = int(micro) if micro.isdigit() else WORK["micro_batch"]
    match = TRL_RE.match(base)
    if match:
        return {"side": "trl", "ranks": int(match.group(1) or 1), "micro_batch": micro_rows, "base": base}
    match = VARIANT_RE.match(base)
    if not match or (micro and not micro.isdigit()):
        raise SystemExit(f"unknown variant {name!r}: use trl[-Nrank] or stagerl-{{hf|vllm}}-{{N}}rank[-subflow][-s<staleness>], "
                         f"optionally @mb<rows per micro-batch>")
    return {"side": "stagerl", "engine": match.group(1), "ranks": int(match.group(2)),
            "step_subflow": bool(match.group(3)), "staleness": int(match.group(4) or 0),
            "micro_batch": micro_rows, "base": base}


def per_rank_micro(spec: dict) -> int:
    rows = WORK["prompts"] * WORK["n"]
    micro, ranks = spec["micro_batch"], spec["ranks"]
    if micro % ranks or rows % micro:
        raise SystemExit(f"micro-batch {micro} must divide the {rows} rows of a step and split evenly over "
                         f"{ranks} ranks")
    return micro // ranks


def build_inputs(work: Path) -> dict:
    """The tiny model and the prompt set; every templated prompt must fit max_prompt_tokens."""
    from flows.demo import MODEL_OPTIONS
    from stages.data.tools import make_arith_dataset, write_rows
    from stages.model.tiny import save_tiny_model
    from transformers import AutoTokenizer

    model = save_tiny_model(work / "model", **MODEL_OPTIONS)
    rows = make_arith_dataset(WORK["train_prompts"], seed=1, difficulty=1)
    for row in rows:  # "What is 3 + 4?" (16 tokens templated) instead of the demo's longer text
        question = f"What is {row['extra_info']['answer'].split(' = ')[0]}?"
        row["prompt"][0]["content"] = row["extra_info"]["question"] = question
    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = [len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]) for row in rows]
    too_long = [i for i, n in enumerate(lengths) if n > WORK["max_prompt_tokens"]]
    if too_long:
        raise SystemExit(f"prompt row {too_long[0]} has {lengths[too_long[0]]} tokens templated, more than "
                         f"{WORK['max_prompt_tokens']}")
    write_rows(rows, work / "train.parquet")
    write_rows(rows[:20], work / "val.parquet")
    return {"model": str(model), "train": str(work / "train.parquet"), "val": str(work / "val.parquet"),
            "prompt_tokens": {"min": min(lengths), "max": max(lengths)}}


def stagerl_overrides(spec: dict, inputs: dict, work: Path, steps: int) -> list[str]:
    w, actor, rollout = WORK, "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    out = [f"data.train_files={inputs['train']}", f"data.val_files={inputs['val']}",
           f"data.max_prompt_length={w['max_prompt_tokens']}", f"data.max_response_length={w['max_response_tokens']}",
           f"data.train_batch_size={w['prompts']}", f"data.seed={w['seed']}",
           f"actor_rollout_ref.model.path={inputs['model']}", f"storage.root={work / 'runs'}",
           f"{actor}.ppo_mini_batch_size={w['prompts']}", f"{actor}.ppo_micro_batch_size_per_gpu={per_rank_micro(spec)}",
           f"{actor}.ppo_epochs=1", f"{actor}.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
           "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=true",
           f"{actor}.loss_agg_mode=token-mean", f"{actor}.entropy_coeff=0.0", f"{actor}.clip_ratio={w['clip_epsilon']}",
           f"{actor}.clip_ratio_low={w['clip_epsilon']}", f"{actor}.clip_ratio_high={w['clip_epsilon']}",
           f"{actor}.optim.lr={w['lr']}", f"{actor}.optim.weight_decay={w['weight_decay']}",
           f"{actor}.optim.betas=[{w['betas'][0]},{w['betas'][1]}]", f"{actor}.optim.warmup_style=constant",
           f"{actor}.grad_clip={w['grad_clip']}", f"{actor}.deepspeed.dtype=fp32",
           f"{rollout}.n={w['n']}", f"{rollout}.temperature={w['temperature']}", f"{rollout}.top_p={w['top_p']}",
           f"{rollout}.top_k=-1", f"{rollout}.do_sample=true", f"{rollout}.log_prob_micro_batch_size_per_gpu={per_rank_micro(spec)}",
           f"{rollout}.hf_generate_batch_size=120", f"{rollout}.name={spec['engine']}", f"{rollout}.enforce_eager=true",
           f"{rollout}.dtype=float32",  # as TRL (bf16=False) and the update (deepspeed.dtype=fp32)
           f"custom_reward_function.path={PEER / 'reward.py'}", "custom_reward_function.name=compute_score",
           "reward.num_workers=0",  # the function in the reward stage's process, as TRL's reward_funcs run
           f"trainer.n_gpus_per_node={spec['ranks']}", "trainer.nnodes=1", "trainer.device=cpu",
           f"trainer.total_training_steps={steps}", f"trainer.seed={w['seed']}", "trainer.val_before_train=false",
           "trainer.test_freq=-1", "trainer.save_freq=-1", "warmstart.enable=false",
           f"orchestration.step_subflow={'true' if spec['step_subflow'] else 'false'}",
           f"trainer.staleness={spec.get('staleness', 0)}"]
    return out


def child_env(threads: int, prefect: dict | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions"), **(prefect or {})})
    return env


def run_child(cmd: list[str], env: dict, log: Path, timeout_s: float) -> tuple[float, float, int]:
    """(t0, t_exit, returncode); the child runs in its own session, killed whole on timeout."""
    t0 = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd + ["--t0", repr(t0)], cwd=str(REPO), env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = -9
    return t0, time.time(), code


def timeline(begin_1: float, ends: list[float], t0: float, t_exit: float) -> dict:
    steps = [ends[0] - begin_1] + [b - a for a, b in zip(ends, ends[1:])]
    warm = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else None
    return {"startup_s": round(begin_1 - t0, 3), "warm_step_s": round(warm, 3) if warm else None,
            "wall_s": round(ends[-1] - begin_1, 3), "startup_and_wall_s": round(ends[-1] - t0, 3),
            "process_s": round(t_exit - t0, 3),
            "step_s": [round(s, 3) for s in steps]}


def mean_after_first(values: list[float]) -> float:
    rest = values[1:] or values
    return round(sum(rest) / len(rest), 3)


def summarize_trl(raw: dict, t_exit: float) -> dict:
    out = timeline(raw["step_begin"][0], raw["step_end"], raw["t0"], t_exit)
    phases = raw["phases_s"]
    gen, rew, gas = phases.get("generate", []), phases.get("reward", []), phases.get("generate_and_score", [])
    split = {"generate": gen, "reward": rew,
             "score_other": [a - g - r for a, g, r in zip(gas, gen, rew)],
             "train_and_other": [s - a for s, a in zip(out["step_s"], gas)]}
    logs = {entry["step"]: entry for entry in raw["logs"] if "reward" in entry}
    out.update({"imports_s": round(raw["t_imported"] - raw["t0"], 3),
                "split_s": {k: mean_after_first(v) for k, v in split.items()},
                "reward_mean": [round(logs[k]["reward"], 4) for k in sorted(logs)],
                "response_length_mean": [round(logs[k]["completions/mean_length"], 2) for k in sorted(logs)],
                "prompt_tokens": raw["prompt_tokens"], "threads": raw["threads"],
                "versions": raw["versions"], "trl_config": raw["config"]})
    return out


def summarize_stagerl(raw: dict, t_exit: float) -> dict:
    steps = [e for e in raw["steps"] if "timing_s/step" in e["metrics"]]
    begin_1 = steps[0]["logged_at"] - steps[0]["metrics"]["timing_s/step"]
    out = timeline(begin_1, [e["logged_at"] for e in steps], raw["t0"], t_exit)
    per_stage = {s: [float(e["metrics"].get(f"timing_s/{s}", 0.0)) for e in steps] for s in STAGES}
    per_stage["other"] = [e["metrics"]["timing_s/step"] - sum(per_stage[s][i] for s in STAGES)
                          for i, e in enumerate(steps)]
    pick = lambda e, *keys: next((e["metrics"][k] for k in keys if k in e["metrics"]), None)
    began = raw.get("step1_rollout_began")
    from flows.step_report import time_split

    splits = [time_split(e["metrics"]) for e in steps]
    out.update({"imports_s": round(raw["t_imported"] - raw["t0"], 3),
                "split_s": {k: mean_after_first(v) for k, v in per_stage.items()},
                "time_split_s": {k: mean_after_first([s[k] or 0.0 for s in splits]) for k in splits[0]},
                "startup_s_by_rollout_manifest": round(began - raw["t0"], 3) if began else None,
                "reward_mean": [pick(e, "reward/score/mean", "critic/score/mean") for e in steps],
                "response_length_mean": [pick(e, "response_length/mean", "rollout/response_length/mean")
                                         for e in steps],
                "timing_s_per_step": [{k: v for k, v in e["metrics"].items() if k.startswith("timing_s/")}
                                      for e in steps],
                "threads": raw["threads"], "versions": raw["versions"]})
    return out


def run_variant(name: str, run: int, ctx: dict) -> dict:
    spec, work, args = parse_variant(name), ctx["work"], ctx["args"]
    out_json, log = work / f"{name}-r{run}.json", work / f"{name}-r{run}.log"
    if spec["side"] == "trl":
        threads = max(1, args.threads // spec["ranks"])  # 2 ranks: one thread each, as stagerl's rank pool
        launcher = [str(args.peer_python)] if spec["ranks"] == 1 else [
            str(args.peer_python), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['ranks']}"]
        cmd = [*launcher, str(PEER / "trl_grpo.py"), "--model", ctx["inputs"]["model"],
               "--data", ctx["inputs"]["train"], "--out", str(out_json), "--work-dir", str(work / f"trl-{name}-r{run}"),
               "--steps", str(args.steps), "--threads", str(threads),
               "--micro-batch", str(per_rank_micro(spec))]
        env = child_env(threads, None)
    else:
        experiment = f"peer-{name.replace('@', '-')}-r{run}"
        cmd = [sys.executable, str(PEER / "stagerl_run.py"), "--out", str(out_json), "--experiment", experiment,
               *stagerl_overrides(spec, ctx["inputs"], work, args.steps), *args.stagerl_overrides]
        env = child_env(args.threads, ctx["prefect"])
    server_cpu = process_cpu_s(ctx["server_pid"])
    t0, t_exit, code = run_child(cmd, env, log, args.run_timeout)
    result = {"variant": name, "run": run, "returncode": code, "log": str(log) if args.keep else None}
    if spec["side"] != "trl":  # the shared Prefect server's CPU while this run ran (TRL has none)
        result["prefect_server_cpu_s"] = round(process_cpu_s(ctx["server_pid"]) - server_cpu, 3)
    try:
        raw = json.loads(out_json.read_text())
        summary = (summarize_trl if spec["side"] == "trl" else summarize_stagerl)(raw, t_exit)
        result.update(summary)
        if raw.get("error"):
            result["error"] = raw["error"][-4000:]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        result["error"] = f"no usable result ({type(exc).__name__}: {exc}); log tail:\n{tail}"
    ok = "error" not in result and code == 0
    print(f"[{name} run {run}] " + (f"startup {result.get('startup_s')} s, warm {result.get('warm_step_s')} s/step, "
                                    f"wall {result.get('wall_s')} s" if ok else f"FAILED (exit {code}): {result.get('error', '')[-1500:]}"),
          flush=True)
    return result


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children so far."""
    import psutil

    proc = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in (proc, *proc.children(recursive=True)))


def aggregate(results: list[dict], variants: list[str]) -> dict:
    out = {}
    for name in variants:
        good = [r for r in results if r["variant"] == name and "error" not in r and r["returncode"] == 0]
        med = lambda key: round(statistics.median(r[key] for r in good), 3) if good and good[0].get(key) is not None else None
        out[name] = {"runs_ok": len(good), "runs_failed": sum(r["variant"] == name for r in results) - len(good),
                     **{k: med(k) for k in ("startup_s", "warm_step_s", "wall_s", "startup_and_wall_s", "process_s", "imports_s",
                                                "prefect_server_cpu_s")},
                     **{part: {k: round(statistics.median(r[part][k] for r in good), 3)
                               for k in (good[0][part] if good else {})}
                        for part in ("split_s", "time_split_s") if not good or part in good[0]}}
    for name, row in out.items():  # matched: TRL at the same ranks and micro-batch (else 1 rank)
        spec = parse_variant(name)
        if spec["side"] == "trl":
            continue
        trl = out.get(f"trl-{spec['ranks']}rank@mb{spec['micro_batch']}" if spec["ranks"] > 1 else
                      f"trl@mb{spec['micro_batch']}") or out.get(f"trl@mb{spec['micro_batch']}")
        if trl:
            row["ratio_vs_trl"] = ratios(row, trl)
    return out


def ratios(row: dict, trl: dict) -> dict:
    return {k: round(row[k] / trl[k], 3) if row.get(k) and trl.get(k) else None
            for k in ("startup_s", "warm_step_s", "wall_s", "startup_and_wall_s", "process_s")}


def fastest(median: dict) -> dict:
    """{variant without @mb: its setting with the lowest median warm s/step}."""
    groups: dict = {}
    for name, row in median.items():
        if row.get("warm_step_s"):
            groups.setdefault(parse_variant(name)["base"], []).append((row["warm_step_s"], name))
    return {base: min(entries)[1] for base, entries in groups.items()}


def round_variants(run: int, variants: list[str], results: list[dict], args) -> list[str]:
    """What round `run` runs: every setting in the first --full-rounds rounds; after them only
    each variant's fastest setting so far (`fastest`, what best vs best compares), which so get
    --runs runs and the others --full-rounds; a -s<N> variant in the first --staleness-runs rounds
    only."""
    if run >= args.full_rounds:
        best = set(fastest(aggregate(results, variants)).values())
        variants = [v for v in variants if v in best]
    return [v for v in variants if not (parse_variant(v).get("staleness", 0) and run >= args.staleness_runs)]


def best_vs_best(median: dict) -> dict:
    """Each side at its fastest micro-batch (lowest median warm s/step), per rank count: stagerl's
    best against TRL's best at the same ranks (and against TRL's best at any ranks)."""
    best = fastest(median)
    trl_any = min((median[n]["warm_step_s"], n) for b, n in best.items() if b.startswith("trl")) if any(
        b.startswith("trl") for b in best) else None
    out = {}
    for base, name in best.items():
        spec = parse_variant(name)
        if spec["side"] == "trl":
            continue
        trl_name = best.get("trl" if spec["ranks"] == 1 else f"trl-{spec['ranks']}rank") or best.get("trl")
        entry = {"stagerl": name, "stagerl_warm_step_s": median[name]["warm_step_s"]}
        if trl_name:
            entry.update({"trl": trl_name, "trl_warm_step_s": median[trl_name]["warm_step_s"],
                          "ratio": ratios(median[name], median[trl_name])})
        if trl_any:
            entry["vs_trl_fastest_any_ranks"] = {"trl": trl_any[1], "ratio": ratios(median[name], median[trl_any[1]])}
        out[base] = entry
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--staleness-runs", type=int, default=1,
                        help="rounds a -s<N> variant runs in (the first ones): it is reported beside TRL, "
                             "not in a matched ratio or best vs best, and one run keeps the sweep under 15 min")
    parser.add_argument("--full-rounds", type=int, default=2,
                        help="rounds that run every setting; the later ones (up to --runs) run each variant's "
                             "fastest setting so far only, which keeps the sweep under 15 minutes")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                        help="trl[-Nrank], stagerl-{hf|vllm}-Nrank[-subflow]; @mbM pins one micro-batch")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=list(DEFAULT_MICRO_BATCHES),
                        help="rows per micro-batch over all ranks, swept for every variant without @mb")
    parser.add_argument("--with-vllm", action="store_true", help=f"add {VLLM_VARIANT}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer-python", type=Path, default=REPO / ".venv-peer" / "bin" / "python")
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per run before it is killed")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "peer_trl.json")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, runs)")
    parser.add_argument("--stagerl-overrides", nargs="*", default=[],
                        help="extra key=value overrides for every stagerl variant (experiments)")
    args = parser.parse_args()
    variants = [v if "@mb" in v else f"{v}@mb{m}" for m in args.micro_batches
                for v in dict.fromkeys(args.variants + ([VLLM_VARIANT] if args.with_vllm else []))]
    variants = list(dict.fromkeys(variants))
    for name in variants:
        per_rank_micro(parse_variant(name))
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (warm s/step is the mean of steps 2..N)")
    if "trl" in variants and not args.peer_python.exists():
        raise SystemExit(f"{args.peer_python} not found: `make bench-peer` builds .venv-peer (torch + trl)")
    os.environ.update({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    work = Path(tempfile.mkdtemp(prefix="stagerl-bench-peer-"))
    from flows.prefect_server import local_server

    load_start = os.getloadavg()[0]
    results: list[dict] = []
    try:
        with local_server(work / "prefect") as server:
            inputs = build_inputs(work)  # while the server starts
            server.wait_healthy()
            prefect = {"PREFECT_API_URL": server.api_url, "PREFECT_HOME": str(work / "prefect"),
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
            ctx = {"work": work, "args": args, "inputs": inputs, "prefect": prefect, "server_pid": server.proc.pid}
            for run in range(args.runs):  # interleaved: each variant of the round once
                for name in round_variants(run, variants, results, args):
                    results.append(run_variant(name, run, ctx))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    out = {"bench": "peer_trl", "work": {**WORK, "prompt_tokens": inputs["prompt_tokens"], "steps": args.steps,
                                         "rows_per_step": WORK["prompts"] * WORK["n"], "model": "flows.demo.MODEL_OPTIONS",
                                         "loss": "stagerl token-mean; TRL loss_type=dapo (÷ active tokens of the step)"},
           "variants": variants, "runs": args.runs, "full_rounds": min(args.full_rounds, args.runs), "order": [f"{r['variant']}#{r['run']}" for r in results],
           "threads": {"requested": args.threads,
                       "trl": f"OMP_NUM_THREADS={args.threads} + torch.set_num_threads({args.threads})",
                       "stagerl": f"flow process OMP_NUM_THREADS={args.threads} (rollout; logprob/update when 1 "
                                  "rank); 2 ranks: the rank pool gives each rank OMP_NUM_THREADS=1"},
           "median": (median := aggregate(results, variants)), "best_vs_best": best_vs_best(median),
           "per_run": results,
           "machine": f"{os.cpu_count()} CPUs", "load_avg_1m": {"start": round(load_start, 2),
                                                                "end": round(os.getloadavg()[0], 2)},
           "date": time.strftime("%Y-%m-%d"), "scratch": str(work) if args.keep else None}
    text = json.dumps(out, indent=1) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(json.dumps({"median": {k: {f: v[f] for f in ("warm_step_s", "wall_s", "split_s", "ratio_vs_trl") if f in v}
                                 for k, v in out["median"].items()},
                      "best_vs_best": out["best_vs_best"], "load_avg_1m": out["load_avg_1m"]}, indent=1))
    return 0 if all("error" not in r and r["returncode"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
