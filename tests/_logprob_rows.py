"""A step's rollout.parquet built by hand for logprob tests: arith prompts tokenized with the tiny
tokenizer (chat template), random response ids of skewed lengths; plus a context over a tmp store."""
import json
import random

from configs.loader import load_config
from configs.suggest import make_plan
from stages.context import StageContext
from stages.data.tools import make_arith_dataset
from storage.artifacts import write_table
from storage.schemas import make_table


def make_ctx(root, model_dir, overrides=(), ranks=1, step=1):
    """Two mini-batches per step (ppo_mini_batch_size 2 of 4 prompts), so the plan keeps the
    separate old-log-prob pass (one mini-batch, one epoch would let the update's forward replace it)."""
    cfg = load_config("tiny-cpu", ["warmstart.enable=false", "actor_rollout_ref.rollout.temperature=1.0", 
        f"storage.root={root}", "trainer.experiment_name=lp", f"trainer.n_gpus_per_node={ranks}",
        f"actor_rollout_ref.model.path={model_dir}", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3",
        "data.max_prompt_length=48", "data.max_response_length=40", *overrides])
    return StageContext.create(cfg, make_plan(cfg), step)


def rollout_rows(tokenizer, n_prompts=4, n=2, max_response=40, seed=0):
    """n adjacent rows per prompt; response lengths skewed (mostly short, a few long): with ~20
    prompt tokens two short sequences fit beside a long one's width, so packed micro-batches
    (stages.batches.binning) do put several sequences in one tensor row."""
    rng = random.Random(seed)
    rows = []
    records = [make_arith_dataset(1, seed=seed + p, difficulty=1 + (2 * p) % 5)[0] for p in range(n_prompts)]
    for p, record in enumerate(records):
        text = tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text)["input_ids"]
        for k in range(n):
            length = rng.choice([1, 2, 3, 4, max_response]) if rng.random() < 0.8 else max_response
            rows.append({"uid": f"u{p}", "sample_index": k, "prompt": text, "prompt_ids": prompt_ids,
                         "response_ids": [rng.randrange(3, len(tokenizer)) for _ in range(length)],
                         "ground_truth": record["reward_model"]["ground_truth"]})
    return rows


def write_rollout(ctx, rows):
    table = make_table("rollout", {
        "uid": [r["uid"] for r in rows], "sample_index": [r["sample_index"] for r in rows],
        "prompt": [r["prompt"] for r in rows], "prompt_ids": [r["prompt_ids"] for r in rows],
        "response": ["?"] * len(rows), "response_ids": [r["response_ids"] for r in rows],
        "response_length": [len(r["response_ids"]) for r in rows],
        "finish_reason": ["length"] * len(rows), "data_source": ["stagerl/arith"] * len(rows),
        "ground_truth": [r["ground_truth"] for r in rows],
        "extra_info": [json.dumps({"index": i}) for i in range(len(rows))],
    })
    return write_table(ctx.store, ctx.layout, ctx.step, "rollout", table, fingerprint=f"rollout-{ctx.step}")
