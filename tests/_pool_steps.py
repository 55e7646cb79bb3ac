"""Steps of logprob + update on 2 ranks over hand-made inputs (tests/_update_inputs.py): what the
rank pool test and bench/launch.py run, once with per-call launches and once through a pool."""
import time

from _update_inputs import make_ctx, write_inputs

# two mini-batches per step: the logprob stage keeps its actor (old log-prob) pass
TWO_RANKS = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
             "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "actor_rollout_ref.actor.optim.warmup_style=cosine",
             "actor_rollout_ref.actor.optim.lr_warmup_steps=0", "actor_rollout_ref.actor.use_kl_loss=true"]


def run_steps(root, model_dir, steps, overrides=(), pool=None):
    """Run steps 1..steps (inputs, logprob.run, update.run); per step: ctx, timings, manifests.
    With `pool` (a RankPool), the contexts carry a session whose rank_pool it is, as in a run."""
    from stages import logprob, update
    from stages.session import RunSession

    session = None
    if pool is not None:
        session = RunSession()
        session.rank_pool = pool

    def context(step):
        ctx = make_ctx(root, model_dir, step, TWO_RANKS + list(overrides))
        ctx.session = session
        return ctx

    out = []
    for step in range(1, steps + 1):
        ctx = context(step)
        write_inputs(ctx, seed=3)
        t0 = time.perf_counter()
        lp = logprob.run(ctx)
        t1 = time.perf_counter()
        up = update.run(context(step))
        if session is not None:
            session.wait_commits()  # the update's commit (in the background with a session)
        t2 = time.perf_counter()
        out.append({"ctx": ctx, "logprob_s": t1 - t0, "update_s": t2 - t1, "logprob": lp, "update": up})
    return out
