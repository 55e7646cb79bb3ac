"""Load a config: base.yaml, then a named config file merged on top, then dotted overrides (from
the CLI or a Prefect deployment parameter), then `${...}` interpolations; then every key is
checked against the schema. Unknown keys are refused with the closest valid key suggested."""
from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any, Iterable

import yaml

from configs.schema import CONFIG_DIR, ConfigError, load_schema

DEFAULT_CONFIG = "base"  # no --config: verl's defaults fill every key a command line leaves out
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")
_INTERP = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")

# Keys that are not verl's but appear in command lines users bring: mapped, with a warning that
# names the right key (reference/verl-command-lines.md, example A).
ALIASES = {
    "actor_rollout_ref.fsdp_config.cpu_offload": (
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
        "actor_rollout_ref.ref.fsdp_config.param_offload"),
    "actor_rollout_ref.fsdp_config.offload_params": (
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.ref.fsdp_config.param_offload"),
    "actor_rollout_ref.fsdp_config.param_offload": (
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.ref.fsdp_config.param_offload"),
    "actor_rollout_ref.fsdp_config.optimizer_offload": (
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload",),
}


class Config(dict):
    """The resolved config tree (plain nested dicts) plus the warnings met while loading."""

    def __init__(self, tree: dict, warnings: list[str], source: str, overrides: list[str]):
        super().__init__(tree)
        self.warnings = warnings
        self.source = source
        self.overrides = overrides

    def get_path(self, path: str, default: Any = None) -> Any:
        return get_path(self, path, default)


def get_path(tree: dict, path: str, default: Any = None) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _set_path(tree: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _has_path(tree: dict, path: str) -> bool:
    sentinel = object()
    return get_path(tree, path, sentinel) is not sentinel


def _del_path(tree: dict, path: str) -> None:
    parts = path.split(".")
    parent = get_path(tree, ".".join(parts[:-1])) if len(parts) > 1 else tree
    parent.pop(parts[-1], None)


def parse_value(text: str) -> Any:
    """Parse an override value as Hydra does: YAML scalars/lists, plus `1e-6` as a float."""
    if text == "":
        return ""
    if _FLOAT.match(text):
        return float(text)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, list):
        return [float(v) if isinstance(v, str) and _FLOAT.match(v) else v for v in value]
    return value


def closest_keys(path: str, n: int = 3) -> list[str]:
    """Valid keys nearest to an unknown one: same leaf name elsewhere first, then by spelling."""
    specs = load_schema().specs
    leaf = path.split(".")[-1]
    same_leaf = [p for p in specs if p.split(".")[-1] == leaf]
    near = difflib.get_close_matches(path, list(specs), n=n, cutoff=0.6)
    near_leaf = [p for p in specs if difflib.SequenceMatcher(None, p.split(".")[-1], leaf).ratio() > 0.8]
    out: list[str] = []
    for p in same_leaf + near + near_leaf:
        if p not in out:
            out.append(p)
    return out[:n]


def unknown_key_error(path: str, where: str) -> ConfigError:
    hint = closest_keys(path)
    msg = f"unknown config key '{path}' ({where})"
    if hint:
        msg += "; did you mean " + " or ".join(f"'{h}'" for h in hint) + "?"
    return ConfigError(msg + " Run `stagerl config keys` to list every key.")


def _flatten(tree: dict, prefix: str = "") -> Iterable[tuple[str, Any]]:
    schema = load_schema()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in schema.specs:
            yield from _flatten(value, path + ".")
        else:
            yield path, value


def _merge_file(tree: dict, data: dict, name: str) -> None:
    schema = load_schema()
    for path, value in _flatten(data):
        if path not in schema.specs and not schema.free_dict_prefix(path):
            raise unknown_key_error(path, f"in config file {name}")
        _set_path(tree, path, value)


VERL_DEFAULTS = ("ppo_trainer", "_self_")  # a verl config file's Hydra defaults list: verl's defaults, then the file


def hydra_file(data: dict, path: Path, warnings: list[str]) -> dict:
    """A verl config file as Hydra composes it (`--config-path/--config-name`, e.g. verl's
    examples/sglang_multiturn/config/*.yaml): `defaults: [ppo_trainer, _self_]` is base.yaml
    then the file, which is how every config file merges here; `hydra:` (search path, run folder)
    is Hydra's own and changes nothing stagerl computes. Other defaults entries are refused by name."""
    data = dict(data)
    if "hydra" in data:
        data.pop("hydra")
        warnings.append(f"config file {path.name}: `hydra:` (Hydra's own settings) ignored")
    if "defaults" in data:
        entries = [e if isinstance(e, str) else str(e) for e in (data.pop("defaults") or [])]
        if [e for e in entries if e in VERL_DEFAULTS] != [e for e in VERL_DEFAULTS if e in entries] or \
                any(e not in VERL_DEFAULTS for e in entries):
            raise ConfigError(f"config file {path.name}: defaults {entries} not supported: only verl's "
                              f"[ppo_trainer, _self_] (base.yaml, then this file's keys)")
    return data


def resolve_config_file(config: str) -> Path:
    path = Path(config)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    candidate = CONFIG_DIR / f"{config}.yaml"
    if candidate.exists():
        return candidate
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"config '{config}' not found: give a YAML path or one of {names}")


def apply_override(tree: dict, item: str, warnings: list[str]) -> None:
    schema = load_schema()
    if item.startswith("~"):
        path = item[1:].split("=", 1)[0]
        if not _has_path(tree, path):
            raise ConfigError(f"override '{item}': cannot delete '{path}', it is not in the config")
        _del_path(tree, path)
        return
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value (or +key=value, ~key)")
    key, text = item.split("=", 1)
    mode = "++" if key.startswith("++") else "+" if key.startswith("+") else ""
    path = key[len(mode):]
    value = parse_value(text)
    if path in ALIASES:
        targets = ALIASES[path]
        warnings.append(f"'{path}' is not a verl key; applied as " + ", ".join(f"{t}={text}" for t in targets))
        for target in targets:
            _set_path(tree, target, value)
        return
    known = path in schema.specs or schema.free_dict_prefix(path) is not None
    if not known:
        if schema.is_group(path):
            raise ConfigError(f"override '{item}': '{path}' is a group of keys; set its keys one by one")
        raise unknown_key_error(path, f"override '{item}'")
    present = _has_path(tree, path)
    if mode == "+" and present:
        raise ConfigError(f"override '{item}': could not append, '{path}' is already in the config; "
                          f"use '{path}={text}' (or '++{path}={text}')")
    if mode == "" and not present:
        raise ConfigError(f"override '{item}': '{path}' is not in the config; add it with '+{path}={text}'")
    _set_path(tree, path, value)


def _interpolate(tree: dict) -> None:
    def resolve(path: str, seen: tuple) -> Any:
        if path in seen:
            raise ConfigError("interpolation cycle: " + " -> ".join(seen + (path,)))
        if not _has_path(tree, path):
            raise ConfigError(f"interpolation '${{{path}}}' (in {seen[-1]}) names no key")
        value = get_path(tree, path)
        if isinstance(value, str):
            m = _INTERP.fullmatch(value)
            if m:
                value = resolve(m.group(1), seen + (path,))
                _set_path(tree, path, value)
            elif _INTERP.search(value):
                value = _INTERP.sub(lambda mm: str(resolve(mm.group(1), seen + (path,))), value)
                _set_path(tree, path, value)
        return value

    for path, _ in list(_flatten(tree)):
        resolve(path, ())


def _check_value(path: str, value: Any, warnings: list[str], raw_value: Any = None) -> Any:
    schema = load_schema()
    spec = schema.specs.get(path)
    if spec is None:
        return value  # inside a free-form dict
    if value == "" and spec.types == (bool,):
        # `key=` (a shell variable that was never set, as in some of verl's scripts): Hydra reads
        # the empty string, which verl's configs take as false
        warnings.append(f"{path}= (an empty value) is read as false, as verl reads it")
        value = False
    if value is None:
        if not spec.nullable:
            raise ConfigError(f"{path}: null is not allowed (expected {spec.type_names()})")
    else:
        if path == "trainer.logger" and isinstance(value, str):
            value = [value]  # verl accepts a single logger name
        if float in spec.types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        ok = any(isinstance(value, t) and not (t is int and isinstance(value, bool)) for t in spec.types)
        if spec.types and not ok:
            raise ConfigError(f"{path}: expected {spec.type_names()}, got {type(value).__name__} {value!r}")
        problem = spec.out_of_bounds(value)
        if problem:
            raise ConfigError(f"{path}={value!r}: {problem} ({spec.doc})")
        if path.endswith(".cpu_affinity") and not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                                      for c in value):
            raise ConfigError(f"{path}={value!r}: expected a list of CPU core numbers (integers >= 0), e.g. [0]")
        if spec.choices:
            items = value if isinstance(value, list) else [value]
            bad = [v for v in items if v not in spec.choices]
            if bad:  # the registry decides (a newly registered name is accepted); imported only here,
                # as the algorithm registries import torch (a second of start-up for every command)
                from configs.registries import REGISTRY_KEYS, registered_names

                if path in REGISTRY_KEYS:
                    choices = registered_names(path)
                    bad = [v for v in items if v not in choices]
                    if bad:
                        raise ConfigError(f"{path}: {bad[0]!r} is not one of {list(choices)} (the registered names)")
            if bad:
                raise ConfigError(f"{path}: {bad[0]!r} is not one of {list(spec.choices)}")
    if spec.fixed and value != spec.default:
        raise ConfigError(f"{path}={value!r}: stagerl does not implement this verl feature "
                          f"(only {spec.default!r} is accepted); remove the override")
    if spec.inert and raw_value != spec.default and value != spec.default:
        warnings.append(f"{path}={value!r} is accepted and ignored: it cannot change what stagerl computes")
    if spec.deprecated and value is not None:
        warnings.append(f"{path} is deprecated in verl: normalised as verl does (÷ data-parallel size); "
                        f"prefer the *_per_gpu key")
    return value


def read_config_file(path: Path) -> Any:
    """A config file's YAML; refuses binary or malformed content in one line naming the file and line."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ConfigError(f"config file {path}, line {line}: not UTF-8 text (byte {err.start}); "
                          f"is it a YAML file?") from None
    if "\x00" in text:
        line = text[:text.index("\x00")].count("\n") + 1
        raise ConfigError(f"config file {path}, line {line}: a NUL byte; is it a YAML file?")
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file {path}{where}: malformed YAML ({problem})") from None


def build_raw(config: str | None = None, overrides: Iterable[str] = ()) -> tuple[dict, list[str], str, list[str]]:
    """base.yaml + config file + overrides, before interpolation and checks."""
    tree = copy.deepcopy(load_schema().defaults)
    name = config or DEFAULT_CONFIG
    warnings: list[str] = []
    if name != "base":
        path = resolve_config_file(name)
        data = read_config_file(path)
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys")
        _merge_file(tree, hydra_file(data, path, warnings), path.name)
    overrides = [o.strip() for o in overrides if o.strip()]
    for item in overrides:
        apply_override(tree, item, warnings)
    return tree, warnings, name, overrides


def finish_config(raw: dict, warnings: list[str], name: str = "", overrides: list[str] = ()) -> Config:
    """Resolve interpolations and check every key of a raw tree (see build_raw)."""
    schema = load_schema()
    tree = copy.deepcopy(raw)
    warnings = list(warnings)
    _interpolate(tree)
    for path, value in list(_flatten(tree)):
        _set_path(tree, path, _check_value(path, value, warnings, get_path(raw, path)))
    for path in schema.specs:
        if not _has_path(tree, path) and not schema.specs[path].nullable:
            raise ConfigError(f"{path} was deleted but is required (expected {schema.specs[path].type_names()})")
    _verl_notices(tree, warnings)
    cfg = Config(tree, warnings, name, list(overrides))
    cfg.raw = raw
    return cfg


def load_config(config: str | None = None, overrides: Iterable[str] = ()) -> Config:
    """base.yaml + config file + overrides -> a checked, fully resolved Config."""
    return finish_config(*build_raw(config, overrides))


def with_override(cfg: Config, path: str, value: Any) -> Config:
    """The same config with one more key set (interpolations that follow it follow it)."""
    raw = copy.deepcopy(cfg.raw)
    _set_path(raw, path, value)
    return finish_config(raw, [], cfg.source, cfg.overrides + [f"{path}={value}"])


def _dapo_checks(tree: dict) -> None:
    """DAPO's keys (verl's recipe: dynamic sampling and the overlong buffer) fit together."""
    groups, rm = tree["algorithm"]["filter_groups"], tree["reward_model"]
    if groups["enable"]:
        if not groups["metric"]:
            raise ConfigError("algorithm.filter_groups.enable needs algorithm.filter_groups.metric (acc, score, "
                              "seq_reward or seq_final_reward): the value that must vary within a group")
        if groups["metric"] == "seq_final_reward" and tree["algorithm"]["use_kl_in_reward"]:
            raise ConfigError("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward: the "
                              "KL penalty needs reference log-probs, computed after the rollout; use seq_reward")
        if rm["enable"]:
            raise ConfigError("algorithm.filter_groups.enable with reward_model.enable: dynamic sampling scores "
                              "with the rule/custom reward only; disable one of them")
    buffer = rm["overlong_buffer"]
    if buffer["enable"]:
        if rm["reward_manager"] != "dapo":
            raise ConfigError("reward_model.overlong_buffer.enable needs reward_model.reward_manager=dapo (as verl: "
                              f"the {rm['reward_manager']} manager ignores it)")
        if not 0 < buffer["len"] <= tree["data"]["max_response_length"]:
            raise ConfigError(f"reward_model.overlong_buffer.len={buffer['len']} must be in 1..data.max_response_length "
                              f"({tree['data']['max_response_length']})")


def _verl_notices(tree: dict, warnings: list[str]) -> None:
    """verl's own driver-side notices (verl/trainer/main_ppo.py and ray_trainer.py's config checks)."""
    actor = tree["actor_rollout_ref"]["actor"]
    if tree["algorithm"]["use_kl_in_reward"] and actor["use_kl_loss"]:
        warnings.append("NOTICE: You have both enabled in-reward kl and kl loss.")
    if tree["data"].get("val_batch_size") is not None:
        warnings.append("data.val_batch_size is deprecated: validation uses the whole validation set")
    if actor["clip_ratio"] != 0.2 and actor["clip_ratio_low"] is not None and actor["clip_ratio_high"] is not None:
        warnings.append("actor.clip_ratio has no effect while clip_ratio_low and clip_ratio_high are set "
                        "(as in verl); set those two instead")
    if tree["algorithm"]["rollout_correction"]["rollout_is"] and not tree["actor_rollout_ref"]["rollout"]["calculate_log_probs"]:
        raise ConfigError("algorithm.rollout_correction.rollout_is is set but actor_rollout_ref.rollout.calculate_log_probs "
                          "is false: the correction weighs by the rollout engine's log-probs; set it true")
    _dapo_checks(tree)
    val = tree["actor_rollout_ref"]["rollout"]["val_kwargs"]
    if val["do_sample"] and not val["temperature"] > 0:
        raise ConfigError("actor_rollout_ref.rollout.val_kwargs: validation gen temperature should be "
                          "greater than 0 when enabling do_sample")
    _policy_loss_checks(actor)


def _policy_loss_checks(actor: dict) -> None:
    """What verl's policy-loss functions assert, checked where they would be called (only for the
    loss_mode that reads the key): vanilla's dual-clip c, clip_cov's and kl_cov's ratios."""
    mode, keys = actor["policy_loss"]["loss_mode"], actor["policy_loss"]
    if mode == "vanilla" and actor["clip_ratio_c"] <= 1.0:
        raise ConfigError("actor_rollout_ref.actor.clip_ratio_c: the lower bound of the clip_ratio_c for "
                          f"dual-clip PPO should be greater than 1.0, but get the value: {actor['clip_ratio_c']}")
    for key, needs in (("clip_cov_ratio", "clip_cov"), ("kl_cov_ratio", "kl_cov")):
        if mode == needs and not keys[key] > 0:
            raise ConfigError(f"actor_rollout_ref.actor.policy_loss.{key}={keys[key]!r}: must be > 0 with "
                              f"loss_mode={mode} (verl compute_policy_loss_{mode} asserts it)")
