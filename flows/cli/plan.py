"""`stagerl plan` (the batch-size derivation, level by level) and `stagerl config` (show the
resolved config, list every key)."""
from __future__ import annotations

import json
import sys

import yaml

from flows.cli.args import add_config_args, add_json


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="print the batch plan (prompts -> rows -> per-rank mini/micro-batches)")
    add_config_args(p)
    add_json(p, "the plan")
    p.set_defaults(func=run_plan)
    c = subparsers.add_parser("config", help="show the resolved config, or list every key")
    c.add_argument("what", choices=["show", "keys"], help="show: resolved YAML; keys: every key with its doc")
    add_config_args(c)
    c.set_defaults(func=run_config)


def run_config(args) -> int:
    from configs.loader import load_config
    from configs.schema import ConfigError, config_reference

    if args.what == "keys":
        print(config_reference())
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"stagerl config: {err}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(dict(cfg), sort_keys=False), end="")
    for w in cfg.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return 0


def run_plan(args) -> int:
    from configs.loader import load_config
    from configs.memory import check_fits, estimate_memory
    from configs.schema import ConfigError
    from configs.suggest import make_plan

    try:
        cfg = load_config(args.config, args.overrides)
        plan = make_plan(cfg)
        memory = estimate_memory(cfg, plan)
        check_fits(cfg, memory)
    except ConfigError as err:
        print(f"stagerl plan: config refused: {err}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(err), "suggestions": getattr(err, "suggestions", {})}))
        return 2
    resume = resume_cost(cfg)
    engine = update_engine(cfg, plan)
    if args.json:
        print(json.dumps({**plan, "memory": memory, "resume": resume, "update_engine": engine}, indent=2))
    else:
        print(render_plan(plan, cfg))
        print(render_memory(memory, cfg))
        print(f"update engine: {engine['engine']}: {engine['why']}; ranks: {engine['ranks']}")
        if plan.get("async"):  # trainer.staleness >= 1: what the pipelined schedule samples and corrects
            a = plan["async"]
            print(f"staleness {a['staleness']}: {a['rollout_samples']}, beside the previous step's training; "
                  f"old log-probs {a['old_log_probs']}; rollout log-probs {a['rollout_log_probs']}; "
                  f"correction: {a['correction']}")
        print(render_resume(resume))
        from configs.plan import check_trainable

        try:
            check_trainable(cfg)
        except ConfigError as err:
            print(f"note: `stagerl train` refuses this config: {err}")
    return 0


def resume_cost(cfg) -> dict:
    """configs.plan.resume_replay, with its cost in update-seconds when the experiment already has
    updates in the store (the newest one's timing/rank_train_s: a replayed update trains the same)."""
    from configs.plan import resume_replay

    out = resume_replay(cfg)
    try:
        from storage.artifacts import last_committed, read_manifest
        from storage.layout import RunLayout
        from storage.store import Store

        store, layout = Store.from_config(cfg.get("storage", {})), RunLayout.from_config(cfg)
        step = last_committed(store, layout, "update")
        train_s = ((read_manifest(store, layout, step, "update") or {}).get("timings") or {}).get(
            "timing/rank_train_s") if step else None
        if train_s is not None:
            out.update(update_s=round(float(train_s), 3), from_step=step,
                       replay_s_at_most=round(float(train_s) * out["replays_at_most"], 1))
    except Exception:  # noqa: BLE001 - no run yet, or an unreachable store: the count alone
        pass
    return out


def update_engine(cfg, plan: dict) -> dict:
    """The DeepSpeed configuration the update runs with (stages.training.engine.deepspeed_config)
    and why, for this world size."""
    ds = cfg["actor_rollout_ref"]["actor"]["deepspeed"]
    stage, dtype, world = ds["zero_stage"], ds["dtype"], plan["n_gpus"]
    shards = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and weights"}
    name = (f"DeepSpeed ZeRO-{stage}, {dtype}" + (" (fp32 master weights)" if dtype == "bf16" else "")
            + f", torch AdamW, {world} rank{'s' if world > 1 else ''}")
    if world == 1:
        why = ("at one rank ZeRO shards nothing; its bookkeeping is kept (the same engine and train state "
               "at any world size) as it costs nothing measurable: bench/update_profile.py, ZeRO-0 and "
               "ZeRO-2 within noise and within 1.1x a plain PyTorch loop of the same math")
    else:
        why = f"ZeRO-{stage} shards the {shards[stage]} over the {world} ranks (actor_rollout_ref.actor.deepspeed.zero_stage)"
    return {"engine": name, "zero_stage": stage, "dtype": dtype, "world": world, "why": why,
            "ranks": rank_placement(cfg, plan)}


def rank_placement(cfg, plan: dict) -> str:
    """Where the update's ranks run (flows.train.start_rank_pool, stages.ranks.launch.run_ranks)."""
    from stages.ranks.zygote import forks_one_rank, forks_ranks, wanted

    world, trainer = plan["n_gpus"], cfg["trainer"]
    if cfg["orchestration"]["mode"] != "local":
        return f"{world} rank{'s' if world > 1 else ''} in each update run of orchestration.update_deployment"
    if world == 1:
        if forks_one_rank(cfg, plan):
            return ("one rank forked from the run's fork server beside the rollout engine's worker, on the "
                    "flow's cores but a pinned engine's (the flow's process imports neither transformers nor DeepSpeed)")
        return "one rank in the flow's process"
    if trainer.get("launcher") == "deepspeed":
        return (f"a pool of {world} ranks started once by DeepSpeed's launcher over {trainer['hostfile']}"
                if trainer.get("hostfile") else f"{world} ranks started by DeepSpeed's launcher for each stage call")
    if forks_ranks(cfg, world) and wanted(cfg, plan):
        return f"a pool of {world} ranks forked once from the run's fork server"
    return f"a pool of {world} ranks started once under torchrun"


def render_resume(resume: dict) -> str:
    every = (f"every {resume['train_state_every']} steps and at the last step" if resume["train_state_every"]
             else "at the last step only (trainer.save_freq=-1)")
    cost = (f" ≈ {resume['replay_s_at_most']} s of update compute (step {resume['from_step']}'s update "
            f"trained in {resume['update_s']} s)" if "replay_s_at_most" in resume
            else " (each costs one update's compute: timing/rank_train_s)")
    return (f"resume: the train state is stored {every}; a resume restores the newest stored one and "
            f"replays at most {resume['replays_at_most']} updates from their stored rows{cost}")


def render_memory(memory: dict | None, cfg) -> str:
    """Peak memory per stage and rank (configs/memory.py), each total beside its parts."""
    model = cfg["actor_rollout_ref"]["model"]["path"]
    if memory is None:
        return f"Memory: no estimate ({model}/config.json not found: the plan needs the model's shape)"
    device = memory["device_memory_gib"]
    out = [f"Memory per rank, estimated (model {memory['model_params']:,} params; "
           + (f"device {device:.1f} GiB)" if device else "no device size: set trainer.device_memory_gib to check fit)")]
    for stage, est in memory.items():
        if not isinstance(est, dict):
            continue
        parts = " + ".join(f"{k} {v:.2f}" for k, v in est["parts_gib"].items())
        notes = []
        if "tokens_per_micro_batch" in est:
            notes.append(f"{est['tokens_per_micro_batch']} tokens per micro-batch")
        if est.get("lora"):
            notes.append(f"LoRA: {est['trainable_params']:,} trainable")
        if "gradient_checkpointing" in est:
            notes.append(f"checkpointing {'on' if est['gradient_checkpointing'] else 'off'}, ZeRO-{est['zero_stage']}")
        if est.get("export_gib", 0) > est.get("train_gib", 0):
            notes.append(f"peak in the export: {est['export_gib']:.2f} GiB, training {est['train_gib']:.2f}")
        if "engine" in est:
            notes.append(f"{est['engine']} engine")
        if "roles" in est:
            notes.append(f"the stage: {' and '.join(est['roles'])} in one process per rank")
        out.append(f"  {stage.replace('_', ' '):<18}{est['total_gib']:>8.2f} GiB = {parts}  ({', '.join(notes)})")
    return "\n".join(out)


def _line(label: str, value, formula: str = "") -> str:
    return f"  {label:<34}{str(value):>7}   {formula}"


def render_plan(plan: dict, cfg) -> str:
    """The derivation, level by level, each number beside its formula."""
    a, r = plan["actor"], plan["rollout"]
    n, tbs, world = plan["rollout_n"], plan["prompts_per_step"], plan["n_gpus"]
    src = ("config: base, verl's defaults" if cfg.source == "base" else f"config: {cfg.source} on base (verl's defaults)")
    src = (src
           + (f" + {len(cfg.overrides)} override(s)" if cfg.overrides else ""))
    out = [f"Batch plan ({src})",
           _line("world (ranks)", world, f"= trainer.nnodes {plan['nnodes']} × n_gpus_per_node {plan['n_gpus_per_node']}"),
           "L1 prompts",
           _line("prompts per step", tbs, "= data.train_batch_size"),
           "L2 rows (prompt + response)",
           _line("rows per step", plan["rows_per_step"], f"= {tbs} prompts × rollout.n {n}"),
           _line("data-parallel size", a["dp_size"], f"= world {world} ÷ ulysses sp {a['sp_size']}"),
           _line("rows per rank", a["samples_per_dp_rank"], f"= {plan['rows_per_step']} ÷ dp {a['dp_size']}"),
           "L3 actor mini-batch (one optimizer step)"]
    out += _train_lines(a, n, "actor.ppo_mini_batch_size")
    out.append("L4 actor micro-batches (one forward/backward)")
    out += _micro_lines(a)
    out += ["Rollout",
            _line("replicas", r["num_replicas"],
                  f"= world {world} ÷ (TP {r['tensor_model_parallel_size']} × rollout dp {r['data_parallel_size']})"),
            _line("prompts per replica", r["prompts_per_replica"], f"= ceil({tbs} ÷ {r['num_replicas']})"),
            _line("rows per replica", r["rows_per_replica"], f"= {r['prompts_per_replica']} × n {n}")]
    from configs.plan import adv_estimator_needs

    if "baseline" in adv_estimator_needs(cfg):  # remax: verl's greedy baseline generation
        out.append(_line("greedy baseline answers", tbs, f"= {tbs} prompts × 1 (algorithm.adv_estimator="
                         f"{cfg['algorithm']['adv_estimator']} needs a baseline; rollout/baseline.parquet, not training rows)"))
    if r.get("old_log_prob_pass", True):
        out += _log_prob_lines("old log-prob (rollout.log_prob_*)"
                               + (" + Σπ² per token" if r.get("sum_pi_squared") else ""), r, a["samples_per_dp_rank"])
    else:
        out.append("Old log-prob: no separate pass (one mini-batch, one epoch, no KL in reward: the "
                   "update's own forward gives them, as in verl)")
    if plan["ref"]:
        out += _log_prob_lines("reference log-prob (ref.log_prob_*)", plan["ref"], a["samples_per_dp_rank"])
    else:
        out.append("Reference: not needed (no KL loss, no KL in reward)")
    c = plan["critic"]
    if c:
        start = cfg["critic"]["model"]["path"]
        same = start == cfg["actor_rollout_ref"]["model"]["path"]
        out.append(f"Critic (value model): starts from {start}"
                   + (" (critic.model.path; default: the actor's model)" if same else " (critic.model.path)"))
        out += _train_lines(c, n, "critic.ppo_mini_batch_size") + _micro_lines(c)
        if c["value_forward_passes_per_rank"]:
            out.append(_line("value forward passes per rank", c["value_forward_passes_per_rank"],
                             f"= ceil({c['samples_per_dp_rank']} ÷ forward micro {c['forward_micro_batch_size_per_gpu']})"))
    else:
        out.append("Critic: not used (the estimator declares no need for critic values and critic.enable is not set)")
    groups = cfg["algorithm"]["filter_groups"]
    if groups["enable"]:  # DAPO: the rollout generates until enough groups vary
        gen, limit = cfg["data"]["gen_batch_size"] or plan["prompts_per_step"], groups["max_num_gen_batches"]
        out.append(f"Dynamic sampling (algorithm.filter_groups): batches of data.gen_batch_size {gen} prompts × n {n} until "
                   f"{plan['prompts_per_step']} groups with a varied {groups['metric']} are kept; "
                   + (f"at most {limit} batches = {limit * gen} prompts" if limit > 0 else "no batch limit"))
    if plan["reward_model"]:
        rm = plan["reward_model"]
        out.append(_line("reward-model micro per rank", rm["micro_batch_size_per_gpu"], ""))
    for w in plan["warnings"]:
        out.append(f"warning: {w}")
    return "\n".join(out)


def _train_lines(role: dict, n: int, key: str) -> list[str]:
    mini, dp = role["ppo_mini_batch_size_per_gpu"], role["dp_size"]
    lines = [_line("mini-batch per rank (rows)", mini, f"= {key} × n {n} ÷ dp {dp} (floor)"),
             _line("mini-batches per step", role["num_mini_batches"],
                   f"= ceil({role['samples_per_dp_rank']} rows per rank ÷ {mini})"),
             _line("optimizer steps per step", role["optimizer_steps_per_step"],
                   f"= {role['num_mini_batches']} × ppo_epochs {role['ppo_epochs']}")]
    if role["on_policy"]:
        lines.append("  (one mini-batch, one epoch: verl's on-policy shortcut, ratio = 1 in the loss)")
    return lines


def _micro_lines(role: dict) -> list[str]:
    if role["use_dynamic_bsz"]:
        return [_line("token budget per micro-batch", role["max_token_len_per_micro_batch"],
                      "= ppo_max_token_len_per_gpu × sp (micro-batch count varies with lengths)")]
    micro = role["ppo_micro_batch_size_per_gpu"]
    return [_line("micro-batch per rank (rows)", micro, "= ppo_micro_batch_size_per_gpu"),
            _line("micro-batches (grad accumulation)", role["grad_accum_steps"],
                  f"= {role['ppo_mini_batch_size_per_gpu']} ÷ {micro} per optimizer step")]


def _log_prob_lines(title: str, lp: dict, rows_per_rank: int) -> list[str]:
    if lp["log_prob_use_dynamic_bsz"]:
        return [title, _line("token budget per forward", lp["log_prob_max_token_len_per_gpu"],
                             "= log_prob_max_token_len_per_gpu × sp")]
    micro = lp["log_prob_micro_batch_size_per_gpu"]
    return [title,
            _line("micro-batch per rank (rows)", micro, "= log_prob_micro_batch_size_per_gpu (never rescaled)"),
            _line("forward passes per rank", lp["log_prob_micro_batches_per_rank"], f"= ceil({rows_per_rank} ÷ {micro})")]
