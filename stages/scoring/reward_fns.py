"""Load reward functions (verl's custom_reward_function) and score rows safely in worker processes.

A reward function has verl's signature `compute_score(data_source, solution_str, ground_truth,
extra_info)` and returns a number or a dict with "score" (an "acc" key fills the acc column; other
keys are kept as extras). `stages.scoring.pool.score_batch` runs it in spawned worker processes with a per-row timeout
(stages.scoring.pool.ScorerPool; a training run keeps one pool alive across steps): a row whose
function raises, returns something unusable or runs too long scores 0 with the reason in its
`error` field (the hung worker is killed and replaced), unless `strict` makes it fatal.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import stat
import sys
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from collections.abc import Mapping
from typing import Any, Callable

from stages.scoring.scorers import default_compute_score

DEFAULT_FN_NAME = "compute_score"


class RewardFunctionNotFound(LookupError):
    """custom_reward_function.path or .name does not point at a callable."""


class RewardScoringError(RuntimeError):
    """A row failed to score under strict mode, or the workers could not start."""


@dataclass(frozen=True)
class RewardFnSpec:
    """Which reward function to use: verl's custom_reward_function.{path, name, reward_kwargs}.
    No path means the built-in rule scorers (stages.scoring.scorers.default_compute_score)."""
    path: str | None = None
    name: str = DEFAULT_FN_NAME
    reward_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: "RewardFnSpec | Mapping | None") -> "RewardFnSpec":
        if isinstance(config, cls):
            return config
        config = dict(config or {})
        return cls(path=config.get("path") or None, name=config.get("name") or DEFAULT_FN_NAME,
                   reward_kwargs=dict(config.get("reward_kwargs") or {}))


def load_reward_fn(spec: "RewardFnSpec | Mapping | None") -> Callable[..., Any]:
    """The scoring callable for a spec; raises RewardFunctionNotFound naming path and name."""
    spec = RewardFnSpec.from_config(spec)
    if spec.path is None:
        fn = default_compute_score
    else:
        path = os.path.abspath(os.path.expanduser(spec.path))
        if not os.path.isfile(path):
            raise RewardFunctionNotFound(
                f"custom_reward_function.path {spec.path!r} does not exist (looked for {path})")
        module = _import_file(path)
        fn = getattr(module, spec.name, None)
        if not callable(fn):
            available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise RewardFunctionNotFound(
                f"reward function {spec.name!r} not found in custom_reward_function.path {path!r} "
                f"(callables there: {', '.join(available) or 'none'})")
    return partial(fn, **spec.reward_kwargs) if spec.reward_kwargs else fn


_IMPORTED: dict = {}  # path -> (sha256 of the file's bytes, its module): imported again when it changes


_DIGESTS: dict = {}  # path -> (the file's stat when it was read, its sha256)
RACY_S = 2.0  # a file changed this recently is read again: an edit within its clock tick keeps mtime


def reward_file_sha256(path: str | None) -> str | None:
    """SHA-256 of a reward file's content; None when there is no such file. What the reward
    stage's fingerprint, the scorer pool's restart and the import below key on. Read again only
    when the file's stat changed (inode, size, mtime and ctime in ns; ctime moves with any write
    and cannot be set back) or it was changed less than RACY_S before it was last read (git's
    "racily clean" rule): the reward stage asks three times a step."""
    try:
        st = os.stat(path) if path is not None else None
    except OSError:
        return None
    if st is None or not stat.S_ISREG(st.st_mode):
        return None
    sig = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    known = _DIGESTS.get(path)
    if known is not None and known[0] == sig:
        return known[1]
    read_at = time.time()
    with open(path, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    if read_at - max(st.st_mtime_ns, st.st_ctime_ns) / 1e9 > RACY_S:
        _DIGESTS[path] = (sig, digest)
    return digest


def _import_file(path: str):
    """The module of a reward file, imported once per content (an edit between steps is used)."""
    digest = reward_file_sha256(path)
    known = _IMPORTED.get(path)
    if known is not None and known[0] == digest:
        return known[1]
    module_name = "stagerl_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardFunctionNotFound(f"custom_reward_function.path {path!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # as verl does; dataclasses and pickling need it
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise RewardFunctionNotFound(
            f"custom_reward_function.path {path!r} failed to import: {describe_error(exc)}") from exc
    _IMPORTED[path] = (digest, module)
    return module


def describe_error(exc: BaseException) -> str:
    """'Type: message (at file:line)' for the innermost frame of the exception."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    from storage.secrets import env_secret_values, scrub_text

    return scrub_text(f"{type(exc).__name__}: {exc}{where}", env_secret_values())  # no AWS_* values


def _failed(error: str) -> dict:
    return {"score": 0.0, "acc": None, "extras": {}, "error": error}


def normalise_result(result: Any) -> dict:
    """A reward function's return value as {score, acc, extras, error}."""
    if type(result) is float or type(result) is int:  # the common case, without the checks below
        if math.isfinite(result):
            return {"score": float(result), "acc": None, "extras": {}, "error": None}
    extras: dict = {}
    acc = None
    if type(result) is dict or isinstance(result, Mapping):  # (a dict without the ABC check)
        if "score" not in result:
            return _failed(f"reward function returned a dict without 'score' (keys: {sorted(result)})")
        extras = {k: v for k, v in result.items() if k not in ("score", "acc")}
        acc = None if result.get("acc") is None else bool(result["acc"])
        result = result["score"]
    try:
        score = float(result)
    except (TypeError, ValueError):
        return _failed(f"reward function returned {type(result).__name__} {result!r:.80}, "
                       "expected a number or a dict with 'score'")
    if not math.isfinite(score):
        return _failed(f"reward function returned a non-finite score {score}")
    return {"score": score, "acc": acc, "extras": extras, "error": None}


def score_row(fn: Callable[..., Any], row: Mapping) -> dict:
    """Score one row in this process; exceptions become the row's error."""
    try:
        result = fn(row["data_source"], row["solution_str"], row["ground_truth"], row.get("extra_info"))
    except (Exception, SystemExit) as exc:
        return _failed(describe_error(exc))
    return normalise_result(result)
