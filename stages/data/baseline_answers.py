"""Greedy baseline answers for the estimators that declare they need a "baseline" (remax; verl's
RayPPOTrainer.fit generates them with do_sample=False and scores them with the reward function).

Where they live in a step (the same run layout, committed by the stages' manifests):
- rollout/baseline.parquet (the rollout stage): one greedy answer per prompt of the step's rows,
  the rollout schema, keyed by the prompt's uid, sample_index 0. Not training rows.
- reward/baseline.parquet (the reward stage): their scores (uid, score, acc, extras, error).
The advantage stage gives each row its prompt's baseline score (`reward_baselines`).
"""
from __future__ import annotations

from storage.artifacts import read_file, require_manifest

ANSWERS = "rollout/baseline.parquet"
SCORES = "reward/baseline.parquet"


def needs_baseline(ctx) -> bool:
    """algorithm.adv_estimator declared it needs a greedy baseline answer per prompt."""
    from stages.algos.advantages import estimator_needs

    return "baseline" in estimator_needs(ctx.get("algorithm.adv_estimator"))


def _stored(ctx, stage: str, name: str):
    """The step's file `name` of `stage` when its manifest lists it, else None."""
    if name not in (require_manifest(ctx.store, ctx.layout, ctx.step, stage).get("files") or {}):
        return None
    return read_file(ctx.store, ctx.layout, ctx.step, stage, name)


def read_answers(ctx):
    """rollout/baseline.parquet of the step, or None when the rollout generated no baseline."""
    return _stored(ctx, "rollout", ANSWERS)


def scores_per_row(ctx, uids: list) -> list[float]:
    """The baseline score of each row's prompt (by uid), from reward/baseline.parquet; ValueError
    naming what is missing."""
    table = _stored(ctx, "reward", SCORES)
    if table is None:
        raise ValueError(
            f"step {ctx.step}: algorithm.adv_estimator={ctx.get('algorithm.adv_estimator')} declares it needs a "
            f"baseline, but the reward stage stored no {SCORES} (the rollout generated no greedy baseline "
            f"answers, {ANSWERS}); rerun the step from its rollout")
    by_uid = dict(zip(table.column("uid").to_pylist(), table.column("score").to_pylist()))
    missing = [u for u in dict.fromkeys(uids) if u not in by_uid]
    if missing:
        raise ValueError(f"step {ctx.step}: {SCORES} has no baseline score for the prompts "
                         f"{', '.join(map(str, missing[:10]))}" + (" ..." if len(missing) > 10 else ""))
    return [float(by_uid[u]) for u in uids]
