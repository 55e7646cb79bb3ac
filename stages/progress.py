"""Progress bars for generation, log-prob and update (tqdm), and verl's console metrics line.

    with progress("generate", total=len(prompts), unit="seq") as bar:
        ...; bar.update(n)
    print(format_step_line(3, {"critic/score/mean": 0.5}))  # step:3 - critic/score/mean:0.5

Bars go to stderr and are off when stderr is not a terminal or STAGERL_PROGRESS=0 (so logs and
tests stay clean); STAGERL_PROGRESS=1 forces them on."""
from __future__ import annotations

import numbers
import os
import pprint
import sys

__all__ = ["progress", "progress_enabled", "format_step_line"]


def progress_enabled() -> bool:
    flag = os.environ.get("STAGERL_PROGRESS")
    if flag is not None:
        return flag.strip().lower() not in ("0", "false", "no", "")
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def progress(desc: str, total: int | None = None, unit: str = "it", rank: int = 0, **kwargs):
    """A tqdm bar (a no-op bar when disabled or on a rank other than 0)."""
    from tqdm.auto import tqdm

    disable = kwargs.pop("disable", None)
    if disable is None:
        disable = rank != 0 or not progress_enabled()
    return tqdm(total=total, desc=desc, unit=unit, disable=disable, file=sys.stderr,
                dynamic_ncols=True, leave=False, **kwargs)


def _plain(v):
    """numpy / torch scalars -> Python numbers (so pformat prints 0.5, not np.float32(0.5))."""
    if hasattr(v, "item") and callable(v.item):
        try:
            return v.item()
        except (ValueError, RuntimeError):
            return v
    return v


def format_step_line(step: int, metrics: dict) -> str:
    """verl's console logger line (verl/utils/logger/aggregate_logger.py::concat_dict_to_str):
    `step:{step}` then ` - {key}:{value}` for every numeric metric, in the dict's order."""
    parts = [f"step:{step}"]
    for key, value in metrics.items():
        value = _plain(value)
        if isinstance(value, numbers.Number):
            parts.append(f"{key}:{pprint.pformat(value)}")
    return " - ".join(parts)
