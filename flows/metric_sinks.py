"""The metric sinks of one training run: `trainer.logger`, a list of sink names (verl's keys and
names), each opened from the registry in storage/sinks.py (console, tensorboard, wandb, and any
sink registered there with @register_sink; what each writes is described there).

tensorboard and wandb are dependencies of stagerl; a run naming a sink whose package is missing
(an environment built without them) is refused before it starts, naming trainer.logger.
Every stage's numbers are in the store whatever the sinks (`stagerl query`, `stagerl plot`).
The console sink prints a short line per step (storage.sinks.short_line); every step's full set
is logged at debug level (`PREFECT_LOGGING_LEVEL=DEBUG` shows it in the console and the flow
run's log in Prefect).
"""
from __future__ import annotations

import importlib.util

from configs.schema import ConfigError
from storage.sinks import SINKS, log_line


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
        import logging

        from flows.step import logger

        log = logger()
        if log.isEnabledFor(logging.DEBUG):  # the full set (the console shows a short line), built only if shown
            log.debug(log_line(step, metrics))
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
