"""A rerun of an experiment that has finished work: its config against the one run.json holds.

- The same config, or one that differs only in keys that cannot alter finished work
  (configs/changes.py RESUMABLE_PREFIXES): a resume at the first incomplete stage.
- A changed trainer.total_training_steps or trainer.total_epochs (nothing else) extends (or
  shortens) the run: it continues after its last complete step. Finished work stays complete, since
  the total reaches a stage only through a learning-rate schedule that depends on it (the update's
  fingerprint holds the total only then, stages/update.py) and the data order does not depend on
  it (each step's batch is a function of the step). Where a schedule does depend on it (cosine, a
  warm-up given as a ratio) and an update is finished, the change is refused naming the key: the
  finished updates' learning rates would differ from a run started with the new total.
- A total at or below the steps done changes nothing: the run already has that many steps.
- Any other changed key is refused, listing the keys with both values.

Imports no Prefect: `stagerl train` checks this before it starts a Prefect server (a refusal
exits 2, nothing to run exits 0), and the rl-train flow checks it again under the run's lock."""
from __future__ import annotations

from configs.changes import changed_keys, flatten
from configs.schema import ConfigError
from stages.training.state import schedule_keys
from storage.artifacts import last_committed, read_run_json
from storage.layout import RunLayout
from storage.store import Store

TOTAL_KEYS = ("trainer.total_training_steps", "trainer.total_epochs")


class RunConfigChanged(ConfigError):
    """The experiment exists with finished work and the new config would alter it."""


def has_finished_work(store: Store, layout: RunLayout) -> bool:
    return bool(store.find(layout.steps_dir)) or bool(store.list(layout.weights_dir))


def run_total(cfg: dict, steps_per_epoch: int | None) -> int | None:
    """trainer.total_training_steps, else total_epochs x steps per epoch (as verl); None when the
    steps per epoch are not known."""
    explicit = cfg["trainer"].get("total_training_steps")
    if explicit:
        return int(explicit)
    return int(cfg["trainer"]["total_epochs"]) * steps_per_epoch if steps_per_epoch else None


def check_rerun(store: Store, layout: RunLayout, cfg: dict, total: int | None = None) -> str | None:
    """Raise RunConfigChanged when `cfg` would alter the experiment's finished work; return a
    message when there is nothing to run (the total is at or below the steps done, and changed);
    else None (a new run, a resume, or an extension). `total`: the run's total steps with this
    config (None: from the config, with run.json's steps per epoch for an epoch count; when that
    is not known either, a changed total is left to the flow's check)."""
    from storage.secrets import scrub

    old = read_run_json(store, layout)
    if old is None or not has_finished_work(store, layout):
        return None
    before, clean = old.get("config") or {}, scrub(dict(cfg), store.secret_values)
    keys = changed_keys(before, clean)
    a, b = flatten(before), flatten(clean)
    shown = lambda ks: "; ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in ks[:12])
    if any(k not in TOTAL_KEYS for k in keys):
        raise RunConfigChanged(
            f"experiment {layout.base} already has finished work and the config changed in "
            f"{len(keys)} key(s) that would alter it: {shown(keys)}. Run with the original config to "
            f"resume, or choose a new trainer.experiment_name (experiment_name=...) to start a "
            f"new run")
    if not keys:
        return None
    total = total if total is not None else run_total(cfg, old.get("steps_per_epoch"))
    if total is None:
        return None
    done = last_committed(store, layout, "update")
    old_total = old.get("total_training_steps") or run_total(before, old.get("steps_per_epoch"))
    if total == old_total:  # e.g. total_epochs changed beside an explicit total_training_steps
        return None
    if total <= done:
        return (f"experiment {layout.base} already has {done} steps ({shown(keys)}): nothing to run, "
                f"nothing changed")
    schedules = schedule_keys(clean) if done else []
    if schedules:
        how = "; ".join(_independent(key, b, old_total) for key in schedules)
        raise RunConfigChanged(
            f"experiment {layout.base} cannot be extended ({shown(keys)}): its learning-rate schedule "
            f"depends on the total steps ({', '.join(f'{k}={b.get(k)!r}' for k in schedules)}), so "
            f"its {done} finished step(s) would have trained at other learning rates than a run "
            f"started with the new total. Run with the original total to resume, or start a new "
            f"experiment (experiment_name=...) with the new total; a schedule that does not depend "
            f"on the total can be extended later: {how}")
    return None


def _independent(key: str, flat: dict, old_total) -> str:
    """How to make the schedule at `key` independent of the total."""
    section = key.rsplit(".", 1)[0]
    if key.endswith(".lr_warmup_steps_ratio"):
        ratio = flat.get(key) or 0.0
        steps = f"{int(ratio * old_total)} (what the ratio gave over {old_total} steps)" if old_total else "N"
        return f"{section}.lr_warmup_steps={steps} instead of {key}"
    return f"{section}.warmup_style=constant (with {section}.lr_warmup_steps for a warm-up)"
