"""The config schema, read from configs/base.yaml: every key's default, type, accepted values,
flags and one-line doc come from that file (its header explains the comment tags), so a key is
documented exactly once."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parent
BASE_YAML = CONFIG_DIR / "base.yaml"

_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_]+):(?P<rest>.*)$")
_TAG = re.compile(r"^\s*(\[[^\]]*\]|\{[^}]*\}|<[^>]*>)")
_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "list": list, "dict": dict}


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key (or file) and what to do."""


@dataclass(frozen=True)
class KeySpec:
    path: str
    default: Any
    types: tuple = ()          # allowed Python types (empty: any)
    nullable: bool = False
    choices: tuple = ()        # accepted values (for lists: accepted elements)
    inert: bool = False        # accepted, cannot change results
    fixed: bool = False        # only the default is implemented
    deprecated: bool = False   # verl's deprecated global size
    doc: str = ""
    free_dict: bool = False    # a dict whose content is free-form (subkeys may be added)
    bound: tuple = ()          # ("min", n): value >= n; ("above", n): value > n (null is not checked)

    def out_of_bounds(self, value) -> str | None:
        """Why `value` is below this key's bound (<min n> / <above n> in base.yaml), or None."""
        if not self.bound or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        kind, limit = self.bound
        shown = int(limit) if limit == int(limit) else limit
        if kind == "min" and value < limit:
            return f"must be >= {shown}"
        if kind == "above" and value <= limit:
            return f"must be > {shown}"
        return None

    def type_names(self) -> str:
        names = [t.__name__ for t in self.types] + (["null"] if self.nullable else [])
        return " or ".join(names) or "any"


@dataclass
class Schema:
    specs: dict = field(default_factory=dict)   # dotted path -> KeySpec (leaves only)
    defaults: dict = field(default_factory=dict)  # the nested default tree

    def free_dict_prefix(self, path: str):
        """The free-form dict key that contains `path`, if any (e.g. apply_chat_template_kwargs)."""
        parts = path.split(".")
        for i in range(len(parts) - 1, 0, -1):
            spec = self.specs.get(".".join(parts[:i]))
            if spec is not None and spec.free_dict:
                return spec
        return None

    def is_group(self, path: str) -> bool:
        prefix = path + "."
        return any(p.startswith(prefix) for p in self.specs)


def _split_comment(rest: str) -> tuple[str, str]:
    idx = rest.find(" #")
    if idx < 0:
        return rest.strip(), ""
    return rest[:idx].strip(), rest[idx + 2:].strip()


def _parse_tags(comment: str) -> tuple[dict, str]:
    tags: dict = {}
    while True:
        m = _TAG.match(comment)
        if not m:
            break
        tok = m.group(1)
        comment = comment[m.end():]
        body = tok[1:-1].strip()
        if tok[0] == "[":
            tags["type"] = body
        elif tok[0] == "{":
            tags["choices"] = tuple(yaml.safe_load(v.strip()) for v in body.split("|"))
        elif body.split()[0] in ("min", "above"):
            kind, number = body.split()
            tags["bound"] = (kind, float(number))
        else:
            tags[body.split(":")[0].strip()] = True
    return tags, comment.strip()


def _spec_for(path: str, default: Any, comment: str) -> KeySpec:
    tags, doc = _parse_tags(comment)
    nullable = False
    if "type" in tags:
        names = []
        for name in tags["type"].split("|"):
            name = name.strip()
            if name.endswith("?"):
                nullable, name = True, name[:-1]
            if name == "null":
                nullable = True
                continue
            if name not in _TYPES:
                raise ConfigError(f"base.yaml: unknown type tag '{name}' on {path}")
            names.append(name)
        types = tuple(_TYPES[n] for n in names)
    elif default is None:
        raise ConfigError(f"base.yaml: {path} defaults to null and needs a type tag like [int?]")
    else:
        types = (type(default),)
    if default is None:
        nullable = True
    return KeySpec(
        path=path, default=default, types=types, nullable=nullable,
        choices=tags.get("choices", ()), inert="inert" in tags, fixed="fixed" in tags,
        deprecated="deprecated" in tags, doc=doc,
        free_dict=(types == (dict,)), bound=tags.get("bound", ()),
    )


def parse_schema_text(text: str) -> Schema:
    defaults = yaml.safe_load(text) or {}
    schema = Schema(defaults=defaults)
    stack: list[tuple[int, str]] = []  # (indent, key)
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _KEY_LINE.match(line)
        if not m:
            continue
        indent = len(m.group("indent"))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group("key")))
        path = ".".join(k for _, k in stack)
        value, comment = _split_comment(m.group("rest"))
        if value == "":
            continue  # a group: its keys follow
        node: Any = defaults
        for part in path.split("."):
            node = node[part]
        schema.specs[path] = _spec_for(path, node, comment)
    return schema


@lru_cache(maxsize=1)
def load_schema() -> Schema:
    return parse_schema_text(BASE_YAML.read_text())


def config_reference() -> str:
    """A markdown table of every key, its default and its doc (for the README)."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for path, spec in load_schema().specs.items():
        flag = " (inert)" if spec.inert else " (fixed)" if spec.fixed else ""
        rows.append(f"| `{path}` | `{spec.default!r}` | {spec.doc}{flag} |")
    return "\n".join(rows)
