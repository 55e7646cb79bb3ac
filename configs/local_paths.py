"""The local files and folders a config names, checked before anything loads or starts.

Relative paths are taken from the working directory, as verl and Hugging Face take them. A path
that is not there is refused with a ConfigError naming the key, the value and the absolute path
looked for (Hugging Face would otherwise read a missing relative folder as a hub repo id and fail
with "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"). `stagerl plan` does not
check them: a plan may be made on another machine than the run."""
from __future__ import annotations

import os
from pathlib import Path

from configs.plan import uses_critic
from configs.schema import ConfigError


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def named_paths(cfg: dict) -> list[tuple[str, str, str]]:
    """(key, value, "folder"|"file") of every local path this config's run reads."""
    data, trainer = cfg["data"], cfg["trainer"]
    out = [("actor_rollout_ref.model.path", cfg["actor_rollout_ref"]["model"]["path"], "folder")]
    out += [("data.train_files", f, "file") for f in _as_list(data["train_files"])]
    if trainer["val_before_train"] or trainer["test_freq"] > 0:
        out += [("data.val_files", f, "file") for f in _as_list(data["val_files"])]
    if uses_critic(cfg):
        out.append(("critic.model.path", cfg["critic"]["model"]["path"], "folder"))
    if cfg["reward_model"].get("enable"):
        out.append(("reward_model.model.path", cfg["reward_model"]["model"]["path"], "folder"))
    if cfg["custom_reward_function"].get("path"):
        out.append(("custom_reward_function.path", cfg["custom_reward_function"]["path"], "file"))
    return [(k, str(v), kind) for k, v, kind in out if v is not None and "://" not in str(v)]


def _not_parquet(path: Path) -> str | None:
    """None when the file has parquet's footer and schema; else why not (pyarrow reads the footer only)."""
    import pyarrow.parquet as pq

    try:
        pq.read_schema(path)
    except Exception as exc:  # noqa: BLE001 - ArrowInvalid and friends: the message says it
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


def check_local_paths(cfg: dict) -> None:
    """Raise ConfigError naming every path of named_paths that is missing."""
    cwd = os.getcwd()
    problems = []
    for key, value, kind in named_paths(cfg):
        path = Path(os.path.expanduser(value))
        found = path.is_dir() if kind == "folder" else path.is_file()
        if found and key in ("data.train_files", "data.val_files"):
            problem = _not_parquet(path)
            if problem:
                problems.append(f"{key}: {value} is not a parquet file ({problem}); datasets are parquet "
                                f"in verl's RL schema (`stagerl data` makes them)")
            continue
        if not found:
            where = path if path.is_absolute() else Path(cwd) / path
            problems.append(f"{key}: {value} is not a {kind} (looked for {where.resolve()}"
                            + ("" if path.is_absolute() else f"; relative paths start at the working "
                               f"directory {cwd}") + ")")
    if problems:
        raise ConfigError("; ".join(problems) + ". Give existing local paths (a model folder can be "
                          "made with `stagerl model tiny --out DIR`), or run from the folder they are "
                          "relative to")
