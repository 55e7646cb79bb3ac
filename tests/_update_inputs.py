"""Inputs of the update stage built by hand in a tmp store: a tiny model, random responses with
skewed lengths, and rollout/logprob/advantage tables (no other stage is run)."""
import json

import numpy as np

from configs.loader import load_config
from configs.suggest import make_plan
from stages.context import StageContext
from storage.artifacts import write_table
from storage.schemas import make_table

BASE = ["warmstart.enable=false", "data.max_prompt_length=16", "data.max_response_length=24", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.use_kl_loss=false",
        "trainer.n_gpus_per_node=1", "trainer.total_training_steps=10"]


def make_ctx(tmp_path, model_dir, step=1, overrides=()):
    overrides = list(BASE) + [f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={model_dir}",
                              f"storage.root={tmp_path / 'store'}",
                              f"storage.cache_dir={tmp_path / 'cache'}"] + list(overrides)
    cfg = load_config("tiny-cpu", overrides)
    return StageContext.create(cfg, make_plan(cfg), step)


def write_inputs(ctx, seed=0, vocab=500, critic=False, nan_advantage=False, response_lengths=None,
                 engine_shift=None):
    """rollout/logprob/advantage tables of ctx.plan['rows_per_step'] rows with skewed lengths;
    engine_shift: the rollout also stores engine log-probs = old log-probs + engine_shift."""
    rng = np.random.default_rng(seed + 1000 * ctx.step)
    rows = ctx.plan["rows_per_step"]
    max_resp = ctx.get("data.max_response_length")
    plens = rng.integers(3, ctx.get("data.max_prompt_length") + 1, rows)
    rlens = np.minimum(max_resp, np.maximum(1, (rng.pareto(1.2, rows) * 4).astype(int) + 1))
    if response_lengths is not None:
        rlens = np.asarray(response_lengths(rng, rows, max_resp), dtype=int)
    prompt_ids = [rng.integers(10, vocab, n).tolist() for n in plens]
    response_ids = [rng.integers(10, vocab, n).tolist() for n in rlens]
    n = ctx.get("actor_rollout_ref.rollout.n")
    rollout = make_table("rollout", {
        "uid": [f"u{i // n}" for i in range(rows)], "sample_index": [i % n for i in range(rows)],
        "prompt": ["p"] * rows, "prompt_ids": prompt_ids, "response": ["r"] * rows,
        "response_ids": response_ids, "response_length": rlens.tolist(),
        "finish_reason": ["stop"] * rows, "data_source": ["arith"] * rows, "ground_truth": ["1"] * rows,
        "extra_info": [json.dumps({})] * rows})
    tok = lambda scale, shift=0.0: [(rng.standard_normal(k) * scale + shift).astype(np.float32).tolist() for k in rlens]
    logprob = {"old_log_probs": tok(0.3, -6.0), "ref_log_probs": tok(0.3, -6.0), "entropy": tok(0.1, 5.0)}
    if critic:
        logprob["values"] = tok(0.5)
    if engine_shift is not None:
        rollout = rollout.append_column("rollout_log_probs", make_table("rollout", {
            **rollout.to_pydict(), "rollout_log_probs": [[v + engine_shift for v in r] for r in logprob["old_log_probs"]]
        }).column("rollout_log_probs"))
    adv = [[float(a)] * k for a, k in zip(rng.standard_normal(rows), rlens)]
    if nan_advantage:
        adv[0][0] = float("nan")
    advantage = {"token_level_rewards": tok(0.0), "advantages": adv, "returns": tok(1.0), "kl": tok(0.0)}
    write_table(ctx.store, ctx.layout, ctx.step, "rollout", rollout, fingerprint="r")
    write_table(ctx.store, ctx.layout, ctx.step, "logprob", make_table("logprob", logprob), fingerprint="l")
    write_table(ctx.store, ctx.layout, ctx.step, "advantage", make_table("advantage", advantage), fingerprint="a")
    return rlens
