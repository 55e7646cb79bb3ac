"""The built-in tools: verl's GSM8K answer check, a calculator and a sandboxed Python runner.

Each reads its settings from the YAML's `config` (unknown keys are refused by name; `type` and
`timeout_s`, the ToolSet's per-call deadline, are accepted by every tool) and brings a default
schema, used when the YAML gives none.
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from stages.scoring.scorers import compute_score_gsm8k
from stages.tools.base import BaseTool, ToolConfigError, ToolResponse
from stages.tools.calculator import CalculatorLimits, evaluate, format_number
from stages.tools.sandbox import SandboxLimits, SandboxUnavailable, run_python, sandbox_problems

COMMON_KEYS = ("type", "timeout_s")


def _settings(tool: str, config: dict, defaults: dict, noted: dict | None = None) -> tuple[dict, list[str]]:
    """(settings with defaults filled in, notes on accepted keys that have no effect here)."""
    noted = noted or {}
    unknown = sorted(set(config) - set(defaults) - set(noted) - set(COMMON_KEYS))
    if unknown:
        raise ToolConfigError(f"{tool} config: unknown key(s) {unknown} (accepted: "
                              f"{sorted(set(defaults) | set(noted) | set(COMMON_KEYS))})")
    settings = {**defaults, **{k: v for k, v in config.items() if k in defaults}}
    notes = [f"{tool} config: {key} is not used ({why})" for key, why in noted.items() if key in config]
    return settings, notes


class Gsm8kTool(BaseTool):
    """verl's Gsm8kTool (verl/tools/gsm8k_tool.py): the model submits an answer, the tool says how
    it parsed and scored it; calc_reward is verl's flexible GSM8K score against the instance's
    ground_truth (from create_kwargs); a submission that does not improve the reward earns -0.05."""

    DEFAULT_SCHEMA = {"type": "function", "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k",
        "parameters": {"type": "object", "properties": {
            "answer": {"type": "string", "description": "The answer to the question"}}, "required": ["answer"]}}}

    def __init__(self, config: dict, tool_schema):
        super().__init__(config, tool_schema)
        _settings("Gsm8kTool", self.config, {})
        self._instance_dict: dict[str, dict] = {}

    def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs):
        if instance_id is None:
            instance_id = str(uuid.uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        state = self._instance_dict[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05  # verl: penalty for no improvement
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    def calc_reward(self, instance_id: str, **kwargs):
        state = self._instance_dict[instance_id]
        return compute_score_gsm8k(state["response"], state["ground_truth"], method="flexible",
                                   format_score=0.0, score=1.0)

    def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]


class CalculatorTool(BaseTool):
    """Arithmetic on ints and floats (stages/tools/calculator.py): the response is the value; a
    refused or failing expression raises, which the ToolSet answers as an error."""

    DEFAULT_SCHEMA = {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with numbers, parentheses and + - * / // % **.",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "The expression, e.g. 123 + 456"}},
            "required": ["expression"]}}}

    def __init__(self, config: dict, tool_schema):
        super().__init__(config, tool_schema)
        settings, self.notes = _settings("CalculatorTool", self.config,
                                         dataclasses.asdict(CalculatorLimits()))
        self.limits = CalculatorLimits(**{k: int(v) for k, v in settings.items()})

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        value = evaluate(parameters.get("expression", ""), self.limits)
        return ToolResponse(text=format_number(value)), 0.0, {}


class PythonTool(BaseTool):
    """Runs a Python snippet in the sandbox (stages/tools/sandbox.py) and answers its stdout and
    stderr, and which limit stopped it if one did. Takes verl's SandboxFusionTool config keys
    (default_timeout: the wall time, memory_limit_mb, default_language: python only) and the
    sandbox's own limits; the call may ask for a shorter `timeout`, never a longer one. Refuses to
    load where the machine cannot sandbox (the reason is in the error)."""

    DEFAULT_SCHEMA = {"type": "function", "function": {
        "name": "code_interpreter",
        "description": "A tool for executing code.",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "The code to execute."}}, "required": ["code"]}}}
    VERL_UNUSED = {
        "sandbox_fusion_url": "the code runs in stagerl's local sandbox, no service is contacted",
        "num_workers": "calls run in the ToolSet's worker processes",
        "rate_limit": "calls run in the ToolSet's worker processes",
        "enable_global_rate_limit": "calls run in the ToolSet's worker processes",
    }

    def __init__(self, config: dict, tool_schema):
        super().__init__(config, tool_schema)
        defaults = {f.name: f.default for f in dataclasses.fields(SandboxLimits)
                    if f.name not in ("wall_time_s", "memory_mb")}
        defaults.update(default_timeout=30, wall_time_s=None, cpu_time_s=None, memory_limit_mb=1024,
                        default_language="python")
        settings, self.notes = _settings("PythonTool", self.config, defaults, self.VERL_UNUSED)
        if str(settings.pop("default_language")).lower() != "python":
            raise ToolConfigError("PythonTool runs Python only (default_language: python)")
        wall = float(settings.pop("wall_time_s") or settings.pop("default_timeout"))
        settings.pop("default_timeout", None)
        cpu = settings.pop("cpu_time_s")
        try:
            self.limits = SandboxLimits(wall_time_s=wall, cpu_time_s=float(cpu or wall),
                                        memory_mb=int(settings.pop("memory_limit_mb")), **settings)
        except (TypeError, ValueError) as exc:
            raise ToolConfigError(f"PythonTool config: {exc}") from None
        self.call_timeout_s = self.limits.wall_time_s + 15.0  # the sandbox stops it first
        problems = sandbox_problems(probe=True, limits=self.limits)
        if problems:
            raise SandboxUnavailable("PythonTool cannot run code isolated on this machine: " + "; ".join(problems))

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        code = parameters.get("code", "")
        if not isinstance(code, str):
            code = str(code)
        language = str(parameters.get("language", "python")).lower()
        if language != "python":
            raise ValueError(f"only python code can be run, not {language!r}")
        limits = self.limits
        timeout = parameters.get("timeout")
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < limits.wall_time_s:
            limits = dataclasses.replace(limits, wall_time_s=float(timeout))
        result = run_python(code, limits)
        return ToolResponse(text=result.text), None, result.metrics()
