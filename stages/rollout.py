"""rollout stage: sample n responses per prompt of the step's batch (verl: RayPPOTrainer.fit's generate_sequences, verl/trainer/ppo/ray_trainer.py).

Step k draws batch k-1 of the training set (stages.data.dataset.RLDataset with the config's `data`
section; data.seed, else trainer.seed, shuffles) and samples from the policy of step k-1
(ctx.actor_weights()) with the engine `actor_rollout_ref.rollout.name` (stages.engines: hf | vllm),
split over the plan's rollout replicas.

rollout.parquet: n rows per prompt, adjacent, sample_index 0..n-1; uid = "s{step}-p{i}-{hash}" for
the i-th prompt of the batch (deterministic per (step, prompt)); prompt = the templated prompt text
the model saw (special tokens kept) and prompt_ids; response = decoded without special tokens and
response_ids (EOS kept); response_length; finish_reason stop|length; data_source, ground_truth
(text; JSON for non-string truths), extra_info (JSON); rollout_log_probs when
rollout.calculate_log_probs. Seeds: every row's seed derives from (ctx.seed("rollout"),
rollout.seed, row), the hf engine's batch seeds from (that seed, replica, batch), so the same
seed gives bit-identical parquet bytes.

Manifest extra: the data position after this batch (what a resumed run continues from), the
engine, generation timings, tokens/s. `generate_validation(ctx)` samples the validation set with
val_kwargs for the flows' validation runs.

Baseline answers: when algorithm.adv_estimator declares it needs "baseline" (remax; the
estimator registry, stages.algos.advantages), the stage also generates one greedy answer (do_sample
false, n 1: verl's ReMax `gen_baseline_batch`) per prompt of the step's rows and stores them in
rollout/baseline.parquet (the rollout schema, one row per uid, sample_index 0). They are not
training rows: rollout.parquet keeps train_batch_size × n rows; the reward stage scores the
baseline answers into reward/baseline.parquet and the advantage stage subtracts them."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

from stages.data.baseline_answers import ANSWERS as BASELINE
from stages.data.baseline_answers import needs_baseline
from stages.engines import EngineOptions, Sampling, derive_seed, in_own_process, row_seeds
from storage.faults import maybe_fault
from storage.layout import TURNS_FILE

STAGE = "rollout"
INPUTS = ()
CONFIG_KEYS = ("data", "actor_rollout_ref.model.path", "actor_rollout_ref.model.custom_chat_template",
               "actor_rollout_ref.rollout", "trainer.seed", "trainer.device")
# with DAPO's dynamic sampling the kept rows also depend on the filter and on the reward
FILTER_KEYS = ("algorithm.filter_groups", "data.reward_fn_key", "custom_reward_function", "reward",
               "reward_model.reward_manager", "reward_model.overlong_buffer")
ROLLOUT = "actor_rollout_ref.rollout"


def stage_fingerprint(ctx) -> str:
    """ctx.fingerprint plus the fingerprint of the policy sampled: step k-1's update manifest
    (step 1 after a warm start: the warm start's), so when step k-1 is re-run with a different
    outcome (e.g. the reward file changed) step k re-runs from its rollout on."""
    from storage.artifacts import fingerprint as hash_obj, read_manifest

    filtering = bool(ctx.get("algorithm.filter_groups.enable"))
    base = ctx.fingerprint(STAGE, CONFIG_KEYS + (FILTER_KEYS if filtering else ()), INPUTS)
    if filtering and ctx.get("custom_reward_function.path"):
        from stages.reward import stage_fingerprint as reward_fingerprint

        base = hash_obj({"base": base, "reward": reward_fingerprint(ctx)})  # the reward file's content
    if needs_baseline(ctx):  # the stage also writes rollout/baseline.parquet
        base = hash_obj({"base": base, "baseline": "greedy, one per prompt"})
    if ctx.staleness():  # (only when on: a staleness-0 rollout keeps its fingerprint)
        base = hash_obj({"base": base, "staleness": ctx.staleness()})
    if multi_turn(ctx):  # the tools' config file's content, not only its path
        base = hash_obj({"base": base, "tool_config": _tool_config_digest(ctx)})
    policy_step = ctx.rollout_policy_step()  # step k-1, or k-1-staleness
    if policy_step == 0 and not ctx.get("warmstart.enable"):
        return base  # the initial model: its path is in CONFIG_KEYS
    step, stage = (policy_step, "update") if policy_step > 0 else (0, "warmstart")
    pending = ctx.session.pending_fingerprint(step, stage) if ctx.session is not None else None
    policy = pending or (read_manifest(ctx.store, ctx.layout, step, stage) or {}).get("fingerprint")
    return hash_obj({"base": base, "policy": policy})


def _engine_options(ctx, model_dir, version: str | None = None) -> EngineOptions:
    """`version`: the weights version model_dir holds (ctx.rollout_version() for the step's own
    weights; None for the initial model). With trainer.staleness the engine runs in its own
    process (the update trains beside it); rollout.cpu_affinity pins that process (in_own_process)."""
    plan_rollout = (ctx.plan or {}).get("rollout") or {}
    max_len = (ctx.plan or {}).get("max_seq_len") or (
        int(ctx.get("data.max_prompt_length")) + int(ctx.get("data.max_response_length")))
    device = "cuda" if str(ctx.get("trainer.device", "cpu")).startswith("cuda") else "cpu"
    cpus = tuple(int(c) for c in ctx.get(f"{ROLLOUT}.cpu_affinity") or ())
    return EngineOptions(model_dir=model_dir, rollout=dict(ctx.get(ROLLOUT) or {}), device=device,
                         num_replicas=int(plan_rollout.get("num_replicas") or 1),
                         prompts_per_replica=plan_rollout.get("prompts_per_replica"),
                         max_model_len=int(max_len),
                         engine_seed=derive_seed(ctx.get("trainer.seed", 0), ctx.get(f"{ROLLOUT}.seed", 0) or 0),
                         weights_version=version, own_process=in_own_process(ctx.staleness(), cpus), cpus=cpus)


def rollout_engines(ctx):
    """The run's resident engines (ctx.session), or engines started for this call only."""
    if ctx.session is not None:
        return ctx.session.engines()
    from stages.engines.service import RolloutEngines

    return RolloutEngines(resident=False)


def warm_up(ctx) -> None:
    """Start the run's resident engines now, from the initial model folder (same architecture;
    each step loads its own weights in place), before the first step as TRL's and verl's trainers
    load theirs: worker processes in the background (vLLM: seconds on a CPU, a minute or more on
    a GPU, overlapping the rank pool's start), an in-process hf engine here."""
    if ctx.session is None:
        return
    from stages.model.models import check_model_folder

    model_dir = check_model_folder(ctx.reference_weights(initial=True), "actor_rollout_ref.model.path")
    ctx.session.engines().warm_up(ctx.get(f"{ROLLOUT}.name", "hf"), _engine_options(ctx, model_dir))


def _base_seed(ctx, purpose: str = STAGE) -> int:
    return derive_seed(ctx.seed(purpose), ctx.get(f"{ROLLOUT}.seed", 0) or 0)


def _uid(step: int, position: int, prompt_row) -> str:
    digest = hashlib.sha256(f"{step}/{position}/{prompt_row.row}/{prompt_row.index}".encode()).hexdigest()[:8]
    return f"s{step}-p{position}-{digest}"


def _truth_text(truth) -> str:
    if truth is None:
        return ""
    return truth if isinstance(truth, str) else json.dumps(truth, sort_keys=True, default=str)


def multi_turn(ctx) -> bool:
    """actor_rollout_ref.rollout.multi_turn.enable: rows run verl's agent loops
    (stages.engines.agent_loop)."""
    return bool(ctx.get(f"{ROLLOUT}.multi_turn.enable"))


def _tool_config_digest(ctx) -> str | None:
    import os

    path = ctx.get(f"{ROLLOUT}.multi_turn.tool_config_path")
    if not path:
        return None
    with open(os.path.expanduser(str(path)), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def rollout_tools(ctx):
    """(ToolSet of multi_turn.tool_config_path, whether this call owns it): the run's resident one
    (ctx.session.tools) or one started for this call; (None, False) without a tool config."""
    mt = dict(ctx.get(f"{ROLLOUT}.multi_turn") or {})
    path = mt.get("tool_config_path")
    if not path:
        return None, False
    import os

    path = os.path.expanduser(str(path))
    workers, timeout = mt.get("tool_workers"), float(mt.get("tool_timeout_s") or 30.0)
    if ctx.session is not None:
        return ctx.session.tools(path, workers, timeout), False
    from stages.tools.toolset import ToolSet

    return ToolSet.from_config(path, num_workers=workers, timeout_s=timeout, instance_per="call"), True


def sample_prompts(ctx, prompts, sampling: Sampling, model_dir, tokenizer, purpose: str = STAGE,
                   position_offset: int = 0, turns_out: list | None = None):
    """Generate `sampling.n` responses for each PromptRow; returns (columns, engine timings).
    `tokenizer()` gives the model's tokenizer (called only when no resident worker decodes).
    position_offset numbers the prompts in uids (dynamic sampling's later generation batches).
    With multi_turn.enable each row runs its agent loop (stages.engines.agent_loop): the columns
    gain response_mask and num_turns, and `turns_out` (when given) one dict per turn and tool call
    (the rollout/turns.parquet rows)."""
    from stages.model.models import decode_batch

    n = sampling.n
    prompt_ids = [list(p.prompt_ids) for p in prompts for _ in range(n)]
    for row, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"row {row // n} of the batch (data row {prompts[row // n].row}): empty prompt")
    base = _base_seed(ctx, purpose)
    seeds = row_seeds(base, len(prompt_ids))
    training = purpose != "validation"
    options = _engine_options(ctx, model_dir, ctx.rollout_version() if training else ctx.policy_version())
    options.step_seed = base
    if purpose != STAGE:
        options.prompts_per_replica = None  # not a training batch: split evenly over the replicas
    engine = ctx.get(f"{ROLLOUT}.name", "hf")
    engines = rollout_engines(ctx)
    uids = [_uid(ctx.step, position_offset + i, p) for i, p in enumerate(prompts)]
    trajectories = None
    if ctx.session is not None:  # generation starts (here, or in the engine workers)
        ctx.session.compute_starts()
    if multi_turn(ctx):
        gens, trajectories = _agent_loops(ctx, prompts, prompt_ids, uids, base, sampling, options, engine,
                                          engines, tokenizer)
    else:
        gens = engines.generate(engine, prompt_ids, seeds, sampling, options)
    engines.sleep()  # GPU + rollout.free_cache_engine: the update gets the memory back

    # resident workers decode next to the engine (this process then needs no tokenizer)
    prompt_text = engines.decode([p.prompt_ids for p in prompts], skip_special_tokens=False)
    if prompt_text is None:
        prompt_text = decode_batch(tokenizer(), [p.prompt_ids for p in prompts], skip_special_tokens=False)
    if any(g.text is None for g in gens):
        responses = decode_batch(tokenizer(), [g.response_ids for g in gens], skip_special_tokens=True)
    else:
        responses = [g.text for g in gens]
    columns = {"uid": [], "sample_index": [], "prompt": [], "prompt_ids": [], "response": responses,
               "response_ids": [g.response_ids for g in gens],
               "response_length": [len(g.response_ids) for g in gens],
               "finish_reason": [g.finish_reason for g in gens],
               "data_source": [], "ground_truth": [], "extra_info": []}
    for i, p in enumerate(prompts):
        uid, truth, ids = uids[i], _truth_text(p.ground_truth), list(p.prompt_ids)
        extra_text = json.dumps(p.extra_info, sort_keys=True, default=str) if trajectories is None else None
        for k in range(n):
            columns["uid"].append(uid)
            columns["sample_index"].append(k)
            columns["prompt"].append(prompt_text[i])
            columns["prompt_ids"].append(ids)
            columns["data_source"].append(p.data_source)
            columns["ground_truth"].append(truth)
            if trajectories is not None:  # what verl's reward managers add for compute_score
                t = trajectories[i * n + k]
                extra_text = json.dumps({**p.extra_info, "num_turns": t.num_turns, "rollout_reward_scores": {},
                                         "turn_scores": [], "tool_rewards": list(t.tool_rewards)},
                                        sort_keys=True, default=str)
            columns["extra_info"].append(extra_text)
    if sampling.log_probs:
        columns["rollout_log_probs"] = [g.log_probs for g in gens]
    if trajectories is not None:
        columns["response_mask"] = [t.response_mask for t in trajectories]
        columns["num_turns"] = [t.num_turns for t in trajectories]
        if turns_out is not None:
            turns_out += turn_rows(ctx.step, columns, trajectories)
    if training:  # the update whose weights sampled these rows (trainer.staleness)
        columns["policy_version"] = [ctx.rollout_policy_step()] * len(gens)
    return columns, {"engine": engine, **options.timings}


def _agent_loops(ctx, prompts, prompt_ids, uids, base: int, sampling: Sampling, options, engine, engines,
                 tokenizer):
    """Every row through its agent loop (verl's agent_name: tool_agent or single_turn_agent; rows
    without one: rollout.agent.default_agent_loop). Returns (Generations of the whole responses,
    the Trajectories); options.timings gets the engine's timings and the loop's."""
    from stages.engines import Generation
    from stages.engines.agent_loop import AgentLoop, LoopSettings

    n = sampling.n
    outer = engines
    default_agent = ctx.get(f"{ROLLOUT}.agent.default_agent_loop") or "single_turn_agent"
    agents = [p.agent_name or default_agent for p in prompts for _ in range(n)]
    kwargs = [dict(p.extra_info.get("tools_kwargs") or {}) for p in prompts for _ in range(n)]
    keys = [f"{uid}#{k}" for uid in uids for k in range(n)]
    timings: dict = {"engine_start_s": 0.0, "load_weights_s": 0.0, "started": 0}
    engine_calls: list = []

    def generate(rows, row_sampling, call_seed, row_seeds):
        if engine_calls:  # a later turn: tool calls ran (the resume tests kill here)
            maybe_fault("rollout", "between_turns", ctx.step)
        engine_calls.append(len(rows))
        call = dataclasses.replace(options, rollout={**options.rollout, "hf_generate_batch_size": max(1, len(rows))},
                                   step_seed=call_seed, prompts_per_replica=None, timings={})
        gens = engines.generate(engine, rows, row_seeds, row_sampling, call)
        for key in ("engine_start_s", "load_weights_s"):
            timings[key] += float(call.timings.get(key) or 0.0)
        timings["started"] += int(call.timings.get("started") or 0)
        if call.timings.get("notes"):
            timings["notes"] = call.timings["notes"]
        return gens

    stream_timings: dict = {}

    def stream(add, row_sampling, first, max_steps):
        if not first and add:  # a later turn: tool calls ran (the resume tests kill here)
            maybe_fault("rollout", "between_turns", ctx.step)
        call = dataclasses.replace(options, prompts_per_replica=None, timings=stream_timings)
        return engines.stream(engine, add, row_sampling, call, first, max_steps)

    group_rows = max(1, int(ctx.get(f"{ROLLOUT}.hf_generate_batch_size") or 64)) * n
    template_kwargs = dict(ctx.get("data.apply_chat_template_kwargs") or {})
    if ctx.get("actor_rollout_ref.model.custom_chat_template"):
        template_kwargs["chat_template"] = ctx.get("actor_rollout_ref.model.custom_chat_template")
    tools, owned = rollout_tools(ctx)
    if not engines.resident:  # no run: keep the engine for the loop's calls, then stop it
        from stages.engines.service import RolloutEngines

        engines = RolloutEngines(resident=True)
    try:
        loop = AgentLoop(generate, tokenizer(), tools,
                         LoopSettings.from_rollout(dict(ctx.get(ROLLOUT) or {}), sampling.max_new_tokens),
                         sampling, template_kwargs=template_kwargs,
                         stream=stream if engines.streams(engine, options) else None)
        try:
            trajectories = loop.run(prompt_ids, agents, kwargs, keys, seed=base, group_rows=group_rows)
        finally:
            if loop.stats["streamed"]:  # free the engine's turn caches before the other stages run
                engines.end_stream(engine, options)
        for key in ("engine_start_s", "load_weights_s", "started", "notes"):
            if stream_timings.get(key):
                timings[key] = stream_timings[key]
        tool_metrics = tools.metrics(reset=True) if tools is not None else {}
    finally:
        if owned:
            tools.close()
        if engines is not outer:
            engines.close()
    stats = {k: round(v, 4) if isinstance(v, float) else v for k, v in loop.stats.items()}
    options.timings.update({**timings, "generate_s": stats["generate_s"], "wall_s": stats["wall_s"],
                            "agent_loop": stats, "tools": tool_metrics})
    gens = [Generation(t.response_ids, t.finish_reason, t.log_probs) for t in trajectories]
    return gens, trajectories


TURN_COLUMNS = ("step", "row", "uid", "sample_index", "turn", "role", "call", "tool", "arguments", "response",
                "token_start", "token_end", "mask", "latency_s", "error", "detail", "reward", "finish_reason",
                "token_ids")


def turn_rows(step: int, columns: dict, trajectories) -> list[dict]:
    """rollout/turns.parquet's rows: one per assistant turn and one per tool call, in order."""
    rows = []
    for row, traj in enumerate(trajectories):
        for rec in traj.turns:
            rows.append({"step": step, "row": row, "uid": columns["uid"][row],
                         "sample_index": columns["sample_index"][row], "turn": rec.turn, "role": rec.role,
                         "call": rec.call, "tool": rec.tool, "arguments": rec.arguments, "response": rec.text,
                         "token_start": rec.start, "token_end": rec.end, "mask": rec.mask,
                         "latency_s": rec.latency_s, "error": rec.error, "detail": rec.detail or None,
                         "reward": rec.reward, "finish_reason": rec.finish_reason, "token_ids": rec.token_ids})
    return rows


def generate_baseline(ctx, columns: dict, sampling: Sampling, model_dir, tokenizer):
    """verl's ReMax baseline (RayPPOTrainer.fit when adv_estimator is remax: the step's prompts
    again with do_sample=False): one greedy answer per prompt of `columns` (the step's rollout
    rows), keyed by the prompt's uid, in the rollout schema with sample_index 0. Returns (columns,
    engine timings)."""
    first: dict = {}
    for row, uid in enumerate(columns["uid"]):
        first.setdefault(uid, row)
    rows = list(first.values())
    prompt_ids = [list(columns["prompt_ids"][r]) for r in rows]
    greedy = dataclasses.replace(sampling, do_sample=False, n=1, log_probs=False)
    base = _base_seed(ctx, "baseline")  # greedy answers do not depend on it; the engines want seeds
    options = _engine_options(ctx, model_dir, ctx.rollout_version())
    options.step_seed, options.prompts_per_replica = base, None
    engine = ctx.get(f"{ROLLOUT}.name", "hf")
    engines = rollout_engines(ctx)
    gens = engines.generate(engine, prompt_ids, [derive_seed(base, i) for i in range(len(rows))], greedy, options)
    engines.sleep()
    if any(g.text is None for g in gens):
        from stages.model.models import decode_batch

        responses = decode_batch(tokenizer(), [g.response_ids for g in gens], skip_special_tokens=True)
    else:
        responses = [g.text for g in gens]
    out = {name: [columns[name][r] for r in rows]
           for name in ("uid", "prompt", "prompt_ids", "data_source", "ground_truth", "extra_info")}
    out.update({"sample_index": [0] * len(rows), "response": responses,
                "response_ids": [g.response_ids for g in gens],
                "response_length": [len(g.response_ids) for g in gens],
                "finish_reason": [g.finish_reason for g in gens]})
    return out, {"engine": engine, **options.timings}


def tokenizer_folder(ctx) -> Path:
    """The folder whose tokenizer files key the prompts and the tokenizer (the initial model's:
    stages.data.cache.run_tokenizer_folder); every step's model_dir holds a copy of it."""
    from stages.data.cache import run_tokenizer_folder

    return run_tokenizer_folder(ctx.cfg)


def _dataset(ctx, split: str):
    """The split's prompts, tokenised once per run: rows are cached by the data files' and the
    initial tokenizer's content (stages.data.cache.load_run_dataset), in memory and in the local
    cache dir."""
    from stages.data.cache import load_run_dataset

    return load_run_dataset(ctx.cfg, split, ctx.store)


def _model_and_tokenizer(ctx, training: bool = True):
    """The policy folder this step samples from (training: ctx.rollout_weights(), which lags by
    trainer.staleness; validation: the newest, ctx.actor_weights()) and a function returning its tokenizer, loaded
    on first call (once per run with a session: every step's folder carries the same tokenizer
    files). Resident engine workers decode themselves, so a run's rollouts never call it."""
    from stages.model.models import check_model_folder, load_tokenizer

    model_dir = ctx.rollout_weights() if training else ctx.actor_weights()
    try:
        check_model_folder(model_dir, "policy model")
    except FileNotFoundError as err:
        raise FileNotFoundError(f"actor_rollout_ref.model.path (or the step's weights): {err}") from None
    loaded: dict = {}

    def tokenizer():
        if "tokenizer" not in loaded:
            if ctx.session is None:
                loaded["tokenizer"] = load_tokenizer(model_dir)
            else:
                from stages.data.cache import tokenizer_fingerprint

                key = ("tokenizer", json.dumps(tokenizer_fingerprint(tokenizer_folder(ctx)), sort_keys=True,
                                               default=str))  # model_dir holds a copy of it
                loaded["tokenizer"] = ctx.session.memo(key, lambda: load_tokenizer(model_dir))
        return loaded["tokenizer"]
    return model_dir, tokenizer


def run(ctx) -> dict:
    from storage.artifacts import write_stage
    from storage.schemas import make_table

    t0 = time.perf_counter()
    model_dir, tokenizer = _model_and_tokenizer(ctx)
    t_weights = time.perf_counter()
    dataset = _dataset(ctx, "train")
    sampling = Sampling.from_rollout(dict(ctx.get(ROLLOUT) or {}), int(ctx.get(f"{ROLLOUT}.response_length")))
    if ctx.staleness():  # off-policy rows keep the behaviour policy's log-probs (rollout correction)
        sampling = dataclasses.replace(sampling, log_probs=True)
    t_data = time.perf_counter()
    files = {}
    if ctx.get("algorithm.filter_groups.enable"):  # DAPO: generate until enough groups vary
        from stages.algos.dynamic_sampling import CANDIDATES, collect_groups
        from stages.reward import rule_rewards

        columns, engine_timings, positions, files[CANDIDATES] = collect_groups(
            ctx, dataset, sampling, model_dir, tokenizer, sample_prompts, rule_rewards)
    else:
        batch = dataset.batch_for_step(ctx.step - 1)
        turns = [] if multi_turn(ctx) else None
        columns, engine_timings = sample_prompts(ctx, batch.rows, sampling, model_dir, tokenizer, turns_out=turns)
        if turns is not None:
            files[TURNS_FILE] = make_table("rollout_turns", {c: [t[c] for t in turns] for c in TURN_COLUMNS})
        positions = {"data_position": batch.next_position.to_dict(), "batch_position": batch.position.to_dict(),
                     "epoch": batch.epoch}
    t_gen = time.perf_counter()
    table = make_table("rollout", columns)
    tokens = sum(columns["response_length"])
    gen_s = engine_timings.get("generate_s") or (t_gen - t_data)
    timings = {"load_s": round(t_data - t0, 4), "weights_and_tokenizer_s": round(t_weights - t0, 4),
               "rollout_s": round(t_gen - t_data, 4), "generate_s": gen_s,
               "engine_call_s": engine_timings.get("wall_s"), "engine_start_s": engine_timings.get("engine_start_s"),
               "load_weights_s": engine_timings.get("load_weights_s"),
               "table_s": round(time.perf_counter() - t_gen, 4)}
    baseline = None
    if needs_baseline(ctx):
        t_base = time.perf_counter()
        baseline_columns, baseline_timings = generate_baseline(ctx, columns, sampling, model_dir, tokenizer)
        files[BASELINE] = make_table("rollout", baseline_columns)
        baseline = {"prompts": files[BASELINE].num_rows, "response_tokens": sum(baseline_columns["response_length"]),
                    "finish_stop": baseline_columns["finish_reason"].count("stop"),
                    "generate_s": baseline_timings.get("generate_s"),
                    "wall_s": round(time.perf_counter() - t_base, 4)}
        timings["baseline_s"] = baseline["wall_s"]
    extra = {
        **positions,
        "engine": engine_timings["engine"],
        "engine_timings": engine_timings,
        "prompts": len(set(columns["uid"])), "rows": table.num_rows, "response_tokens": tokens,
        "tokens_per_s": round(tokens / gen_s, 2) if gen_s else None,
        "tokens_per_s_wall": round(tokens / (t_gen - t_data), 2),
        "finish_stop": columns["finish_reason"].count("stop"),
        "model_dir": str(model_dir),
        "weights_version": ctx.rollout_version(),
        "policy_version": ctx.rollout_policy_step(), "staleness": ctx.step - 1 - ctx.rollout_policy_step(),
        "metrics": {"timing/generate_s": gen_s},  # the engine's generation alone (time_split)
    }
    if baseline is not None:  # rollout/baseline.parquet: greedy answers, not training rows
        extra["baseline"] = baseline
    if TURNS_FILE in files:
        extra["multi_turn"] = multi_turn_summary(columns, files[TURNS_FILE], engine_timings)
        extra["metrics"].update({f"multi_turn/{k}": v for k, v in extra["multi_turn"].items()
                                 if isinstance(v, (int, float))})
    fingerprint = stage_fingerprint(ctx)
    if ctx.session is not None and ctx.rollout_policy_step() > 0:
        t_wait = time.perf_counter()  # a committed rollout k implies a committed update of its policy
        ctx.session.wait_commit("update", ctx.rollout_policy_step())
        timings["wait_for_update_commit_s"] = round(time.perf_counter() - t_wait, 4)
    return write_stage(ctx.store, ctx.layout, ctx.step, STAGE, {"rollout.parquet": table, **files},
                       fingerprint=fingerprint, inputs={}, timings=timings, extra=extra)


def multi_turn_summary(columns: dict, turns, engine_timings: dict) -> dict:
    """The manifest's extra["multi_turn"]: turns per trajectory, tool calls and errors by kind, the
    correct-tool-use rate (agent_loop.correct_tool_use), the share of response tokens under the mask, and the loop's generation / tool-wait seconds."""
    from stages.engines.agent_loop import correct_tool_use
    from stages.tools.base import ERROR_KINDS

    t = turns.to_pydict()
    tool = [i for i, role in enumerate(t["role"]) if role == "tool"]
    rows = len(columns["uid"])
    tokens = sum(columns["response_length"])
    masked = sum(sum(m) for m in columns["response_mask"])
    errors = [t["error"][i] for i in tool if t["error"][i] is not None]
    loop = engine_timings.get("agent_loop") or {}
    out = {"trajectories": rows, "num_turns_mean": sum(columns["num_turns"]) / rows if rows else 0.0,
           "assistant_turns_mean": t["role"].count("assistant") / rows if rows else 0.0,
           "tool_calls": len(tool), "tool_calls_per_trajectory": len(tool) / rows if rows else 0.0,
           "correct_tool_use": correct_tool_use(t, columns["ground_truth"]),
           "tool_errors": len(errors), "tool_error_rate": len(errors) / len(tool) if tool else 0.0,
           **{f"tool_errors/{k}": errors.count(k) for k in ERROR_KINDS},
           "tool_turns_cut": loop.get("tool_turns_cut", 0),
           "response_tokens": tokens, "llm_tokens": masked, "tool_tokens": tokens - masked,
           "generate_s": loop.get("generate_s"), "tool_wait_s": loop.get("tool_wait_s"),
           "tool_s": loop.get("tool_s"), "engine_calls": loop.get("engine_calls"), "rounds": loop.get("rounds"),
           "streamed": bool(loop.get("streamed")), "engine_steps": loop.get("engine_steps"),
           "calls_by_tool": {}}
    for i in tool:
        name = t["tool"][i] or "?"
        out["calls_by_tool"][name] = out["calls_by_tool"].get(name, 0) + 1
    return out


def generate_validation(ctx) -> list[dict]:
    """Sample the validation set (data.val_files) with rollout.val_kwargs; one dict per row
    (the rollout columns), seeded by (trainer.seed, step, "validation")."""
    model_dir, tokenizer = _model_and_tokenizer(ctx, training=False)
    dataset = _dataset(ctx, "val")
    prompts = [dataset.rows[i] for i in dataset.epoch_order(0)]
    sampling = Sampling.from_rollout(dict(ctx.get(ROLLOUT) or {}), int(ctx.get(f"{ROLLOUT}.response_length")),
                                     validation=True)
    columns, _ = sample_prompts(ctx, prompts, sampling, model_dir, tokenizer, purpose="validation")
    names = list(columns)
    return [dict(zip(names, values)) for values in zip(*(columns[c] for c in names))]
