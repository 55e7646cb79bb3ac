"""The update's train state in the store: which config keys shape it, where step k's lives, how a
rank loads the state of the step before, and which states a run keeps (verl's save_freq and
max_*_ckpt_to_keep). Shared by the update stage (stages/update.py: it commits and prunes) and its
ranks (stages/training/worker.py: they load), so neither imports the other.
"""
from __future__ import annotations

from storage.lineage import delete_tree
from storage.weights import load_folder

TRAIN_CONFIG_KEYS = ("actor_rollout_ref.actor", "actor_rollout_ref.model.path", "actor_rollout_ref.model.lora_rank",
                     "actor_rollout_ref.model.lora_alpha", "actor_rollout_ref.model.target_modules",
                     "actor_rollout_ref.rollout.temperature", "algorithm.rollout_correction",
                     "critic", "data.max_response_length", "trainer.balance_batch", "trainer.critic_warmup",
                     "trainer.total_training_steps", "trainer.n_gpus_per_node", "trainer.nnodes")
KEEP_STATES = 2  # the newest two are always kept: a rerun of step k needs train_state/step_{k-1}


def state_key(layout, k: int) -> str:
    return f"{layout.train_state}/step_{k:06d}"


def previous_state(ctx, role: str):
    """Local folder of train_state/step_{k-1}/<role> (fetched into the local cache if needed).
    Called by a rank only when it has no engine kept from step k-1 (stages.training.worker), so a
    run whose rank pool kept its engines never downloads its own checkpoints back."""
    key = f"{state_key(ctx.layout, ctx.step - 1)}/{role}"
    try:
        return load_folder(ctx.store, key, ctx.get("storage.cache_dir"))
    except Exception as err:  # IncompleteError / FileNotFoundError
        raise FileNotFoundError(f"update of step {ctx.step} needs the training state of step {ctx.step - 1} "
                                f"at {ctx.store.url(key)}: {err}") from err


def states_to_delete(steps: list[int], latest: int, save_freq: int, keep: int | None) -> list[int]:
    """Train states to remove after step `latest`'s update, as verl keeps its checkpoints: those at
    multiples of trainer.save_freq (> 0), the newest `keep` (max_actor_ckpt_to_keep, or the
    critic's; null or <= 0: all); the newest KEEP_STATES are kept besides (a rerun needs the step
    before's). So trainer.save_freq=1 keeps every state, and a fork can start at any step."""
    newest = [k for k in steps if k > latest - KEEP_STATES]
    saved = sorted(k for k in steps if save_freq > 0 and k % save_freq == 0 or k in newest)
    if keep is not None and keep > 0:
        saved = saved[-keep:]
    return [k for k in steps if 1 <= k <= latest - KEEP_STATES and k not in saved]


def prune_states(ctx) -> None:
    """Remove the train states states_to_delete names, per role (after the manifest, so a rerun
    of this step still finds the step before's); a fork that references one gets a copy first
    (storage.lineage)."""
    layout = ctx.layout
    steps = sorted(int(n[5:]) for n in ctx.store.list(layout.train_state)
                   if n.startswith("step_") and n[5:].isdigit())
    save_freq = int(ctx.get("trainer.save_freq") or -1)
    doomed = {role: states_to_delete(steps, ctx.step, save_freq, ctx.get(f"trainer.max_{role}_ckpt_to_keep"))
              for role in ("actor", "critic")}
    for k in sorted(set(doomed["actor"]) | set(doomed["critic"])):
        for role in [r for r in doomed if k in doomed[r]]:
            delete_tree(ctx.store, f"{state_key(layout, k)}/{role}")
        if not ctx.store.list(state_key(layout, k)):  # nothing left of that step
            ctx.store.delete(state_key(layout, k), recursive=True)
