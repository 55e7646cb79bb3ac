"""The index of stagerl's extension points: every registry, where it lives, and the config key that
names its entries. Adding an estimator, a policy loss, a rollout engine, a KL kind, a metric sink, a
reward scorer or a store backend is one entry in its registry (docs/architecture.md); the config
then accepts its name without any change here.

base.yaml's `{a|b|...}` list beside each key documents the same names (tests/test_architecture.py
keeps the two equal) and is the fast path: a listed value is accepted without consulting the
registry. The algorithm registries (stages/algos/, a leaf of pure torch) and the storage ones are
imported here; the engines and the scorers live higher up in stages/, so they are named by module
and read only when a value is not in the documented list.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple

from stages.algos.advantages import ADV_ESTIMATORS
from stages.algos.kl import KL_KINDS
from stages.algos.policy_losses import POLICY_LOSSES
from storage.backends import BACKENDS
from storage.sinks import SINKS



class Named(NamedTuple):
    """A registry named by module and attribute, imported on first use."""
    module: str
    attr: str


# config key -> its registry: a dict or tuple of names, or a Named one
REGISTRY_KEYS = {
    "algorithm.adv_estimator": ADV_ESTIMATORS,
    "actor_rollout_ref.actor.policy_loss.loss_mode": POLICY_LOSSES,
    "actor_rollout_ref.rollout.name": Named("stages.engines", "ENGINES"),
    "algorithm.kl_penalty": KL_KINDS,
    "trainer.logger": SINKS,
}
# registries whose names are not a config value: what each is keyed by and where it lives
OTHER_REGISTRIES = {
    "reward scorers (by the rows' data_source)": Named("stages.scoring.scorers", "SCORERS"),
    "store backends (by the URL scheme of storage.root)": BACKENDS,
}


def _read(registry) -> tuple:
    if isinstance(registry, Named):
        registry = getattr(importlib.import_module(registry.module), registry.attr)
    return tuple(registry)


def registered_names(path: str) -> tuple:
    """The names registered for config key `path` (a key without a registry: KeyError)."""
    return _read(REGISTRY_KEYS[path])


def other_registered_names(what: str) -> tuple:
    """The names in one of OTHER_REGISTRIES (e.g. the data sources with a rule scorer)."""
    return _read(OTHER_REGISTRIES[what])
