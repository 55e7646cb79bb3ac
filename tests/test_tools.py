"""stages/tools/: verl's tool config and life cycle, the hermes call parser, the calculator, the
sandboxed Python runner (each refusal shown by a real snippet) and the ToolSet's worker processes
(errors as responses, per-call timeouts, a dead worker replaced, calls in parallel)."""
import json
import os
import socket
import time
import uuid
from pathlib import Path

import pytest
import yaml

from stages.tools.base import ERROR_KINDS, ToolConfigError
from stages.tools.builtin import PythonTool
from stages.tools.calculator import CalculatorError, evaluate
from stages.tools.parser import ToolCall, get_parser, parse_hermes
from stages.tools.registry import read_tool_config
from stages.tools.sandbox import SandboxLimits, SandboxUnavailable, run_python, sandbox_problems
from stages.tools.toolset import ToolSet, truncate_response

REPO = Path(__file__).resolve().parent.parent
GSM8K_CONFIG = REPO / "examples" / "tool_config" / "gsm8k_tool_config.yaml"
LIMITS = SandboxLimits(wall_time_s=5.0, cpu_time_s=5.0, memory_mb=256, max_output_bytes=4096, max_processes=16)
# the sandbox needs root with CAP_SYS_ADMIN (test_sandbox_refuses_without_root shows the refusal elsewhere)
CAN_SANDBOX = not sandbox_problems(probe=False)
needs_root = pytest.mark.skipif(not CAN_SANDBOX, reason="; ".join(sandbox_problems(probe=False)))


def uid_processes(uid: int = 65534) -> list[int]:
    """Live processes of `uid` (the sandbox's): none may outlive a run."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        if int(uids[0]) == uid and "State:\tZ" not in status:
            found.append(int(entry))
    return found


# ---------------------------------------------------------------------------------------------
# The sandbox

@needs_root
def test_sandbox_runs_a_snippet_in_its_own_directory():
    code = ("import os, sys\nopen('note.txt', 'w').write('kept here')\n"
            "print(open('note.txt').read(), os.getuid(), os.getgid(), os.getcwd() == os.environ['HOME'])\n"
            "print(os.getcwd())\nprint('to stderr', file=sys.stderr)")
    result = run_python(code, LIMITS)
    assert (result.status, result.exit_code) == ("ok", 0)
    first, workdir = result.stdout.splitlines()
    assert first == "kept here 65534 65534 True"
    assert result.stderr == "to stderr\n" and result.text == result.stdout + result.stderr
    assert workdir.startswith("/tmp/") and not os.path.exists(workdir)   # its directory is gone
    failed = run_python("raise SystemExit(3)", LIMITS)
    assert (failed.status, failed.exit_code) == ("error", 3)


@needs_root
def test_sandbox_has_no_network():
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        probe = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=3)\n"
                 "    print('connected')\nexcept OSError as exc:\n    print('refused', exc.errno)" % port)
        outside = socket.create_connection(("127.0.0.1", port), timeout=3)   # the server does answer
        server.accept()[0].close()
        outside.close()
        result = run_python(probe, LIMITS)
        assert result.status == "ok" and result.stdout.startswith("refused"), result.text
        with pytest.raises(BlockingIOError):
            server.accept()   # nothing reached the server from inside
        assert "connected" not in run_python("import socket\nprint(socket.gethostbyname('localhost'))\n"
                                             "socket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')",
                                             LIMITS).stdout
    finally:
        server.close()


@needs_root
def test_sandbox_cannot_write_outside_its_directory():
    targets = [f"/tmp/stagerl-sandbox-escape-{uuid.uuid4().hex}", f"/dev/shm/stagerl-escape-{uuid.uuid4().hex}",
               str(REPO / f"escape-{uuid.uuid4().hex}"), "/etc/stagerl-escape"]
    code = ("import os\nfor path in %r:\n    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
            "    except OSError as exc:\n        print('refused', exc.errno)\n"
            "open('inside.txt', 'w').write('fine')\nprint('inside ok')" % targets)
    result = run_python(code, LIMITS)
    assert result.status == "ok", result.text
    lines = result.stdout.splitlines()
    assert lines[:-1] == ["refused 30"] * len(targets) and lines[-1] == "inside ok"   # 30: EROFS
    assert not any(os.path.exists(path) for path in targets)
    too_big = run_python("open('big', 'wb').write(b'x' * (32 << 20))", LIMITS)   # RLIMIT_FSIZE: 16 MB
    assert too_big.status in ("killed", "error") and too_big.exit_code != 0


@needs_root
def test_sandbox_bounds_a_fork_bomb():
    counted = ("import os, time\nforked = 0\nfor _ in range(1000):\n    try:\n        pid = os.fork()\n"
               "    except OSError as exc:\n        print('fork refused', exc.errno)\n        break\n"
               "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    forked += 1\nprint('forked', forked)")
    started = time.monotonic()
    result = run_python(counted, LIMITS)
    assert result.stdout.splitlines()[0] == "fork refused 11"          # EAGAIN at RLIMIT_NPROC
    assert int(result.stdout.split()[-1]) < LIMITS.max_processes
    assert time.monotonic() - started < 4    # its 15 sleeping children died with the sandbox
    bomb = run_python("import os\nwhile True:\n    os.fork()", LIMITS)
    assert bomb.status != "ok" and "BlockingIOError" in bomb.stderr
    assert time.monotonic() - started < LIMITS.wall_time_s + 4
    assert uid_processes() == []


@needs_root
def test_sandbox_memory_limit():
    small = run_python("x = bytearray(32 << 20)\nprint(len(x))", LIMITS)
    assert small.stdout == f"{32 << 20}\n"
    result = run_python("x = bytearray(512 << 20)\nprint('allocated')", LIMITS)
    assert result.status == "memory" and "allocated" not in result.stdout
    assert result.text.endswith("[sandbox: stopped: memory limit of 256 MB reached]")


@needs_root
def test_sandbox_cpu_and_wall_time_limits():
    started = time.monotonic()
    spin = run_python("while True:\n    pass", SandboxLimits(wall_time_s=10, cpu_time_s=1))
    assert (spin.status, spin.signal) == ("cpu_time", 24) and 0.5 <= spin.cpu_s < 2.5, spin   # SIGXCPU
    assert time.monotonic() - started < 5
    started = time.monotonic()
    sleep = run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
                       "print('started', flush=True)\ntime.sleep(60)", SandboxLimits(wall_time_s=1.0))
    assert sleep.status == "wall_time" and sleep.stdout == "started\n"
    assert 1.0 <= time.monotonic() - started < 4
    assert sleep.text.endswith("[sandbox: stopped: wall-time limit of 1 s reached]")
    assert uid_processes() == []   # the child that left the process group was killed too


@needs_root
def test_sandbox_output_limit():
    started = time.monotonic()
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 1000)", LIMITS)
    assert result.status == "output_limit" and time.monotonic() - started < 4
    assert len(result.stdout) == LIMITS.max_output_bytes and set(result.stdout) == {"x"}
    assert result.text.endswith(f"[sandbox: stopped: output limit of {LIMITS.max_output_bytes} bytes reached, "
                                "the rest was discarded]")


def test_sandbox_refuses_without_root():
    """As any other user the sandbox says what is missing, and runs nothing."""
    def check() -> dict:
        problems = sandbox_problems(probe=False)
        try:
            run_python("print('ran')", LIMITS)
            ran = "ran"
        except SandboxUnavailable as exc:
            ran = f"refused: {exc}"
        try:
            PythonTool({"type": "native"}, None)
            tool = "built"
        except SandboxUnavailable as exc:
            tool = f"refused: {exc}"
        return {"problems": problems, "run": ran, "tool": tool}

    if os.geteuid() != 0:
        seen = check()
    else:   # as uid 65534 in a forked child
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                os.write(write, json.dumps(check()).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            seen = json.loads(f.read())
        os.waitpid(pid, 0)
    assert len(seen["problems"]) == 1 and seen["problems"][0].startswith("not running as root")
    assert "refusing to run code unsandboxed" in seen["problems"][0]
    assert seen["run"].startswith("refused: not running as root")
    assert seen["tool"].startswith("refused: PythonTool cannot run code isolated on this machine: not running as root")


# ---------------------------------------------------------------------------------------------
# The calculator and the parser

@pytest.mark.parametrize("expression, value", [
    ("123 + 456", 579), ("2**10 + 7//2", 1027), ("-3 % 5", 2), ("7 / 2", 3.5), ("(1.5 + 2.5) * 4", 16.0),
    ("10 // -3", -4), ("2 ** -1", 0.5), ("-(4 - 10) * +3", 18), ("987 * 654", 645498), ("0.1 + 0.2", 0.30000000000000004),
    ("2 ** 1000", 2 ** 1000), ("17 % 5 * 3 - 1", 5)])
def test_calculator_values(expression, value):
    result = evaluate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os')", "a call (__import__('os'))"), ("x + 1", "a name (x)"), ("(1).__class__", "an attribute"),
    ("'a' * 3", "only numbers are allowed"), ("1 < 2", "a comparison"), ("True + 1", "only numbers are allowed"),
    ("[1, 2]", "List"), ("9 ** 9999", "exponent 9999"), ("10**600 * 10**700", "exceed 4096 bits"),
    ("1 / 0", "division by zero"), ("(-8) ** 0.5", "not a real number"), ("1e308 * 10", "not a finite number"),
    ("1 +", "not an arithmetic expression"), ("", "empty"), ("1+" * 300 + "1", "more than 500")])
def test_calculator_refusals(expression, reason):
    with pytest.raises(CalculatorError) as refused:
        evaluate(expression)
    assert reason in str(refused.value)


def test_hermes_parser_reads_verls_format():
    text = ('Let me add. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>\n'
            '<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "é"}}\n</tool_call> then '
            '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
            '<tool_call>["not", "an object"]</tool_call><tool_call>{"name": "x"}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me add. \n then "
    assert calls[:2] == [ToolCall("calculator", '{"expression": "1+2"}'), ToolCall("calc_gsm8k_reward", '{"answer": "é"}')]
    assert [(c.name, c.error) for c in calls[2:]] == [(None, "bad_json"), (None, "bad_json"), ("x", "bad_json")]
    assert calls[2].arguments == '{"name": "calculator", "arguments": {"expression": '
    assert parse_hermes(text, keep_malformed=False)[1] == calls[:2]          # verl drops them
    assert parse_hermes('<tool_call>{"name": "a", "arguments": {}}') == ('<tool_call>{"name": "a", "arguments": {}}', [])
    assert get_parser("hermes") is parse_hermes
    with pytest.raises(ToolConfigError, match="gpt-oss"):
        get_parser("gpt-oss")


def test_truncate_response_as_verl():
    assert truncate_response("abcdefghij", 4, "left") == "abcd...(truncated)"
    assert truncate_response("abcdefghij", 4, "right") == "(truncated)...ghij"
    assert truncate_response("abcdefghij", 4, "middle") == "ab...(truncated)...ij"
    assert truncate_response("abc", 4, "left") == "abc"


# ---------------------------------------------------------------------------------------------
# Tool configs and the GSM8K tool

def test_verls_gsm8k_tool_config_loads_unchanged():
    [spec] = read_tool_config(GSM8K_CONFIG)
    verl_entry = yaml.safe_load(GSM8K_CONFIG.read_text())["tools"][0]
    assert (spec.class_name, spec.target) == ("verl.tools.gsm8k_tool.Gsm8kTool", "stages.tools.builtin:Gsm8kTool")
    assert spec.config == {"type": "native"} and spec.tool_schema == verl_entry["tool_schema"]


def test_gsm8k_tool_life_cycle_with_ground_truth():
    with ToolSet.from_config(GSM8K_CONFIG, num_workers=1) as tools:
        assert tools.names == ["calc_gsm8k_reward"] and tools.notes == []
        assert tools.schemas == [yaml.safe_load(GSM8K_CONFIG.read_text())["tools"][0]["tool_schema"]]
        kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
        tools.create("right", kwargs)
        tools.create("wrong", kwargs)
        tools.create("silent", kwargs)
        _, calls = parse_hermes('<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}</tool_call>')
        right, wrong = tools.execute([("right", calls[0]), ("wrong", ToolCall("calc_gsm8k_reward", '{"answer": "71"}'))])
        assert (right.text, right.reward, right.error) == ("Current parsed answer='72' reward=1.0", 0.0, None)
        assert (wrong.text, wrong.reward) == ("Current parsed answer='71' reward=0.0", -0.05)   # verl's penalty
        assert tools.calc_reward("right") == {"calc_gsm8k_reward": 1.0}
        assert tools.calc_reward("wrong") == {"calc_gsm8k_reward": 0.0}
        assert tools.calc_reward("silent") == {"calc_gsm8k_reward": 0}   # never answered: verl's 0
        [fixed] = tools.execute([("wrong", ToolCall("calc_gsm8k_reward", '{"answer": "#### 72"}'))])
        assert (fixed.text, fixed.reward) == ("Current parsed answer='#### 72' reward=1.0", 0.0)
        assert tools.calc_reward("wrong") == {"calc_gsm8k_reward": 1.0}    # the instance kept its state
        for sample in ("right", "wrong", "silent"):
            tools.release(sample)
        with pytest.raises(KeyError, match="not created"):
            tools.submit("right", calls[0])
        metrics = tools.metrics()
        assert metrics["tools/calls"] == 3 and metrics["tools/errors"] == 0 and metrics["tools/calls/calc_gsm8k_reward"] == 3


def test_tool_config_refusals():
    def entry(class_name, **config):
        return {"tools": [{"class_name": class_name, "config": {"type": "native", **config}}]}

    refusals = {
        "verl.tools.search_tool.SearchTool is a verl tool stagerl does not provide": entry("verl.tools.search_tool.SearchTool"),
        "config.type 'mcp' is not supported": {"tools": [{"class_name": "calculator", "config": {"type": "mcp"}}]},
        "unknown key(s) ['mcp']": {"tools": [{"class_name": "calculator", "config": {}, "mcp": {}}]},
        "collections.OrderedDict is not a subclass of stages.tools.base.BaseTool": entry("collections.OrderedDict"),
        "could not import no_such_module": entry("no_such_module.Tool"),
        "CalculatorTool config: unknown key(s) ['max_lenght']": entry("calculator", max_lenght=3),
        "a second tool named 'calculator'": {"tools": [{"class_name": "calculator"}] * 2},
        "PythonTool runs Python only": entry("python", default_language="cpp"),
        "function.description is required": {"tools": [{"class_name": "calculator", "tool_schema": {
            "type": "function", "function": {"name": "calc"}}}]},
    }
    for message, config in refusals.items():
        with pytest.raises(ToolConfigError) as refused:
            ToolSet.from_config(config)
        assert message in str(refused.value)
    with pytest.raises(ToolConfigError, match="a mapping with a `tools:` list"):
        read_tool_config({"tool": []})


@needs_root
def test_verls_sandbox_fusion_config_maps_to_the_local_sandbox():
    verl_config = {"tools": [{"class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool", "config": {
        "sandbox_fusion_url": "https://xxx.apigateway-cn-beijing.volceapi.com/run_code", "num_workers": 10,
        "enable_global_rate_limit": True, "rate_limit": 10, "default_timeout": 30, "default_language": "python",
        "memory_limit_mb": 1024, "type": "native"}, "tool_schema": {"type": "function", "function": {
            "name": "code_interpreter", "description": "A tool for executing code.", "parameters": {
                "type": "object", "properties": {"code": {"type": "string", "description": "The code to execute."}},
                "required": ["code"]}}}}]}
    [spec] = read_tool_config(verl_config)
    assert spec.target == "stages.tools.builtin:PythonTool"
    tool = PythonTool(spec.config, spec.tool_schema)
    assert (tool.limits.wall_time_s, tool.limits.memory_mb, tool.call_timeout_s) == (30.0, 1024, 45.0)
    assert [n.split(" is not used")[0] for n in tool.notes] == [
        "PythonTool config: sandbox_fusion_url", "PythonTool config: num_workers", "PythonTool config: rate_limit",
        "PythonTool config: enable_global_rate_limit"]


# ---------------------------------------------------------------------------------------------
# The ToolSet: worker processes, errors as responses, timeouts, parallel calls

FIXTURE_TOOLS = ["SleepTool", "RaisingTool", "DyingTool", "AsyncCounterTool", "NoSandboxTool"]


@pytest.fixture(scope="module")
def toolset():
    config = {"tools": [{"class_name": f"_tool_fixtures.{name}", "config": {"type": "native"}} for name in FIXTURE_TOOLS]
              + [{"class_name": "calculator", "config": {"type": "native"}}]}
    if CAN_SANDBOX:
        config["tools"].append({"class_name": "python", "config": {"type": "native", "default_timeout": 5,
                                                                    "memory_limit_mb": 256}})
    with ToolSet.from_config(config, num_workers=3, timeout_s=20.0) as tools:
        assert tools.start(wait=True, timeout=120)
        yield tools


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, json.dumps(arguments))


def test_errors_become_responses_while_the_batch_answers(toolset):
    samples = [f"errors-{i}" for i in range(8)]
    for sample in samples:
        toolset.create(sample)
    before = toolset.metrics()
    pids = set(toolset.worker_pids)
    started = time.monotonic()
    hung = toolset.submit(samples[0], call("sleep", seconds=60), timeout_s=1.0)
    others = toolset.execute([(samples[1], call("explode")), (samples[2], parse_hermes(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+"</tool_call>')[1][0]),
        (samples[3], call("no_such_tool")), (samples[4], call("calculator", expression="__import__('os')")),
        (samples[5], call("calculator", expression="123 + 456")), (samples[6], call("no_sandbox")),
        (samples[7], ToolCall("calculator", '"1+1"'))])
    results = [hung.result()] + others
    elapsed = time.monotonic() - started
    assert [r.error for r in results] == ["timeout", "exception", "bad_json", "unknown_tool", "exception", None,
                                          "sandbox", "bad_json"]
    assert [r.text for r in results] == [
        "Error when executing tool: the call took longer than 1s (the tool worker was stopped)",
        "Error when executing tool: boom",
        "Error when executing tool: the tool call is not valid JSON: Expecting ',' delimiter: line 1 column 56 (char 55)",
        "Error when executing tool: unknown tool 'no_such_tool' (tools: " + ", ".join(toolset.names) + ")",
        "Error when executing tool: only numbers and + - * / // % ** are allowed, found a call (__import__('os'))",
        "579", "Error when executing tool: no namespaces here",
        "Error when executing tool: the arguments must be a JSON object, got str"]
    assert 1.0 <= results[0].latency_s < 3 and elapsed < 6
    after = toolset.metrics()
    assert {k: after[f"tools/errors/{k}"] - before[f"tools/errors/{k}"] for k in ERROR_KINDS} == \
        {"bad_json": 2, "unknown_tool": 1, "timeout": 1, "exception": 2, "sandbox": 1}
    assert after["tools/calls"] - before["tools/calls"] == 8
    # the hung worker was replaced: the same sample's instance answers again, from a new process
    [again] = toolset.execute([(samples[0], call("sleep", seconds=0))])
    assert again.ok and again.text == "slept 0" and again.metrics["pid"] not in pids
    for sample in samples:
        toolset.release(sample)


def test_a_dead_worker_is_replaced(toolset):
    toolset.create("dies")
    [died] = toolset.execute([("dies", call("die"))])
    assert died.error == "exception" and died.text == "Error when executing tool: the tool worker process died (exit code 3)"
    [after] = toolset.execute([("dies", call("calculator", expression="6 * 7"))])
    assert after.ok and after.text == "42"
    toolset.release("dies")


def test_calls_run_in_parallel(toolset):
    assert toolset.start(wait=True, timeout=120)   # every worker up (earlier tests replaced some)
    for sample in ("p1", "p2", "p3"):
        toolset.create(sample)
    started = time.monotonic()
    results = toolset.execute([(s, call("sleep", seconds=1)) for s in ("p1", "p2", "p3")])
    elapsed = time.monotonic() - started
    assert [r.text for r in results] == ["slept 1"] * 3 and all(r.latency_s >= 1.0 for r in results)
    assert len({r.metrics["pid"] for r in results}) == 3              # three processes ...
    starts = [r.metrics["started"] for r in results]
    assert max(starts) - min(starts) < 0.5 and elapsed < 1.9          # ... at the same time
    for sample in ("p1", "p2", "p3"):
        toolset.release(sample)


def test_instances_keep_state_between_calls_and_async_tools_run(toolset):
    toolset.create("counter", {"count": {"create_kwargs": {"start": 10}, "execute_kwargs": {"scale": 2}}})
    first, second = toolset.execute([("counter", call("count", step=3)), ("counter", call("count", step=1))])
    assert (first.text, second.text, first.reward) == ("16", "18", 0.5)
    assert first.metrics["pid"] == second.metrics["pid"]   # one instance, one process, in order
    assert toolset.calc_reward("counter") == {"count": 18.0}
    toolset.release("counter")
    toolset.release("counter")   # twice: nothing left to do


def test_instance_per_call_is_verls_agent_loop():
    config = {"tools": [{"class_name": "_tool_fixtures.AsyncCounterTool", "config": {"type": "native"}}]}
    with ToolSet.from_config(config, num_workers=1, instance_per="call") as tools:
        tools.create("s", {"count": {"create_kwargs": {"start": 10}}})
        results = tools.execute([("s", call("count", step=3)), ("s", call("count", step=1))])
        assert [r.text for r in results] == ["13", "11"]    # a fresh instance per call
        assert tools.calc_reward("s") == {}
        tools.release("s")
        pids = tools.worker_pids
    assert pids and not any(os.path.exists(f"/proc/{pid}") for pid in pids)   # closed: workers gone


@needs_root
def test_python_tool_runs_through_the_toolset(toolset):
    toolset.create("code")
    _, calls = parse_hermes('<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
                            '<tool_call>{"name": "code_interpreter", "arguments": {"code": "import time; time.sleep(9)",'
                            ' "timeout": 1}}</tool_call>')
    ok, slow = toolset.execute([("code", c) for c in calls])
    assert (ok.text, ok.reward, ok.metrics["status"], ok.metrics["exit_code"]) == ("42\n", None, "ok", 0)
    assert slow.ok and slow.metrics["status"] == "wall_time"   # the call asked for 1 s, under the config's 5 s
    assert slow.text == "[sandbox: stopped: wall-time limit of 1 s reached]"
    toolset.release("code")
