"""The decorator behind registries keyed by several names at once (store backends by URL scheme,
reward scorers by data_source): each name maps to the decorated object, and a name already taken
by another object is refused, naming both."""
from __future__ import annotations

from typing import Callable


def register_in(registry: dict, names: tuple, what: str) -> Callable:
    """Decorator: registry[name] = the decorated object for every name in `names`."""
    def register(obj):
        for name in names:
            if registry.get(name, obj) is not obj:
                raise ValueError(f"a {what} for {name!r} is already registered ({registry[name].__name__})")
            registry[name] = obj
        return obj

    return register
