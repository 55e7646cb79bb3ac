"""The batch plan: one pure function from a resolved config to every size a stage uses.

verl's semantics exactly (docs/verl-semantics.md §2-§3, verl's legacy FSDP workers): sizes in
the config are prompts; `ppo_mini_batch_size × rollout.n ÷ dp` (floor) is the per-rank mini-batch
in rows; `*_per_gpu` values are never rescaled; deprecated global micro sizes are floor-divided by
dp. Stricter than verl: everything verl only finds at run time (or silently gets wrong) is refused
here, with the keys, the numbers, the reason, and values that work (configs/suggest.py)."""
from __future__ import annotations

import os
import re
from math import ceil
from pathlib import Path
from typing import Any

from configs.loader import get_path
from configs.schema import ConfigError
from stages.algos.advantages import ADV_ESTIMATORS

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
REF = "actor_rollout_ref.ref"
GPUS, NODES = "trainer.n_gpus_per_node", "trainer.nnodes"
TBS, N = "data.train_batch_size", "actor_rollout_ref.rollout.n"
LAUNCHER, HOSTFILE = "trainer.launcher", "trainer.hostfile"
_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # deepspeed.launcher.runner._parse_hostfile's pattern


class PlanError(ConfigError):
    """A refused config. `keys` are the keys whose values could fix it (for suggestions)."""

    def __init__(self, message: str, keys: tuple = ()):
        super().__init__(message)
        self.reason = message
        self.keys = tuple(keys)
        self.suggestions: dict[str, list] = {}

    def __str__(self) -> str:
        if not self.suggestions:
            return self.reason
        tries = "; ".join(f"{k}=" + " or ".join(_fmt(v) for v in vs) for k, vs in self.suggestions.items())
        return f"{self.reason}\n  values that work (changing one key): {tries}"


def _fmt(value: Any) -> str:
    return "null" if value is None else str(value)


def uses_critic(cfg: dict) -> bool:
    """verl (need_critic in verl/trainer/ppo/utils.py): critic.enable when set, else whether the
    estimator needs critic values (it declares so in stages.algos.advantages' registry: gae)."""
    enable = get_path(cfg, "critic.enable")
    return bool(enable) if enable is not None else "values" in adv_estimator_needs(cfg)


def adv_estimator_needs(cfg: dict) -> frozenset:
    """The needs algorithm.adv_estimator declared at registration (an unknown name: ConfigError
    listing the registered ones)."""
    return _adv_estimator(cfg).needs


def _adv_estimator(cfg: dict):
    name = get_path(cfg, "algorithm.adv_estimator")
    if name not in ADV_ESTIMATORS:
        raise ConfigError(f"algorithm.adv_estimator={name!r} is not a registered estimator; registered: "
                          f"{', '.join(sorted(ADV_ESTIMATORS))}")
    return ADV_ESTIMATORS[name]


def uses_ref(cfg: dict) -> bool:
    """verl: a reference policy iff KL in reward or KL loss."""
    return bool(get_path(cfg, "algorithm.use_kl_in_reward") or get_path(cfg, f"{ACTOR}.use_kl_loss"))


def needs_old_log_prob_pass(cfg: dict, actor: dict) -> bool:
    """A separate old-log-prob forward (the logprob stage's actor pass) is needed unless it is
    provably the update's own first forward: one mini-batch and one epoch (verl's on-policy
    shortcut: the update uses its forward, detached, as old log-probs), no KL in reward (the
    advantage stage reads old log-probs), no estimator that declares it needs them, no Σπ² to
    compute (the actor's pass computes it) and no critic warm-up (the actor then skips steps).
    The update then stores those values itself (update/log_probs.parquet), so inspect still has
    them."""
    return not (actor["on_policy"] and not get_path(cfg, "algorithm.use_kl_in_reward")
                and "old_log_probs" not in adv_estimator_needs(cfg) and not computes_sum_pi_squared(cfg)
                and not (get_path(cfg, "trainer.critic_warmup") or 0))


def computes_sum_pi_squared(cfg: dict) -> bool:
    """The logprob stage's actor pass also stores Σπ² per token: the estimator needs it
    (optimal_token_baseline) or actor.calculate_sum_pi_squared asks for it."""
    return "sum_pi_squared" in adv_estimator_needs(cfg) or bool(get_path(cfg, f"{ACTOR}.calculate_sum_pi_squared"))


def _one_micro(cfg, role: str, deprecated: str, per_gpu: str) -> None:
    """verl: without dynamic batch size exactly one of the global / per-GPU micro sizes is set."""
    old, new = get_path(cfg, deprecated), get_path(cfg, per_gpu)
    if old is None and new is None:
        raise PlanError(f"[{role}] Please set at least one of '{deprecated}' or '{per_gpu}' if "
                        f"use_dynamic_bsz is not enabled.", (per_gpu,))
    if old is not None and new is not None:
        raise PlanError(f"[{role}] You have set both '{deprecated}' AND '{per_gpu}'. Please remove "
                        f"'{deprecated}' because only '*_per_gpu' is supported (the former is deprecated).",
                        (deprecated,))


def _normalise_deprecated(value, dp: int, key: str, divisor_name: str):
    """verl: a deprecated global size is floor-divided by dp; a result of 0 is refused here."""
    if value is None:
        return None
    per_gpu = value // dp
    if per_gpu <= 0:
        raise PlanError(f"{key}={value} normalises to {value} // {divisor_name} {dp} = 0 rows per rank "
                        f"(verl would fail later splitting the batch into chunks of 0)", (key, GPUS))
    return per_gpu


def _check_budget(key: str, budget_per_gpu: int, sp: int, seq_len: int) -> int:
    budget = budget_per_gpu * sp
    if budget < seq_len:
        raise PlanError(f"{key}={budget_per_gpu} (× sp {sp} = {budget} tokens) is below max_prompt_length + "
                        f"max_response_length = {seq_len}: a full-length row would not fit in a micro-batch "
                        f"(verl: 'max_token_len must be greater than the sequence length')", (key,))
    return budget


def _check_sp(cfg, what: str, sp_key: str, padding_key: str, world: int) -> int:
    sp = get_path(cfg, sp_key)
    if sp <= 0 or world % sp:
        raise PlanError(f"{sp_key} ({sp}) must divide the world size ({world}): a sequence-parallel group "
                        f"needs whole ranks", (sp_key, GPUS))
    if sp > 1 and not get_path(cfg, padding_key):
        raise PlanError(f"When using sequence parallelism for {what}, you must enable `use_remove_padding` "
                        f"({padding_key}=true)", (padding_key,))
    return sp


def _train_role(cfg, role: str, prefix: str, world: int, seq_len: int) -> dict:
    """Actor or critic: the normalisation of fsdp_workers.py (verl/workers/fsdp_workers.py), then stricter checks."""
    tbs, n = get_path(cfg, TBS), get_path(cfg, N)
    model = "actor_rollout_ref.model" if role == "actor" else "critic.model"
    sp = _check_sp(cfg, "critic" if role == "critic" else "actor/ref policy",
                   f"{prefix}.ulysses_sequence_parallel_size", f"{model}.use_remove_padding", world)
    dp = world // sp
    dynamic = get_path(cfg, f"{prefix}.use_dynamic_bsz")
    mini_key, epochs_key = f"{prefix}.ppo_mini_batch_size", f"{prefix}.ppo_epochs"
    micro_old_key, micro_key = f"{prefix}.ppo_micro_batch_size", f"{prefix}.ppo_micro_batch_size_per_gpu"
    mini = get_path(cfg, mini_key)
    rows = tbs * n
    if not dynamic:
        _one_micro(cfg, role, micro_old_key, micro_key)
        if tbs < mini:
            raise PlanError(f"train_batch_size ({tbs}) must be >= {role}.ppo_mini_batch_size ({mini})", (mini_key, TBS))
        old = get_path(cfg, micro_old_key)
        if old is not None:
            if mini % old != 0:
                raise PlanError(f"ppo_mini_batch_size ({mini}) must be divisible by ppo_micro_batch_size ({old})",
                                (micro_old_key,))
            if old * sp < world:
                raise PlanError(f"ppo_micro_batch_size ({old}) * ulysses_sequence_parallel_size ({sp}) must be "
                                f">= n_gpus ({world})", (micro_old_key,))
    if mini <= 0 or tbs % mini != 0:
        raise PlanError(f"{TBS} ({tbs}) is not a multiple of {mini_key} ({mini}): the last mini-batch would "
                        f"be short and under-weighted (verl does not check this)", (mini_key, TBS))
    if (mini * n) % dp != 0:
        raise PlanError(f"{mini_key} × rollout.n = {mini} × {n} = {mini * n} rows is not divisible by the "
                        f"data-parallel size {dp}: verl floor-divides to {mini * n // dp} rows per rank and the "
                        f"rows no longer form whole mini-batches", (mini_key, GPUS, N))
    mini_per_gpu = mini * n // dp  # > 0: mini * n is a positive multiple of dp
    micro = _normalise_deprecated(get_path(cfg, micro_old_key), dp, micro_old_key, "dp")
    if micro is None:
        micro = get_path(cfg, micro_key)
    rows_per_rank = rows // dp
    if micro is not None:
        if mini_per_gpu % micro != 0:
            raise PlanError(f"normalized ppo_mini_batch_size {mini_per_gpu} should be divisible by "
                            f"ppo_micro_batch_size_per_gpu {micro} ({mini_key} {mini} × rollout.n {n} ÷ dp {dp} "
                            f"= {mini_per_gpu} rows per rank, {micro_key} = {micro})", (micro_key, GPUS, mini_key))
    epochs = get_path(cfg, epochs_key)
    if epochs < 1:
        raise PlanError(f"{epochs_key}={epochs}: at least one pass over the rows is needed", (epochs_key,))
    budget = None
    if dynamic:
        budget = _check_budget(f"{prefix}.ppo_max_token_len_per_gpu",
                               get_path(cfg, f"{prefix}.ppo_max_token_len_per_gpu"), sp, seq_len)
    num_mini = ceil(rows_per_rank / mini_per_gpu)
    return {
        "dp_size": dp, "sp_size": sp,
        "samples_per_dp_rank": rows_per_rank,
        "ppo_mini_batch_size_per_gpu": mini_per_gpu,
        "ppo_micro_batch_size_per_gpu": micro,
        "grad_accum_steps": None if dynamic else mini_per_gpu // micro,
        "num_mini_batches": num_mini,
        "ppo_epochs": epochs,
        "optimizer_steps_per_step": num_mini * epochs,
        "on_policy": num_mini == 1 and epochs == 1,
        "use_dynamic_bsz": bool(dynamic),
        "max_token_len_per_micro_batch": budget,
    }


def _log_prob_role(cfg, role: str, prefix: str, dp: int, sp: int, rows_per_rank: int,
                   seq_len: int, check_micro: bool) -> dict:
    """Old/ref log-prob (or critic values) forward passes per rank (verl/workers/fsdp_workers.py)."""
    old_key, key = f"{prefix}.log_prob_micro_batch_size", f"{prefix}.log_prob_micro_batch_size_per_gpu"
    dynamic = get_path(cfg, f"{prefix}.log_prob_use_dynamic_bsz")
    if check_micro:  # verl gates this on the *actor's* use_dynamic_bsz
        _one_micro(cfg, role, old_key, key)
    micro = _normalise_deprecated(get_path(cfg, old_key), dp, old_key, "dp")
    if micro is None:
        micro = get_path(cfg, key)
    budget = None
    if dynamic:
        budget = _check_budget(f"{prefix}.log_prob_max_token_len_per_gpu",
                               get_path(cfg, f"{prefix}.log_prob_max_token_len_per_gpu"), sp, seq_len)
    elif micro is None:
        raise PlanError(f"[{role}] set '{key}' (rows per forward per rank) or enable {prefix}.log_prob_use_dynamic_bsz",
                        (key,))
    return {
        "log_prob_micro_batch_size_per_gpu": micro,
        "log_prob_micro_batches_per_rank": None if dynamic else ceil(rows_per_rank / micro),
        "log_prob_use_dynamic_bsz": bool(dynamic),
        "log_prob_max_token_len_per_gpu": budget,
    }


def _rollout(cfg, world: int, seq_len: int, warnings: list) -> dict:
    tp_key = f"{ROLLOUT}.tensor_model_parallel_size"
    tp, rdp = get_path(cfg, tp_key), get_path(cfg, f"{ROLLOUT}.data_parallel_size")
    infer_world = tp * rdp * get_path(cfg, f"{ROLLOUT}.pipeline_model_parallel_size")
    if infer_world <= 0 or world % infer_world != 0:
        raise PlanError(f"rollout world_size: {world} is not divisible by infer_world_size: {infer_world} "
                        f"({tp_key} {tp} × data_parallel_size {rdp}): every engine needs whole ranks",
                        (tp_key, GPUS))
    per_node = min(get_path(cfg, GPUS), infer_world)
    if infer_world % per_node:  # verl: RolloutReplica (verl/workers/rollout/replica.py)
        raise PlanError(f"rollout replica world_size {infer_world} ({tp_key} {tp} × data_parallel_size {rdp}) must "
                        f"be divisible by gpus_per_node {per_node}: a replica larger than a node spans whole nodes",
                        (tp_key, GPUS))
    replicas = world // infer_world
    tbs, n = get_path(cfg, TBS), get_path(cfg, N)
    per_replica = ceil(tbs / replicas)
    if tbs % replicas:
        warnings.append(f"{tbs} prompts do not split evenly over {replicas} rollout replicas: "
                        f"{tbs // replicas}-{per_replica} prompts each")
    if get_path(cfg, f"{ROLLOUT}.name") == "vllm":
        max_model_len = get_path(cfg, f"{ROLLOUT}.max_model_len") or seq_len
        if max_model_len < seq_len:
            raise PlanError(f"{ROLLOUT}.max_model_len={max_model_len} is below max_prompt_length + "
                            f"max_response_length = {seq_len}", (f"{ROLLOUT}.max_model_len",))
        batched = get_path(cfg, f"{ROLLOUT}.max_num_batched_tokens")
        if not get_path(cfg, f"{ROLLOUT}.enable_chunked_prefill") and batched < max_model_len:
            raise PlanError(f"{ROLLOUT}.max_num_batched_tokens={batched} is below the model length {max_model_len} "
                            f"(max_prompt_length + max_response_length) with enable_chunked_prefill=false: vLLM "
                            f"could not schedule a full-length prompt", (f"{ROLLOUT}.max_num_batched_tokens",))
    elif tp > 1:
        warnings.append(f"the hf engine does not shard a model: each of the {replicas} replicas generates on "
                        f"one process ({tp_key}={tp} only sets how many ranks a replica spans)")
    workers = get_path(cfg, f"{ROLLOUT}.agent.num_workers")
    if workers and (tbs * n) % workers:
        warnings.append(f"{tbs * n} rows are not divisible by {ROLLOUT}.agent.num_workers={workers}: verl would "
                        f"fail at generation ('only support equal chunk'); stagerl does not chunk by agent workers")
    return {"tensor_model_parallel_size": tp, "data_parallel_size": rdp, "num_replicas": replicas,
            "prompts_per_replica": per_replica, "rows_per_replica": per_replica * n}


def compute_plan(cfg: dict) -> dict:
    """Resolved config -> batch plan (raises PlanError, without suggestions; see make_plan)."""
    world = get_path(cfg, GPUS) * get_path(cfg, NODES)
    if world <= 0:
        raise PlanError(f"world size {world} = {NODES} × {GPUS} must be at least 1", (GPUS,))
    check_launcher(cfg)
    tbs, n = get_path(cfg, TBS), get_path(cfg, N)
    if tbs <= 0 or n <= 0:
        raise PlanError(f"{TBS} ({tbs}) and {N} ({n}) must be positive", (TBS, N))
    seq_len = get_path(cfg, "data.max_prompt_length") + get_path(cfg, "data.max_response_length")
    rows = tbs * n
    min_group = _adv_estimator(cfg).min_group  # declared at registration (grpo_passk: 2)
    if n < min_group:
        raise PlanError(f"algorithm.adv_estimator={get_path(cfg, 'algorithm.adv_estimator')} needs at least "
                        f"{min_group} answers per prompt ({N} is {n}); verl fails at the first step",
                        (N, "algorithm.adv_estimator"))
    warnings: list[str] = []
    sp = _check_sp(cfg, "actor/ref policy", f"{ACTOR}.ulysses_sequence_parallel_size",
                   "actor_rollout_ref.model.use_remove_padding", world)
    actor_dynamic = get_path(cfg, f"{ACTOR}.use_dynamic_bsz")
    if not actor_dynamic and rows % world:
        raise PlanError(f"real_train_batch_size ({rows} = {TBS} {tbs} × {N} {n}) must be divisible by minimal "
                        f"possible batch size ({world} = {NODES} × {GPUS}): every rank needs the same number of rows",
                        (GPUS, TBS, N))
    dp = world // sp
    if rows % dp:
        raise PlanError(f"{rows} rows ({TBS} {tbs} × {N} {n}) are not divisible by the data-parallel size {dp} "
                        f"(world {world} ÷ sp {sp}): ranks would get unequal rows", (GPUS, TBS, N))
    actor = _train_role(cfg, "actor", ACTOR, world, seq_len)
    rows_per_rank = rows // dp
    rollout = _rollout(cfg, world, seq_len, warnings)
    rollout.update(_log_prob_role(cfg, "actor_rollout_ref.rollout", ROLLOUT, dp, sp, rows_per_rank, seq_len,
                                  check_micro=not actor_dynamic))
    rollout["old_log_prob_pass"] = needs_old_log_prob_pass(cfg, actor)
    check_multi_turn(cfg)
    staleness = check_async(cfg)  # off-policy rows: the old log-probs are still the current policy's
    # (decoupled PPO's proximal policy), which the update's own first forward is when it applies
    if computes_sum_pi_squared(cfg):  # the key only when on: the plan is in every stage's fingerprint
        rollout["sum_pi_squared"] = True
    ref = None
    if uses_ref(cfg):
        ref = _log_prob_role(cfg, "actor_rollout_ref.ref", REF, dp, sp, rows_per_rank, seq_len,
                             check_micro=not actor_dynamic)
    critic = None
    if uses_critic(cfg):
        critic = _critic(cfg, world, seq_len)
    reward_model = _reward_model(cfg, world, rows) if get_path(cfg, "reward_model.enable") else None
    return {
        "n_gpus": world, "nnodes": get_path(cfg, NODES), "n_gpus_per_node": get_path(cfg, GPUS),
        "prompts_per_step": tbs, "rollout_n": n, "rows_per_step": rows,
        "max_seq_len": seq_len,
        "actor": actor, "critic": critic, "rollout": rollout, "ref": ref, "reward_model": reward_model,
        "warnings": warnings,
        **({"async": async_plan(cfg, staleness, rollout["old_log_prob_pass"])} if staleness else {}),  # only when on: the plan is in every fingerprint
    }


MULTI_TURN = f"{ROLLOUT}.multi_turn"


def multi_turn_enabled(cfg) -> bool:
    return bool(get_path(cfg, f"{MULTI_TURN}.enable"))


def check_multi_turn(cfg) -> None:
    """Refuse, by name, what the multi-turn agent loop (stages/engines/agent_loop.py) cannot honour:
    prompts templated with other tools than the loop's, a tool config that is not there, and the
    features whose extra generations would need their own trajectories (DAPO's dynamic sampling,
    ReMax's greedy baseline answer)."""
    tools = get_path(cfg, f"{MULTI_TURN}.tool_config_path")
    data_tools = get_path(cfg, "data.tool_config_path")
    for key, path in ((f"{MULTI_TURN}.tool_config_path", tools), ("data.tool_config_path", data_tools)):
        if path and not Path(os.path.expanduser(str(path))).is_file():
            raise PlanError(f"{key}={path}: no such file (verl's tool config YAML: a `tools:` list)", (key,))
    if not multi_turn_enabled(cfg):
        return
    if (data_tools or None) != (tools or None):
        raise PlanError(f"data.tool_config_path={data_tools!r} differs from {MULTI_TURN}.tool_config_path={tools!r}: "
                        f"the prompts would offer other tools than the agent loop runs; leave data.tool_config_path "
                        f"at its default (${{{MULTI_TURN}.tool_config_path}})", ("data.tool_config_path",))
    if get_path(cfg, "algorithm.filter_groups.enable"):
        raise PlanError(f"{MULTI_TURN}.enable with algorithm.filter_groups.enable: dynamic sampling of multi-turn "
                        "trajectories is not implemented; disable one of them",
                        (f"{MULTI_TURN}.enable", "algorithm.filter_groups.enable"))
    if "baseline" in adv_estimator_needs(cfg):
        raise PlanError(f"{MULTI_TURN}.enable with algorithm.adv_estimator={get_path(cfg, 'algorithm.adv_estimator')}: "
                        "its greedy baseline answers would need multi-turn trajectories of their own (not "
                        "implemented); choose another estimator", (f"{MULTI_TURN}.enable", "algorithm.adv_estimator"))


# verl's async_training keys: (key, the only value accepted, why another depends on timing)
ASYNC_KEYS = (
    ("async_training.staleness_threshold", 0, "which samples run ahead of a weight sync depends on generation vs training speed"),
    ("async_training.trigger_parameter_sync_step", 1, "which prompts train in each local step depends on the order generations complete"),
    ("async_training.require_batches", 1, "a step is data.train_batch_size prompts"),
    ("async_training.partial_rollout", False, "where a generation is interrupted by a weight sync depends on timing"),
    ("async_training.use_rollout_log_probs", False, "stagerl recomputes old log-probs with the current policy and corrects with algorithm.rollout_correction"),
    ("async_training.compute_prox_log_prob", False, "stagerl's proximal policy is the current policy"),
)


def check_async(cfg) -> int:
    """trainer.staleness (>= 0); a verl async_training key set to a value whose meaning depends
    on timing (or that stagerl does not implement) is refused naming the key and the
    deterministic alternative."""
    for key, accepted, why in ASYNC_KEYS:
        value = get_path(cfg, key)
        if value is not None and value != accepted:
            show = lambda v: str(v).lower() if isinstance(v, bool) else _fmt(v)  # as written in YAML
            raise PlanError(f"{key}={show(value)}: not supported ({why}); stagerl's asynchrony is deterministic: "
                            f"trainer.staleness=s makes step k sample from the weights after update max(0, k-1-s) "
                            f"(s=1: verl's one-step-off policy); set {key}={show(accepted)}", (key, "trainer.staleness"))
    staleness = int(get_path(cfg, "trainer.staleness") or 0)
    if staleness < 0:
        raise PlanError(f"trainer.staleness={staleness}: must be >= 0", ("trainer.staleness",))
    return staleness


def async_plan(cfg, staleness: int, old_log_prob_pass: bool) -> dict:
    """What trainer.staleness=s does (`stagerl plan` shows it): which weights each rollout samples,
    which old log-probs the loss uses and which correction covers the behaviour-proximal gap."""
    correction = get_path(cfg, "algorithm.rollout_correction.rollout_is")
    rejection = get_path(cfg, "algorithm.rollout_correction.rollout_rs")
    if correction:
        covers = f"{correction}-level truncated importance sampling min(pi_old/pi_rollout, threshold) (algorithm.rollout_correction.rollout_is)"
    elif rejection:
        covers = f"{rejection}-level rejection sampling (algorithm.rollout_correction.rollout_rs)"
    else:
        covers = ("none: the PPO ratio is taken against the proximal policy only; set "
                  "algorithm.rollout_correction.rollout_is=token to weight by pi_old/pi_rollout")
    return {"staleness": staleness,
            "rollout_samples": f"step k from the weights after update max(0, k-1-{staleness})",
            "old_log_probs": ("recomputed by the logprob stage with the current policy (the weights after update k-1)"
                              if old_log_prob_pass else
                              "the current policy's (the weights after update k-1): the update's own first forward, "
                              "detached (one mini-batch, one epoch), stored as update/log_probs.parquet"),
            "rollout_log_probs": "stored by the engine (behaviour policy)",
            "correction": covers}


def resume_replay(cfg) -> dict:
    """What a resume replays at this trainer.save_freq (not part of the plan: it alters no result).
    The train state is stored every save_freq steps and at the last step; a resume restores the
    newest stored state and replays the updates after it from their stored rows, at most
    save_freq - 1 of them (save_freq <= 0: every update before the last step)."""
    save_freq = int(get_path(cfg, "trainer.save_freq") or -1)
    total = int(get_path(cfg, "trainer.total_training_steps") or 0)
    every = save_freq if save_freq > 0 else None
    at_most = (save_freq - 1) if every else max(total - 1, 0)
    return {"save_freq": save_freq, "train_state_every": every, "total_training_steps": total,
            "replays_at_most": min(at_most, max(total - 1, 0))}


def read_hostfile(path: str) -> dict:
    """A DeepSpeed hostfile read as DeepSpeed's runner reads it: `host slots=N` per line, `#`
    comments and blank lines skipped -> {host: slots} in file order. Bad files raise PlanError
    naming trainer.hostfile, the file and the line."""
    file = Path(os.path.expanduser(str(path)))
    if not file.is_file():
        raise PlanError(f"{HOSTFILE}={path}: no such file (a DeepSpeed hostfile: `host slots=N` per line)",
                        (HOSTFILE,))
    hosts: dict = {}
    for no, line in enumerate(file.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _HOST_LINE.match(line)
        if not m or int(m.group(2)) < 1:
            raise PlanError(f"{HOSTFILE}={path} line {no}: {line!r} is not `host slots=N` with N >= 1", (HOSTFILE,))
        if m.group(1) in hosts:
            raise PlanError(f"{HOSTFILE}={path} line {no}: host {m.group(1)} is listed twice", (HOSTFILE,))
        hosts[m.group(1)] = int(m.group(2))
    if not hosts:
        raise PlanError(f"{HOSTFILE}={path} lists no host (`host slots=N` per line)", (HOSTFILE,))
    return hosts


def check_launcher(cfg) -> dict | None:
    """trainer.launcher / trainer.hostfile against the world: the hostfile's hosts and slots
    (None without a hostfile)."""
    launcher, path = get_path(cfg, LAUNCHER), get_path(cfg, HOSTFILE)
    nodes, gpus = get_path(cfg, NODES), get_path(cfg, GPUS)
    if path is None:
        if launcher == "deepspeed" and nodes > 1:
            raise PlanError(f"{NODES}={nodes} with {LAUNCHER}=deepspeed needs {HOSTFILE}: the hosts to start "
                            f"ranks on (`host slots=N` per line)", (HOSTFILE, NODES))
        return None
    if launcher != "deepspeed":
        raise PlanError(f"{HOSTFILE}={path} is read by DeepSpeed's launcher only, but {LAUNCHER}={launcher}: "
                        f"set {LAUNCHER}=deepspeed (or {HOSTFILE}=null)", (LAUNCHER,))
    hosts = read_hostfile(path)
    slots = sum(hosts.values())
    if len(hosts) != nodes or slots != nodes * gpus:
        listed = ", ".join(f"{h} slots={s}" for h, s in hosts.items())
        raise PlanError(f"{HOSTFILE}={path} lists {len(hosts)} host(s) with {slots} slots ({listed}), but "
                        f"{NODES} × {GPUS} = {nodes} × {gpus}: it must list {nodes} host(s) with "
                        f"{nodes * gpus} slots in all", (NODES, GPUS))
    return hosts


def _critic(cfg, world: int, seq_len: int) -> dict:
    critic = _train_role(cfg, "critic", "critic", world, seq_len)
    dp, rows_per_rank = critic["dp_size"], critic["samples_per_dp_rank"]
    fwd = _normalise_deprecated(get_path(cfg, "critic.forward_micro_batch_size"), dp,
                                "critic.forward_micro_batch_size", "dp")
    if fwd is None:
        fwd = get_path(cfg, "critic.forward_micro_batch_size_per_gpu")
    dynamic = critic["use_dynamic_bsz"]
    if not dynamic and not fwd:
        raise PlanError("critic.forward_micro_batch_size_per_gpu is null: the value forward needs rows per "
                        "rank (it follows critic.ppo_micro_batch_size_per_gpu unless set)",
                        ("critic.forward_micro_batch_size_per_gpu",))
    critic["forward_micro_batch_size_per_gpu"] = fwd
    critic["value_forward_passes_per_rank"] = None if dynamic else ceil(rows_per_rank / fwd)
    critic["forward_max_token_len_per_gpu"] = (
        _check_budget("critic.forward_max_token_len_per_gpu", get_path(cfg, "critic.forward_max_token_len_per_gpu"),
                      critic["sp_size"], seq_len) if dynamic else None)
    return critic


def _reward_model(cfg, world: int, rows: int) -> dict:
    """verl: reward_model.micro_batch_size //= world (not ÷ sp)."""
    dynamic = get_path(cfg, "reward_model.use_dynamic_bsz")
    if not dynamic:
        _one_micro(cfg, "reward_model", "reward_model.micro_batch_size", "reward_model.micro_batch_size_per_gpu")
    micro = _normalise_deprecated(get_path(cfg, "reward_model.micro_batch_size"), world,
                                  "reward_model.micro_batch_size", "world")
    if micro is None:
        micro = get_path(cfg, "reward_model.micro_batch_size_per_gpu")
    per_rank = rows // world
    budget = get_path(cfg, "reward_model.forward_max_token_len_per_gpu") if dynamic else None
    if dynamic and (budget is None or budget < 1):
        raise PlanError(f"[reward_model] use_dynamic_bsz needs reward_model.forward_max_token_len_per_gpu "
                        f"(padded tokens per reward-model forward), got {budget!r}",
                        ("reward_model.forward_max_token_len_per_gpu",))
    return {"micro_batch_size_per_gpu": micro, "use_dynamic_bsz": bool(dynamic),
            "forward_max_token_len_per_gpu": budget,
            "forward_passes_per_rank": None if dynamic or not micro else ceil(per_rank / micro)}


def check_trainable(cfg) -> None:
    """What `stagerl plan` derives as verl does but stagerl's stages cannot train yet: refused
    before a run starts (ConfigError naming the key)."""
    for key in (f"{ACTOR}.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size"):
        if key.startswith("critic") and not uses_critic(cfg):
            continue
        if get_path(cfg, key) != 1:
            raise ConfigError(f"{key}={get_path(cfg, key)}: sequence parallelism is planned as verl "
                              f"does, but stagerl's logprob and update stages train whole sequences "
                              f"on each rank; set {key}=1 (the data-parallel size is then the world size)")
