"""Which config changes would alter finished work: what a rerun refuses (flows/rerun.py
check_rerun, which lets a changed total extend a run) and what a fork checks against its source
(flows/fork.py)."""

# Config keys whose change cannot alter finished work (how long to train, logging, placement).
RESUMABLE_PREFIXES = (
    "trainer.logger",
    "trainer.save_freq", "trainer.test_freq", "trainer.val_before_train", "trainer.val_only",
    "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep",
    "trainer.log_val_generations", "trainer.resume_mode", "trainer.resume_from_path",
    "trainer.launcher", "trainer.hostfile",
    "storage.", "orchestration.", "reward.num_workers", "reward.timeout_s",
    "actor_rollout_ref.actor.optim.total_training_steps", "critic.optim.total_training_steps",
)


def flatten(tree: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1} (an empty dict stays a value)."""
    out = {}
    for key, value in (tree or {}).items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def changed_keys(old: dict, new: dict) -> list[str]:
    """Keys whose values differ between two configs, except those that cannot alter finished work."""
    a, b = flatten(old), flatten(new)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return [k for k in keys if not k.startswith(RESUMABLE_PREFIXES)]
