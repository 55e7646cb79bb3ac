"""Build a step's rollout / logprob / reward artifacts by hand in a tmp store (no model), for the
reward and advantage stage tests."""
import json

from configs.loader import load_config
from configs.suggest import make_plan
from stages.context import StageContext
from storage.artifacts import write_table
from storage.schemas import make_table

SMALL = ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=3", "trainer.n_gpus_per_node=1",
         "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=6",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=6",
         "critic.ppo_micro_batch_size_per_gpu=2",
         "data.max_prompt_length=8", "data.max_response_length=4",
         "reward.num_workers=2", "reward.timeout_s=20"]


def make_ctx(root, overrides=(), step=1, experiment="t"):
    cfg = load_config("tiny-cpu", ["warmstart.enable=false", f"storage.root={root}", f"trainer.experiment_name={experiment}",
                                   *SMALL, *overrides])
    return StageContext.create(cfg, make_plan(cfg), step)


def at_step(ctx, step):
    return StageContext(cfg=ctx.cfg, plan=ctx.plan, store=ctx.store, layout=ctx.layout, step=step)


def write_rollout(ctx, responses, truths, *, n=3, lengths=None, prompt_lengths=None,
                  data_source="stagerl/arith", extra_info=None):
    rows = len(responses)
    lengths = lengths or [max(1, min(4, len(r))) for r in responses]
    prompt_lengths = prompt_lengths or [5] * rows
    sources = data_source if isinstance(data_source, list) else [data_source] * rows
    table = make_table("rollout", {
        "uid": [f"p{i // n}" for i in range(rows)],
        "sample_index": [i % n for i in range(rows)],
        "prompt": ["<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"] * rows,
        "prompt_ids": [list(range(1, p + 1)) for p in prompt_lengths],
        "response": list(responses),
        "response_ids": [list(range(10, 10 + k)) for k in lengths],
        "response_length": lengths,
        "finish_reason": ["length" if k == 4 else "stop" for k in lengths],
        "data_source": sources,
        "ground_truth": list(truths),
        "extra_info": [json.dumps(e) for e in (extra_info or [{"index": i} for i in range(rows)])],
    })
    fp = f"rollout-{ctx.step}"
    return write_table(ctx.store, ctx.layout, ctx.step, "rollout", table, fingerprint=fp)


def write_logprob(ctx, old, ref, values=None):
    columns = {"old_log_probs": old, "ref_log_probs": ref, "entropy": [[0.5] * len(r) for r in old]}
    if values is not None:
        columns["values"] = values
    return write_table(ctx.store, ctx.layout, ctx.step, "logprob", make_table("logprob", columns),
                       fingerprint=f"logprob-{ctx.step}", inputs=ctx.input_fingerprints(["rollout"]))


def write_reward(ctx, scores, inputs=None):
    table = make_table("reward", {"score": scores, "acc": [float(s > 0) for s in scores]})
    return write_table(ctx.store, ctx.layout, ctx.step, "reward", table,
                       fingerprint=f"reward-{ctx.step}",
                       inputs=inputs if inputs is not None else ctx.input_fingerprints(["rollout"]))
