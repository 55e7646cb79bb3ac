"""User tools for tests/test_tools.py, named in tool configs by their module.Class path (the
tool workers import this module: tests/ is on the path they inherit)."""
import asyncio
import os
import time

from stages.tools.base import BaseTool, ToolResponse


def schema(name: str, **properties) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"test tool {name}",
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in properties.items()},
                       "required": list(properties)}}}


class SleepTool(BaseTool):
    """Sleeps `seconds`, then says so (a hang when seconds is large)."""

    DEFAULT_SCHEMA = schema("sleep", seconds="number")

    def execute(self, instance_id, parameters, **kwargs):
        started = time.monotonic()
        time.sleep(float(parameters["seconds"]))
        return ToolResponse(text=f"slept {parameters['seconds']}"), 0.0, {"pid": os.getpid(), "started": started}


class RaisingTool(BaseTool):
    DEFAULT_SCHEMA = schema("explode")

    def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("boom")


class DyingTool(BaseTool):
    """Ends its worker process in the middle of a call."""

    DEFAULT_SCHEMA = schema("die")

    def execute(self, instance_id, parameters, **kwargs):
        os._exit(3)


class AsyncCounterTool(BaseTool):
    """verl-style async methods; counts the calls of each instance (its state between calls)."""

    DEFAULT_SCHEMA = schema("count", step="integer")

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id=None, **kwargs):
        start = (kwargs.get("create_kwargs") or {}).get("start", 0)
        self._instance_dict[instance_id] = start
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(0)
        self._instance_dict[instance_id] += int(parameters.get("step", 1)) * int(kwargs.get("scale", 1))
        return ToolResponse(text=str(self._instance_dict[instance_id])), 0.5, {"pid": os.getpid()}

    async def calc_reward(self, instance_id, **kwargs):
        return float(self._instance_dict[instance_id])

    async def release(self, instance_id, **kwargs):
        del self._instance_dict[instance_id]


class NoSandboxTool(BaseTool):
    """A tool whose isolation is unavailable at call time."""

    DEFAULT_SCHEMA = schema("no_sandbox")

    def execute(self, instance_id, parameters, **kwargs):
        from stages.tools.sandbox import SandboxUnavailable
        raise SandboxUnavailable("no namespaces here")
