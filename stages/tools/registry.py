"""Which class a tool config names, and loading verl's tool config YAML.

The file is verl's (`actor_rollout_ref.rollout.multi_turn.tool_config_path`; read by
verl/tools/utils/tool_registry.py::initialize_tools_from_config):

    tools:
      - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
        config: {type: native, ...}          # passed to the tool's __init__ as it is
        tool_schema: {type: function, function: {name, description, parameters}}   # optional

`class_name` is, in this order: a name in TOOLS (the built-ins: gsm8k, calculator, python), one of
verl's built-in class paths that stagerl provides (VERL_CLASSES), or a `module.Class` (or
`module:Class`) path to your own subclass of stages.tools.base.BaseTool, imported like any module
(it must be importable in the worker processes too). verl's other built-ins (search, geo3k,
image zoom-in, MCP) and `type: mcp` are refused by name.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Mapping

import yaml

from stages.tools.base import BaseTool, ToolConfigError, check_tool_schema

# name -> "module:Class" (imported on first use): a new built-in is one line here
TOOLS: dict[str, str] = {
    "gsm8k": "stages.tools.builtin:Gsm8kTool",
    "calculator": "stages.tools.builtin:CalculatorTool",
    "python": "stages.tools.builtin:PythonTool",
}
# verl's class paths that mean a built-in here
VERL_CLASSES: dict[str, str] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "gsm8k",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "python",
}
ENTRY_KEYS = ("class_name", "config", "tool_schema")


def register_tool(name: str, target: str) -> None:
    """Add a built-in by name: TOOLS[name] = "module:Class"."""
    if TOOLS.get(name, target) != target:
        raise ValueError(f"a tool named {name!r} is already registered ({TOOLS[name]})")
    TOOLS[name] = target


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """One entry of the tool config: what the YAML says and the class it resolves to."""

    class_name: str                 # as written
    target: str                     # "module:Class" that the workers import
    config: dict
    tool_schema: dict | None
    index: int = 0

    @property
    def where(self) -> str:
        return f"tools[{self.index}] ({self.class_name})"


def resolve_class_name(class_name: str) -> str:
    """The "module:Class" a config's class_name means."""
    if not isinstance(class_name, str) or not class_name.strip():
        raise ToolConfigError("class_name must be a non-empty string")
    class_name = class_name.strip()
    if class_name in TOOLS:
        return TOOLS[class_name]
    if class_name in VERL_CLASSES:
        return TOOLS[VERL_CLASSES[class_name]]
    if class_name.startswith("verl."):
        raise ToolConfigError(
            f"{class_name} is a verl tool stagerl does not provide (built in: {sorted(TOOLS)}, and verl's "
            f"{sorted(VERL_CLASSES)}); write a subclass of stages.tools.base.BaseTool and name it by its "
            "module.Class path")
    module, sep, name = class_name.rpartition(":") if ":" in class_name else class_name.rpartition(".")
    if not sep or not module or not name:
        raise ToolConfigError(f"class_name {class_name!r} is neither a built-in ({sorted(TOOLS)}) nor a "
                              "module.Class path")
    return f"{module}:{name}"


def load_tool_class(target: str) -> type[BaseTool]:
    """Import "module:Class" and check it is a BaseTool."""
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module: say which and why
        raise ToolConfigError(f"could not import {module_name}: {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ToolConfigError(f"{module_name} has no {class_name}")
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise ToolConfigError(f"{module_name}.{class_name} is not a subclass of stages.tools.base.BaseTool "
                              "(a verl tool: import BaseTool and ToolResponse from stages.tools.base instead)")
    return cls


def read_tool_config(source: "str | os.PathLike | Mapping") -> list[ToolSpec]:
    """The entries of a tool config (a YAML path, or the mapping it holds), checked and resolved."""
    if isinstance(source, Mapping):
        data, origin = source, "tool config"
    else:
        origin = os.fspath(source)
        try:
            with open(origin) as f:
                data = yaml.safe_load(f)
        except OSError as exc:
            raise ToolConfigError(f"cannot read the tool config {origin}: {exc}") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("tools"), list):
        raise ToolConfigError(f"{origin}: a tool config is a mapping with a `tools:` list")
    specs = []
    for index, entry in enumerate(data["tools"]):
        where = f"{origin}: tools[{index}]"
        if not isinstance(entry, Mapping):
            raise ToolConfigError(f"{where} must be a mapping with class_name, config, tool_schema")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise ToolConfigError(f"{where}: unknown key(s) {unknown} (a tool entry has {list(ENTRY_KEYS)}"
                                  + ("; MCP tools are not supported" if "mcp" in unknown else "") + ")")
        config = entry.get("config") or {}
        if not isinstance(config, Mapping):
            raise ToolConfigError(f"{where}.config must be a mapping")
        kind = config.get("type", "native")
        if kind != "native":
            raise ToolConfigError(f"{where}.config.type {kind!r} is not supported (only native tools; "
                                  "verl's MCP tools are not provided)")
        schema = entry.get("tool_schema")
        try:
            target = resolve_class_name(entry.get("class_name"))
            if schema is not None:
                schema = dict(check_tool_schema(schema, "tool_schema"))
        except ToolConfigError as exc:
            raise ToolConfigError(f"{where}: {exc}") from None
        specs.append(ToolSpec(class_name=str(entry["class_name"]).strip(), target=target,
                              config=_plain(config), tool_schema=schema, index=index))
    return specs


def build_tool(spec: ToolSpec) -> BaseTool:
    """The tool object for one entry: its class built from the entry's config and schema."""
    cls = load_tool_class(spec.target)
    try:
        return cls(dict(spec.config), spec.tool_schema)
    except ToolConfigError as exc:
        raise ToolConfigError(f"{spec.where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the tool's own constructor
        raise ToolConfigError(f"{spec.where}: {type(exc).__name__}: {exc}") from exc


def build_tools(specs: list[ToolSpec]) -> dict[str, BaseTool]:
    """Every entry's tool by its schema's name; two tools with one name are refused."""
    tools: dict[str, BaseTool] = {}
    for spec in specs:
        tool = build_tool(spec)
        if tool.name in tools:
            raise ToolConfigError(f"{spec.where}: a second tool named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
