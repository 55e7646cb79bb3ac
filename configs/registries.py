"""The extension points a config key names: for each such key, the registry that defines its
accepted values. Adding an estimator, a policy loss, a rollout engine, a KL kind or a metric sink
is one entry in its registry (docs/architecture.md); the config then accepts its name without any
change here.

base.yaml's `{a|b|...}` list beside each key documents the same names (tests/test_architecture.py
keeps the two equal) and is the fast path: a listed value is accepted without importing anything;
any other value is checked against the live registry, imported by name only then (the algorithm
and engine registries live in stages/, which configs/ does not import at module level; the metric
sinks live in storage/sinks.py).
"""
from __future__ import annotations

import importlib

REGISTRY_KEYS = {
    "algorithm.adv_estimator": ("stages.advantages", "ADV_ESTIMATORS"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": ("stages.losses", "POLICY_LOSSES"),
    "actor_rollout_ref.rollout.name": ("stages.engines", "ENGINES"),
    "algorithm.kl_penalty": ("stages.kl", "KL_KINDS"),
    "trainer.logger": ("storage.sinks", "SINKS"),
}


def registered_names(path: str) -> tuple:
    """The names registered for config key `path` (a key without a registry: KeyError)."""
    module, attr = REGISTRY_KEYS[path]
    return tuple(getattr(importlib.import_module(module), attr))
