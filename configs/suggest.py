"""Suggestions for a refused config: for each key a refusal names, the nearest values that make
the whole plan pass, found by trying them (the plan is pure arithmetic, so this is cheap)."""
from __future__ import annotations

from configs.loader import Config, get_path, with_override
from configs.plan import PlanError, compute_plan
from configs.schema import ConfigError, load_schema

MAX_TRIES = 200
NULL_CENTRE = 8  # where to start looking for a size that is not set yet


def _candidates(current, spec):
    if spec.types and bool in spec.types:
        yield (not current) if current is not None else True
        return
    if spec.nullable and current is not None and spec.deprecated:
        yield None
        return
    if int not in spec.types or (current is not None and not isinstance(current, int)):
        return
    centre = current if current is not None else NULL_CENTRE
    for delta in range(1, MAX_TRIES):
        for value in (centre - delta, centre + delta) if current is not None else (centre - delta + 1, centre + delta):
            if value >= 1:
                yield value


def working_values(cfg: Config, key: str, limit: int = 3) -> list:
    spec = load_schema().specs.get(key)
    if spec is None:
        return []
    found: list = []
    seen = set()
    for value in _candidates(get_path(cfg, key), spec):
        if value in seen:
            continue
        seen.add(value)
        try:
            compute_plan(with_override(cfg, key, value))
        except ConfigError:
            continue
        found.append(value)
        if len(found) >= limit:
            break
    return found


def make_plan(cfg: Config) -> dict:
    """compute_plan, but a refusal carries up to 3 working values for each key it names."""
    try:
        plan = compute_plan(cfg)
    except PlanError as err:
        for key in err.keys:
            values = working_values(cfg, key)
            if values:
                err.suggestions[key] = values
        raise
    plan["warnings"] = list(cfg.warnings) + plan["warnings"]
    return plan
