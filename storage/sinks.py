"""Where a training run's per-step metrics go: the metric sinks that `trainer.logger` names (verl's
keys and names), registered by name in SINKS. This is the extension point: a new sink is a class
with `__init__(cfg, secret_values)`, `log(step, metrics)` and `close()` (optionally `package`, the
module it needs), registered with `@register_sink(name)`; config validation
(configs/registries.py) then accepts its name in trainer.logger, and flows/metric_sinks.py opens
it for a run. Add the name to base.yaml's enum for a sink that ships with stagerl.

- console: one short verl-style line per step (short_line: CONSOLE_KEYS, the few numbers a person
  follows a run by); the full set goes to the log at debug level (flows/metric_sinks.py), to the
  store (every stage's manifest and update/metrics.json) and to the other sinks.
- tensorboard: event files in $TENSORBOARD_DIR, else tensorboard_log/<project>/<experiment> (verl's
  folder); `tensorboard --logdir tensorboard_log` shows them.
- wandb: a Weights & Biases run named after the experiment in project trainer.project_name, with
  the resolved config (secrets scrubbed) and no system metadata (wandb's would record the command
  line, where credentials may be given as overrides) nor system metrics. Offline unless WANDB_MODE
  says otherwise: the run is a folder under ./wandb (or $WANDB_DIR) that `wandb sync <folder>`
  uploads later; its path is printed when the run ends. WANDB_MODE=online logs live (needs
  WANDB_API_KEY and a network).

The sinks live here, below configs/ and flows/, because they write files and metrics and need no
other package: configs/ reads SINKS to validate trainer.logger, flows/ opens them for a run.
"""
from __future__ import annotations

import os
from pathlib import Path

from storage.secrets import scrub

SINKS: dict = {}  # name -> sink class


def register_sink(name: str):
    """Class decorator: register a metric sink under `name` (what trainer.logger lists)."""
    def add(cls):
        SINKS[name] = cls
        return cls
    return add


def log_line(step: int, metrics: dict) -> str:
    """verl's console format: `step:k - key:value - ...`."""
    parts = [f"step:{step}"]
    for key, value in metrics.items():
        if isinstance(value, float):
            text = f"{value:.3e}" if value and abs(value) < 1e-3 else f"{value:.3f}"
        else:
            text = str(value)
        parts.append(f"{key}:{text}")
    return " - ".join(parts)


# What the console line shows of a step's metrics, in this order, when present: the score and the
# reward (the score less any KL penalty in the reward), the mean response length, the KL terms a
# run has (actor/kl_loss with use_kl_loss, actor/reward_kl_penalty with use_kl_in_reward), the
# losses, the actor's gradient norm and the step's seconds. Validation scores (val/...) are always
# shown. A metrics set with none of them (e.g. a custom stage's) is shown whole.
CONSOLE_KEYS = ("critic/score/mean", "critic/rewards/mean", "response_length/mean", "actor/kl_loss",
                "actor/reward_kl_penalty", "actor/pg_loss", "critic/vf_loss", "actor/grad_norm",
                "multi_turn/correct_tool_use", "timing_s/step",
                "timing_s/overlap")  # overlap: trainer.staleness >= 1 only; correct_tool_use: multi-turn only
CONSOLE_PREFIXES = ("val/",)


def short_line(step: int, metrics: dict) -> str:
    """The console's line: log_line of CONSOLE_KEYS (and val/ keys) only."""
    shown = {k: metrics[k] for k in CONSOLE_KEYS if k in metrics}
    shown.update({k: v for k, v in metrics.items() if k.startswith(CONSOLE_PREFIXES)})
    return log_line(step, shown or metrics)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@register_sink("console")
class ConsoleSink:
    def __init__(self, cfg: dict, secret_values=()):
        pass

    def log(self, step: int, metrics: dict) -> None:
        print(short_line(step, metrics), flush=True)

    def close(self) -> None:
        pass


@register_sink("tensorboard")
class TensorBoardSink:
    package = "tensorboard"

    def __init__(self, cfg: dict, secret_values=()):
        from torch.utils.tensorboard import SummaryWriter

        trainer = cfg["trainer"]
        self.folder = os.environ.get("TENSORBOARD_DIR") or os.path.join(
            "tensorboard_log", trainer["project_name"], trainer["experiment_name"])
        self.writer = SummaryWriter(self.folder)

    def log(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            if is_number(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        print(f"tensorboard: metrics in {self.folder} (`tensorboard --logdir {self.folder}`)", flush=True)


@register_sink("wandb")
class WandbSink:
    package = "wandb"

    def __init__(self, cfg: dict, secret_values=()):
        import wandb

        trainer = cfg["trainer"]
        mode = os.environ.get("WANDB_MODE") or "offline"
        self.run = wandb.init(project=trainer["project_name"], name=trainer["experiment_name"],
                              config=scrub(dict(cfg), secret_values), mode=mode,
                              settings=wandb.Settings(console="off", silent=True, x_disable_meta=True,
                                                      x_disable_stats=True))
        self.folder = Path(self.run.dir).parent  # wandb/offline-run-<time>-<id> (or run-… online)
        self.offline = mode in ("offline", "dryrun")

    def log(self, step: int, metrics: dict) -> None:
        self.run.log({k: v for k, v in metrics.items() if is_number(v)}, step=step)

    def close(self) -> None:
        self.run.finish()
        if self.offline:
            print(f"wandb: offline run in {self.folder}; upload it with `wandb sync {self.folder}`", flush=True)
