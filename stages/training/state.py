"""The update's train state in the store: which config keys shape it, where step k's lives, when
a step stores it, which stored state a rank restores from, and which states a run keeps (verl's
save_freq and max_*_ckpt_to_keep). Shared by the update stage (stages/update.py: it commits and
prunes) and its ranks (stages/training/worker.py: they save and restore), so neither imports the
other.

A step's train state (DeepSpeed module, optimizer and RNG per rank: ~14 bytes a parameter) is
stored every trainer.save_freq steps and at the run's last step, not every step: a rank that has
no engine kept from the step before restores the newest stored state and replays the updates of
the steps after it from their stored rows (stages.training.worker.restore_job). The replay gives
the weights an uninterrupted run has, bit for bit: the learning rate is a function of the step,
every shuffle is seeded by (trainer.seed, step), the RNG is carried from step to step as a kept
engine carries it, and the rows are the stored ones.
"""
from __future__ import annotations

from configs.loader import get_path
from configs.plan import uses_critic
from storage.layout import WEIGHTS_MANIFEST
from storage.lineage import delete_tree
from storage.weights import load_folder

TRAIN_CONFIG_KEYS = ("actor_rollout_ref.actor", "actor_rollout_ref.model.path", "actor_rollout_ref.model.lora_rank",
                     "actor_rollout_ref.model.lora_alpha", "actor_rollout_ref.model.target_modules",
                     "actor_rollout_ref.rollout.temperature", "algorithm.rollout_correction",
                     "critic", "data.max_response_length", "trainer.balance_batch", "trainer.critic_warmup",
                     "trainer.n_gpus_per_node", "trainer.nnodes")
# The run's total steps reach an update only through a learning-rate schedule that depends on it
# (schedule_keys): the update's fingerprint holds it only then, so a run whose schedules do not
# can be extended (a larger trainer.total_training_steps) with its finished updates still complete.
TOTAL_KEY = "trainer.total_training_steps"
KEEP_STATES = 2  # the newest two stored states are always kept: what a resume restores from


def total_key(optim: dict) -> str | None:
    """The key of an optim section (verl's optim config) whose learning-rate schedule depends on
    the run's total steps: `warmup_style` (cosine decays over the total) or `lr_warmup_steps_ratio`
    (a warm-up of int(ratio x total) steps, when lr_warmup_steps < 0); None when the learning rate
    of every step is the same whatever the total (constant, with or without lr_warmup_steps)."""
    if (optim.get("warmup_style") or "constant") == "cosine":
        return "warmup_style"
    warmup = optim.get("lr_warmup_steps", -1)
    if (warmup is None or warmup < 0) and (optim.get("lr_warmup_steps_ratio") or 0.0) > 0:
        return "lr_warmup_steps_ratio"
    return None


def schedule_keys(cfg) -> list[str]:
    """The full keys of the learning-rate schedules that depend on the run's total steps, for every
    role the update trains (the actor; the critic when the run has one), e.g.
    ["actor_rollout_ref.actor.optim.warmup_style"]; [] when none does."""
    roles = ["actor_rollout_ref.actor"] + (["critic"] if uses_critic(cfg) else [])
    found = [(role, total_key(get_path(cfg, f"{role}.optim") or {})) for role in roles]
    return [f"{role}.optim.{key}" for role, key in found if key]


def state_key(layout, k: int) -> str:
    return f"{layout.train_state}/step_{k:06d}"


def state_due(ctx, every_step: bool) -> bool:
    """Whether step ctx.step's update stores its train state: at multiples of trainer.save_freq
    (> 0), at the run's last step, when asked (extra save_train_state), and at every step when
    `every_step` (no engine is kept for the next step). Whether the weights reach the rollout
    engine by handoff or by the export (trainer.staleness >= 1, LoRA, ranks on other hosts) does
    not matter: a resume restores the newest stored state and replays the updates after it."""
    save_freq = int(ctx.get("trainer.save_freq") or -1)
    total = int(ctx.extra.get("total_training_steps") or ctx.get("trainer.total_training_steps") or 0)
    return (every_step or (save_freq > 0 and ctx.step % save_freq == 0) or ctx.step >= total
            or bool(ctx.extra.get("save_train_state")))


def stored_states(ctx) -> list[int]:
    """The steps with a train state folder in the store (complete or not), ascending."""
    return sorted(int(n[5:]) for n in ctx.store.list(ctx.layout.train_state)
                  if n.startswith("step_") and n[5:].isdigit())


def newest_state(ctx, roles) -> int:
    """The newest step before ctx.step whose train state is stored complete for every role
    (0: none, the update starts from the initial weights)."""
    for s in reversed(stored_states(ctx)):
        if s < ctx.step and all(ctx.store.exists(f"{state_key(ctx.layout, s)}/{r}/{WEIGHTS_MANIFEST}")
                                for r in roles):
            return s
    return 0


def state_folder(ctx, k: int, role: str):
    """Local folder of train_state/step_k/<role> (fetched into the local cache if needed)."""
    key = f"{state_key(ctx.layout, k)}/{role}"
    try:
        return load_folder(ctx.store, key, ctx.get("storage.cache_dir"))
    except Exception as err:  # IncompleteError / FileNotFoundError
        raise FileNotFoundError(f"the update of step {ctx.step} restores the training state of step {k} "
                                f"at {ctx.store.url(key)}: {err}") from err


def states_to_delete(steps: list[int], latest: int, save_freq: int, keep: int | None) -> list[int]:
    """Train states to remove after step `latest`'s update, as verl keeps its checkpoints: those at
    multiples of trainer.save_freq (> 0), the newest `keep` (max_actor_ckpt_to_keep, or the
    critic's; null or <= 0: all); the newest KEEP_STATES stored are kept besides (what a resume
    restores from). So trainer.save_freq=1 keeps every state, and a fork can start at any step."""
    newest = [k for k in steps if k <= latest][-KEEP_STATES:]
    saved = sorted(k for k in steps if save_freq > 0 and k % save_freq == 0 or k in newest)
    if keep is not None and keep > 0:
        saved = saved[-keep:]
    return [k for k in steps if 1 <= k <= latest and k not in saved and k not in newest]


def prune_states(ctx) -> None:
    """Remove the train states states_to_delete names, per role (after the manifest, so a rerun
    of this step still finds the step before's); a fork that references one gets a copy first
    (storage.lineage)."""
    layout = ctx.layout
    steps = stored_states(ctx)
    save_freq = int(ctx.get("trainer.save_freq") or -1)
    doomed = {role: states_to_delete(steps, ctx.step, save_freq, ctx.get(f"trainer.max_{role}_ckpt_to_keep"))
              for role in ("actor", "critic")}
    for k in sorted(set(doomed["actor"]) | set(doomed["critic"])):
        for role in [r for r in doomed if k in doomed[r]]:
            delete_tree(ctx.store, f"{state_key(layout, k)}/{role}")
        if not ctx.store.list(state_key(layout, k)):  # nothing left of that step
            ctx.store.delete(state_key(layout, k), recursive=True)
