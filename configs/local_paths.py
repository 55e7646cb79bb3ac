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


def check_local_device(cfg: dict) -> None:
    """trainer.device=cuda (verl's default) on a machine without CUDA, when every stage runs here
    (orchestration.mode=local): refused naming the key, before a rank or an engine starts (vLLM
    would otherwise fail deep in its start-up, DeepSpeed at its first collective)."""
    if cfg["trainer"]["device"] != "cuda" or cfg["orchestration"]["mode"] != "local":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda (verl's default), but this machine has no CUDA device "
                          "(torch.cuda.is_available() is false): set trainer.device=cpu to train on the CPU "
                          "(DeepSpeed on gloo ranks, the vLLM or transformers CPU engine)")


def check_local_paths(cfg: dict) -> None:
    """Raise ConfigError naming every path of named_paths that is missing, or a device that is
    not here (check_local_device)."""
    check_local_device(cfg)
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
    check_context_length(cfg)


def check_context_length(cfg: dict) -> None:
    """The longest sequence (prompt + response, or rollout.max_model_len when set) within the
    actor's max_position_embeddings (its config.json): refused naming the keys, before vLLM
    refuses it at start-up (or the hf engine runs past its positions)."""
    import json

    path = Path(os.path.expanduser(str(cfg["actor_rollout_ref"]["model"]["path"]))) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(config, dict):
        return
    if "max_position_embeddings" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # a multimodal model's language model
    for key in ("rope_scaling", "rope_parameters"):  # a scaled RoPE (YaRN, linear, dynamic) serves
        rope = config.get(key)                       # beyond max_position_embeddings: vLLM decides
        if isinstance(rope, dict) and rope.get("factor") and rope.get("rope_type", rope.get("type")) not in (None, "default"):
            return
    positions = config.get("max_position_embeddings")
    data, rollout = cfg["data"], cfg["actor_rollout_ref"]["rollout"]
    longest, why = (data["max_prompt_length"] + data["max_response_length"],
                    f"data.max_prompt_length {data['max_prompt_length']} + data.max_response_length "
                    f"{data['max_response_length']}")
    if rollout.get("max_model_len"):
        longest, why = rollout["max_model_len"], "actor_rollout_ref.rollout.max_model_len"
    if isinstance(positions, int) and longest > positions:
        raise ConfigError(f"{why} = {longest} tokens is longer than the model's context: max_position_embeddings "
                          f"{positions} in {path}; shorten them or use a model with a longer context")
