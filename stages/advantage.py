"""advantage stage: token rewards, KL in reward, advantages and returns (verl: RayPPOTrainer.fit, compute_advantage in verl/trainer/ppo/ray_trainer.py).

1. token_level_scores: each row's reward score at its last valid response token (index
   response_length - 1), zeros elsewhere (verl's naive reward manager). An empty response has no
   token to carry a score. The response mask is the response's tokens, times rollout.parquet's
   response_mask when the rollout has one (multi-turn: tool-response tokens are 0, so they get no
   advantage, return or KL, as in verl).
2. algorithm.use_kl_in_reward: token_level_rewards = scores - beta * kl_penalty(old, ref) (kind
   algorithm.kl_penalty) via stages.algos.kl.apply_kl_penalty; beta comes from algorithm.kl_ctrl
   (fixed | adaptive). The adaptive coefficient is run state: step 1 starts from the config, step
   k > 1 loads the state the previous step's advantage manifest stored in extra["kl_ctrl"]["after"]
   (never in-memory state), so a resumed run equals an uninterrupted one bit for bit.
   Otherwise token_level_rewards = token_level_scores and the kl column is zeros.
3. The estimator algorithm.adv_estimator (stages.algos.advantages registry) with index = uid,
   gamma/lam, norm_adv_by_std_in_grpo, and what the estimator declared it needs: the logprob
   stage's `values` (gae), `old_log_probs` and `sum_pi_squared` (optimal_token_baseline), and
   `reward_baselines` (remax: each row's prompt's greedy baseline score, reward/baseline.parquet;
   stages.data.baseline_answers).

advantage.parquet (rollout row order, unpadded per-token lists): token_level_rewards, advantages,
returns, kl. The manifest's extra["metrics"] holds verl's data metrics (compute_data_metrics) and
actor/reward_kl_penalty(_coeff); extra["kl_ctrl"] the controller state before and after the step.
"""
from __future__ import annotations

import math
import time

import torch

from configs.plan import uses_critic
from stages.batches.batching import unpad_arrow
from storage.artifacts import fingerprint as hash_obj
from storage.artifacts import read_manifest, write_table
from storage.schemas import make_table

STAGE = "advantage"
INPUTS = ("rollout", "logprob", "reward")
CONFIG_KEYS = ("algorithm", "critic.enable", "data.max_prompt_length", "data.max_response_length",
               "actor_rollout_ref.rollout.response_length")


class AdvantageInputError(ValueError):
    """The step's rollout, logprob and reward artifacts do not fit together (message names rows)."""


def run(ctx) -> dict:
    t0 = time.perf_counter()
    from stages.algos.advantages import compute_advantage, get_adv_estimator

    estimator = ctx.get("algorithm.adv_estimator")
    needs = get_adv_estimator(estimator).needs  # unknown name: lists the registered ones, before any reading
    use_kl = bool(ctx.get("algorithm.use_kl_in_reward"))
    critic = uses_critic(ctx.cfg)
    batch = load_batch(ctx, need_values="values" in needs or critic, need_ref=use_kl,
                       need_policy=tuple(n for n in ("old_log_probs", "sum_pi_squared") if n in needs))
    if "baseline" in needs:
        from stages.data.baseline_answers import scores_per_row

        try:
            batch["reward_baselines"] = torch.tensor(scores_per_row(ctx, batch["uid"]), dtype=torch.float32)
        except ValueError as err:
            raise AdvantageInputError(str(err)) from None
    mask, scores = batch["response_mask"], batch["token_level_scores"]

    kl_state = {}
    kl_metrics = {}
    if use_kl:
        controller = kl_controller(ctx)
        kl_state["before"] = controller.state_dict()
        from stages.algos.kl import apply_kl_penalty

        rewards, kld, _, kl_metrics = apply_kl_penalty(
            scores, batch["old_log_probs"], batch["ref_log_probs"], mask, controller,
            kind=ctx.get("algorithm.kl_penalty", "kl"))
        kl_state["after"] = controller.state_dict()
    else:
        rewards, kld = scores.clone(), torch.zeros_like(scores)

    advantages, returns = compute_advantage(
        estimator, rewards, mask, index=batch["uid"], values=batch.get("values"),
        reward_baselines=batch.get("reward_baselines"), old_log_probs=batch.get("old_log_probs"),
        sum_pi_squared=batch.get("sum_pi_squared"),
        gamma=float(ctx.get("algorithm.gamma", 1.0)), lam=float(ctx.get("algorithm.lam", 1.0)),
        norm_adv_by_std_in_grpo=bool(ctx.get("algorithm.norm_adv_by_std_in_grpo", True)))

    from stages.metrics import compute_data_metrics

    metrics = compute_data_metrics(scores, rewards, advantages, returns, mask,
                                   batch["attention_mask"],
                                   values=batch.get("values") if critic else None)
    metrics.update(kl_metrics)
    lengths = batch["response_length"]
    table = make_table("advantage", {
        "token_level_rewards": unpad_arrow(rewards, lengths), "advantages": unpad_arrow(advantages, lengths),
        "returns": unpad_arrow(returns, lengths), "kl": unpad_arrow(kld, lengths)})
    fingerprint = stage_fingerprint(ctx, kl_state.get("before"))
    extra = {"metrics": metrics, "adv_estimator": estimator}
    if kl_state:
        extra["kl_ctrl"] = kl_state
    return write_table(ctx.store, ctx.layout, ctx.step, STAGE, table, fingerprint=fingerprint,
                       inputs=ctx.input_fingerprints(INPUTS),
                       timings={"adv_s": round(time.perf_counter() - t0, 4)}, extra=extra)


def stage_fingerprint(ctx, kl_before=None) -> str:
    """ctx.fingerprint plus the KL controller state this step starts from (read from the previous
    step's manifest when not given), so a changed coefficient history reruns the stage."""
    if kl_before is None and ctx.get("algorithm.use_kl_in_reward"):
        try:
            kl_before = kl_controller(ctx).state_dict()
        except AdvantageInputError:
            kl_before = "unavailable"  # never matches a written manifest; run() raises the reason
    return hash_obj({"base": ctx.fingerprint(STAGE, CONFIG_KEYS, INPUTS), "kl_ctrl_before": kl_before})


def kl_controller(ctx):
    """The in-reward KL controller for this step: config at step 1 (and always for `fixed`),
    else the state stored by the previous step's advantage manifest."""
    from stages.algos.kl import make_kl_controller

    kind = ctx.get("algorithm.kl_ctrl.type", "fixed")
    controller = make_kl_controller(kind, float(ctx.get("algorithm.kl_ctrl.kl_coef")),
                                    target_kl=float(ctx.get("algorithm.kl_ctrl.target_kl", 0.1)),
                                    horizon=int(ctx.get("algorithm.kl_ctrl.horizon", 10000)))
    if kind == "fixed" or ctx.step <= 1:
        return controller
    previous = read_manifest(ctx.store, ctx.layout, ctx.step - 1, STAGE)
    if previous is None:
        raise AdvantageInputError(
            f"step {ctx.step}: algorithm.kl_ctrl.type=adaptive needs the KL coefficient of step "
            f"{ctx.step - 1}, but that step's advantage stage is incomplete (no manifest at "
            f"{ctx.store.url(ctx.layout.manifest(ctx.step - 1, STAGE))})")
    state = (previous.get("extra") or {}).get("kl_ctrl", {}).get("after")
    if state is None:
        raise AdvantageInputError(
            f"step {ctx.step}: the advantage manifest of step {ctx.step - 1} stores no KL "
            "controller state (that step ran without algorithm.use_kl_in_reward); cannot continue "
            "the adaptive coefficient")
    controller.load_state_dict(state)
    return controller


def load_batch(ctx, need_values: bool, need_ref: bool, need_policy: tuple = ()) -> dict:
    """Read and cross-check the step's artifacts; return padded (bs, T) tensors, T =
    rollout.response_length, and the (bs, max_prompt_length + T) attention mask for metrics.
    need_policy: logprob columns of the actor's pass the estimator declared it needs
    (old_log_probs, sum_pi_squared)."""
    rollout = ctx.read_input("rollout")
    logprob = ctx.read_input("logprob")
    reward = ctx.read_input("reward")
    check_same_rollout(ctx, rollout.num_rows, logprob.num_rows, reward.num_rows)

    lengths = rollout.column("response_length").to_pylist()
    prompt_lengths = [len(ids) for ids in rollout.column("prompt_ids").to_pylist()]
    width = int(ctx.get("actor_rollout_ref.rollout.response_length")
                or ctx.get("data.max_response_length"))
    prompt_width = int(ctx.get("data.max_prompt_length"))
    check_widths(lengths, width, "response_length", "actor_rollout_ref.rollout.response_length")
    check_widths(prompt_lengths, prompt_width, "prompt length", "data.max_prompt_length")

    score = reward.column("score").to_pylist()
    bad = [i for i, s in enumerate(score) if s is None or not math.isfinite(s)]
    if bad:
        raise AdvantageInputError(f"reward.parquet of step {ctx.step}: score is NaN/inf/missing in "
                                  f"rows {', '.join(map(str, bad[:20]))}" + (" ..." if len(bad) > 20 else ""))
    bs = len(lengths)
    n, p = torch.tensor(lengths).view(bs, 1), torch.tensor(prompt_lengths).view(bs, 1)
    mask = (torch.arange(width).view(1, -1) < n).to(torch.float32)
    if "response_mask" in rollout.schema.names:  # multi-turn: tool-response tokens carry no loss, KL or advantage
        mask = mask * stored_response_mask(rollout.column("response_mask").to_pylist(), lengths, width)
    columns = torch.arange(prompt_width + width).view(1, -1)  # left-padded prompt, right-padded response
    attention = ((columns >= prompt_width - p) & (columns < prompt_width + n)).to(torch.float32)
    scores = torch.zeros((bs, width), dtype=torch.float32)
    rows = torch.nonzero(n.view(-1) > 0).view(-1)  # an empty response has no token for its score
    scores[rows, n.view(-1)[rows] - 1] = torch.tensor(score, dtype=torch.float32)[rows]
    batch = {"response_mask": mask, "token_level_scores": scores, "attention_mask": attention,
             "response_length": lengths, "uid": rollout.column("uid").to_pylist()}
    columns = ["old_log_probs", "ref_log_probs"] if need_ref else []
    if need_values:
        columns.append("values")
    columns += [name for name in need_policy if name not in columns]
    for name in columns:
        if name not in logprob.schema.names or logprob.column(name).null_count:
            estimator = f"algorithm.adv_estimator={ctx.get('algorithm.adv_estimator')}, which declares it needs"
            why = (f"{estimator} critic values, or critic.enable" if name == "values"
                   else f"{estimator} {name}" if name in need_policy else "algorithm.use_kl_in_reward")
            raise AdvantageInputError(f"logprob.parquet of step {ctx.step} has no {name!r} "
                                      f"(needed by {why})")
        batch[name] = pad(logprob.column(name).to_pylist(), lengths, width, name)
    return batch


def stored_response_mask(masks, lengths, width: int) -> torch.Tensor:
    """rollout.parquet's response_mask (multi-turn: 1 on sampled tokens, 0 on tool responses) as a
    (bs, width) float32 tensor, zero padded; a row whose mask is not its response's length is refused."""
    out = torch.zeros((len(masks), width), dtype=torch.float32)
    for i, (mask, n) in enumerate(zip(masks, lengths)):
        if mask is None or len(mask) != n:
            raise AdvantageInputError(f"rollout.parquet row {i}: response_mask has "
                                      f"{'no' if mask is None else len(mask)} tokens, response_length is {n}")
        if n:
            out[i, :n] = torch.tensor(mask, dtype=torch.float32)
    return out


def check_same_rollout(ctx, rollout_rows: int, logprob_rows: int, reward_rows: int) -> None:
    """Row counts agree, and the logprob/reward manifests were computed from this rollout."""
    for name, rows in (("logprob", logprob_rows), ("reward", reward_rows)):
        if rows != rollout_rows:
            raise AdvantageInputError(
                f"step {ctx.step}: {name}.parquet has {rows} rows but rollout.parquet has "
                f"{rollout_rows}; the {name} stage must write one row per rollout row, in order")
    rollout_fp = ctx.input_manifest("rollout", required=True)["fingerprint"]
    for name in ("logprob", "reward"):
        recorded = (ctx.input_manifest(name, required=True).get("inputs") or {}).get("rollout")
        if recorded is not None and recorded != rollout_fp:
            raise AdvantageInputError(
                f"step {ctx.step}: {name}.parquet was computed from another rollout (its manifest "
                f"lists rollout fingerprint {recorded[:12]}, the step's rollout is "
                f"{rollout_fp[:12]}); rerun the {name} stage")


def check_widths(lengths, width: int, what: str, key: str) -> None:
    over = [i for i, n in enumerate(lengths) if n > width]
    if over:
        raise AdvantageInputError(f"rollout rows {', '.join(map(str, over[:20]))} have a {what} "
                                  f"over {key}={width}")


def pad(lists, lengths, width: int, name: str) -> torch.Tensor:
    """Per-token lists -> (bs, width) float32, zero padded; non-finite values refused by row."""
    out = torch.zeros((len(lists), width), dtype=torch.float32)
    for i, (values, n) in enumerate(zip(lists, lengths)):
        if len(values) != n:
            raise AdvantageInputError(f"logprob.parquet row {i}: {name} has {len(values)} tokens, "
                                      f"the rollout's response_length is {n}")
        if n:
            out[i, :n] = torch.tensor(values, dtype=torch.float32)
    bad = [i for i in range(len(lists)) if not bool(torch.isfinite(out[i]).all())]
    if bad:
        raise AdvantageInputError(f"logprob.parquet: {name} is NaN/inf in rows "
                                  f"{', '.join(map(str, bad[:20]))}")
    return out

