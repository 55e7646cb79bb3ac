"""DAPO's dynamic sampling (algorithm.filter_groups; verl's DAPO recipe, RayDAPOTrainer.fit):
generate batches of data.gen_batch_size prompts, score each answer, keep only the groups (the n
answers of one prompt) whose `filter_groups.metric` varies (np.std > 0; a group of one is kept),
until data.train_batch_size groups are kept; the surplus of the last batch is dropped, as verl's
`batch[:train_batch_size * n]`. Past `max_num_gen_batches` batches (<= 0: no limit) the step fails
with the counts.

Metrics per answer: acc (the scorer's acc), score (the scorer's raw score), seq_reward (the score
the reward stage will give: with DAPO's overlong penalty), seq_final_reward (the same: KL in
reward, which verl would add, needs reference log-probs and is refused with this metric).

What the rollout stage stores: rollout.parquet holds the kept rows only (train_batch_size × n,
the step's training rows, uids unique across the generation batches); rollout/candidates.parquet
holds EVERY generated answer with its generation batch, metric value, group std, `kept` and the
`reason` (kept, filtered: <metric> all equal to v, surplus beyond train_batch_size), so `stagerl
inspect` shows what was filtered and why. Data position: the batches consume the prompt stream
from where the previous step's rollout stopped (its manifest's data_position), so a resumed run
draws the same prompts.
"""
from __future__ import annotations

import copy
from collections import Counter

import numpy as np

from storage.schemas import make_table

METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
CANDIDATES = "rollout/candidates.parquet"


class DynamicSamplingError(RuntimeError):
    """Too few groups with a varied metric within algorithm.filter_groups.max_num_gen_batches."""


def start_position(ctx, dataset):
    """Where step k's prompts start: step 1 at the beginning, step k > 1 where step k-1's rollout
    stopped (its manifest)."""
    from storage.artifacts import require_manifest

    if ctx.step <= 1:
        return dataset.position_for_step(0)
    return require_manifest(ctx.store, ctx.layout, ctx.step - 1, "rollout")["extra"]["data_position"]


def metric_values(metric: str, results: list[dict], scores: list[float]) -> list[float]:
    """The per-answer value compared within a group."""
    if metric == "acc":
        return [0.0 if r["error"] else float(r["acc"] if r["acc"] is not None else r["score"]) for r in results]
    if metric == "score":
        return [float(r["score"]) for r in results]
    if metric in ("seq_reward", "seq_final_reward"):
        return [float(s) for s in scores]
    raise ValueError(f"algorithm.filter_groups.metric={metric!r}: one of {', '.join(METRICS)}")


def varied_groups(uids: list[str], values: list[float]) -> dict[str, float]:
    """uid -> population std of its values (np.std, ddof 0), in first-seen order."""
    groups: dict[str, list] = {}
    for uid, v in zip(uids, values):
        groups.setdefault(uid, []).append(v)
    return {uid: float(np.std(vs)) for uid, vs in groups.items()}


def collect_groups(ctx, dataset, sampling, model_dir, tokenizer, sample_prompts, rule_rewards):
    """Generate until train_batch_size varied groups are kept. Returns (kept columns, engine timings
    of the last batch, manifest extra, candidates table)."""
    tbs = int(ctx.get("data.train_batch_size"))
    gen_bs = int(ctx.get("data.gen_batch_size") or tbs)
    metric = ctx.get("algorithm.filter_groups.metric")
    limit = int(ctx.get("algorithm.filter_groups.max_num_gen_batches") or 0)
    gen_ds = copy.copy(dataset)
    gen_ds.batch_size = gen_bs
    position = start_position(ctx, dataset)
    kept_cols: dict = {}
    cand: dict = {k: [] for k in ("gen_batch", "uid", "sample_index", "data_source", "response_length", "metric",
                                  "group_std", "kept", "reason")}
    kept_uids: list[str] = []
    batches, first, timings = 0, None, {}
    while len(kept_uids) < tbs:
        if limit > 0 and batches >= limit:
            raise DynamicSamplingError(
                f"step {ctx.step}: {len(kept_uids)} of data.train_batch_size={tbs} groups have a varied {metric} after "
                f"{batches} generation batches of {gen_bs} prompts (algorithm.filter_groups.max_num_gen_batches="
                f"{limit}): the prompts are too easy or too hard for the policy; raise the limit (<= 0: no limit) "
                f"or check the reward")
        batch = gen_ds.batch_at(position)
        first = first or batch
        position = batch.next_position
        cols, timings = sample_prompts(ctx, batch.rows, sampling, model_dir, tokenizer,
                                       purpose=f"rollout/gen{batches}", position_offset=batches * gen_bs)
        results, scores, _, _ = rule_rewards(ctx, make_table("rollout", cols))
        values = metric_values(metric, results, scores)
        stds = varied_groups(cols["uid"], values)
        n_groups = Counter(cols["uid"])
        varied = [uid for uid, std in stds.items() if std > 0 or n_groups[uid] == 1]
        take = varied[:tbs - len(kept_uids)]
        take_set = set(take)
        rows = [i for i, uid in enumerate(cols["uid"]) if uid in take_set]
        for name, column in cols.items():
            kept_cols.setdefault(name, []).extend(column[i] for i in rows)
        for i, uid in enumerate(cols["uid"]):
            cand["gen_batch"].append(batches)
            cand["uid"].append(uid)
            cand["sample_index"].append(cols["sample_index"][i])
            cand["data_source"].append(cols["data_source"][i])
            cand["response_length"].append(cols["response_length"][i])
            cand["metric"].append(values[i])
            cand["group_std"].append(stds[uid])
            cand["kept"].append(uid in take_set)
            cand["reason"].append("kept" if uid in take_set else "surplus beyond data.train_batch_size"
                                  if uid in varied else f"filtered: {metric} all equal to {values[i]:g}")
        kept_uids += take
        batches += 1
    extra = {"data_position": position.to_dict() if hasattr(position, "to_dict") else position,
             "batch_position": first.position.to_dict(), "epoch": first.epoch,
             "filter_groups": {"metric": metric, "gen_batches": batches, "generated_prompts": batches * gen_bs,
                               "generated_rows": len(cand["uid"]), "kept_prompts": len(kept_uids),
                               "kept_rows": len(kept_cols["uid"]),
                               "filtered_prompts": len({u for u, r in zip(cand["uid"], cand["reason"])
                                                        if r.startswith("filtered")})}}
    return kept_cols, timings, extra, make_table("rollout_candidates", cand)
