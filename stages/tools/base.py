"""The tool interface: verl's `BaseTool` life cycle (verl/tools/base_tool.py) and its schemas.

A tool is one class, built once per worker process from the YAML's `config` and `tool_schema`;
a rollout creates an instance per trajectory (`create`), calls it (`execute`: response, step
reward, metrics), reads its reward (`calc_reward`) and releases it (`release`). As in verl every
method may be `async def`; stagerl's workers run a coroutine to completion, so plain methods work
too. The schema is the OpenAI function-tool dict from the YAML; `ToolSchema` reads it both as a
dict and by attribute (`schema.function.name`, `schema.model_dump()`), so code written against
verl's pydantic schema keeps working.
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Mapping

# What went wrong with a call, as counted by the ToolSet (None: it answered).
ERROR_KINDS = ("bad_json", "unknown_tool", "timeout", "exception", "sandbox")


class ToolConfigError(ValueError):
    """A tool config (YAML) that cannot be honoured: raised when the tools are loaded."""


class ToolSchema(dict):
    """An OpenAI-style schema dict that also reads by attribute, like verl's pydantic models."""

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return ToolSchema(value) if isinstance(value, dict) and not isinstance(value, ToolSchema) else value

    def model_dump(self, **_ignored) -> dict:
        """A plain deep copy (verl: `tool_schema.model_dump(exclude_unset=True, exclude_none=True)`)."""
        return _plain(self)


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def check_tool_schema(schema: Any, where: str = "tool_schema") -> ToolSchema:
    """Validate an OpenAI function-tool schema the way verl's OpenAIFunctionToolSchema does
    (type, function.name, function.description required; parameters default to an empty object)."""
    if not isinstance(schema, Mapping):
        raise ToolConfigError(f"{where} must be a mapping, got {type(schema).__name__}")
    schema = _plain(dict(schema))
    if not isinstance(schema.get("type"), str):
        raise ToolConfigError(f"{where}.type is required (\"function\")")
    function = schema.get("function")
    if not isinstance(function, dict):
        raise ToolConfigError(f"{where}.function is required (name, description, parameters)")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolConfigError(f"{where}.function.name is required")
    if not isinstance(function.get("description"), str):
        raise ToolConfigError(f"{where}.function.description is required (verl's schema requires it)")
    parameters = function.setdefault("parameters", {"type": "object", "properties": {}, "required": []})
    if not isinstance(parameters, dict) or not isinstance(parameters.get("type"), str) \
            or not isinstance(parameters.get("properties", {}), dict) \
            or not isinstance(parameters.get("required", []), list):
        raise ToolConfigError(f"{where}.function.parameters must be {{type, properties: mapping, required: list}}")
    for name, prop in parameters.get("properties", {}).items():
        if not isinstance(prop, dict) or not isinstance(prop.get("type"), str):
            raise ToolConfigError(f"{where}.function.parameters.properties.{name} needs a type")
    return ToolSchema(schema)


@dataclasses.dataclass
class ToolResponse:
    """What a tool returns to the model (verl's ToolResponse: text, and images/videos as lists)."""

    text: str | None = None
    image: list | None = None
    video: list | None = None

    def __post_init__(self):
        for name in ("image", "video"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, list):
                raise ValueError(f"ToolResponse.{name} must be a list (wrap a single one: [{name}])")

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video


class BaseTool:
    """verl's BaseTool: subclass it and override what your tool does.

    `__init__(config, tool_schema)`: `config` is the YAML's `config` mapping (with `type`),
    `tool_schema` the YAML's schema (a ToolSchema) or None, in which case
    `get_openai_tool_schema()` must provide one (built-ins: their DEFAULT_SCHEMA).
    `call_timeout_s`, when a tool sets it, is the per-call deadline the ToolSet gives its calls
    unless the YAML config says `timeout_s`.
    """

    DEFAULT_SCHEMA: dict | None = None
    call_timeout_s: float | None = None

    def __init__(self, config: dict, tool_schema: Mapping | None):
        self.config = dict(config or {})
        schema = tool_schema if tool_schema is not None else self.get_openai_tool_schema()
        if schema is None:
            raise ToolConfigError(f"{type(self).__name__}: no tool_schema in the config and none from "
                                  "get_openai_tool_schema()")
        self.tool_schema = check_tool_schema(schema, f"{type(self).__name__} tool_schema")
        self.name = self.tool_schema["function"]["name"]

    def get_openai_tool_schema(self):
        schema = self.__dict__.get("tool_schema") or self.DEFAULT_SCHEMA
        return None if schema is None else ToolSchema(_plain(schema))

    def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """Create an instance for one trajectory; returns its id and a creation response."""
        return (instance_id if instance_id is not None else str(uuid.uuid4())), ToolResponse()

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """Run one call: (response, step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    def release(self, instance_id: str, **kwargs) -> None:
        pass
