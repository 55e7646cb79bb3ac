"""Where a training run's per-step metrics go: `trainer.logger`, a list of sink names (verl's
keys and names). One class per sink, registered by name in SINKS; a new sink is a class with
log(step, metrics) and close() added there (and its name in base.yaml's enum).

- console: one verl-style line per step (flows.step_report.log_line).
- tensorboard: event files in $TENSORBOARD_DIR, else tensorboard_log/<project>/<experiment> (verl's
  folder); `tensorboard --logdir tensorboard_log` shows them.
- wandb: a Weights & Biases run named after the experiment in project trainer.project_name, with
  the resolved config (secrets scrubbed) and no system metadata (wandb's would record the command
  line, where credentials may be given as overrides) nor system metrics. Offline unless WANDB_MODE says otherwise: the run is a
  folder under ./wandb (or $WANDB_DIR) that `wandb sync <folder>` uploads later; its path is
  printed when the run ends. WANDB_MODE=online logs live (needs WANDB_API_KEY and a network).

tensorboard and wandb are dependencies of stagerl; a run naming a sink whose package is missing
(an environment built without them) is refused before it starts, naming trainer.logger.
Every stage's numbers are in the store whatever the sinks (`stagerl query`, `stagerl plot`).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from configs.schema import ConfigError
from flows.step_report import log_line
from storage.secrets import scrub


class ConsoleSink:
    def __init__(self, cfg: dict, secret_values=()):
        pass

    def log(self, step: int, metrics: dict) -> None:
        print(log_line(step, metrics), flush=True)

    def close(self) -> None:
        pass


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
            if _is_number(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        print(f"tensorboard: metrics in {self.folder} (`tensorboard --logdir {self.folder}`)", flush=True)


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
        self.run.log({k: v for k, v in metrics.items() if _is_number(v)}, step=step)

    def close(self) -> None:
        self.run.finish()
        if self.offline:
            print(f"wandb: offline run in {self.folder}; upload it with `wandb sync {self.folder}`", flush=True)


SINKS = {"console": ConsoleSink, "tensorboard": TensorBoardSink, "wandb": WandbSink}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sink_names(cfg: dict) -> list[str]:
    names = cfg["trainer"]["logger"]
    return [names] if isinstance(names, str) else list(names or [])


def check_sinks(cfg: dict) -> None:
    """Refuse (ConfigError naming trainer.logger) a sink that is unknown or not installed."""
    for name in sink_names(cfg):
        sink = SINKS.get(name)
        if sink is None:
            raise ConfigError(f"trainer.logger: {name!r} is not one of {list(SINKS)}")
        package = getattr(sink, "package", None)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"trainer.logger has {name} but the {package} package is not installed: "
                              f"`pip install {package}`, "
                              f"or remove it from trainer.logger")


class MetricSinks:
    """The run's sinks (trainer.logger, in order); log() sends a step's metrics to each."""

    def __init__(self, cfg: dict, secret_values=()):
        check_sinks(cfg)
        self.names = sink_names(cfg)
        self.sinks = []
        try:
            for name in self.names:
                self.sinks.append(SINKS[name](cfg, secret_values))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: dict) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
