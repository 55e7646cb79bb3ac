"""The README blocks that build on nothing the tour left but `make demo`'s model and data
(tests/test_readme.py's ELSEWHERE), run beside the tour's long test, each in its own copy of the
checkout and one bash session, as a reader runs them:

- tour step 7, the calculator task: after `make demo`'s data and model (flows.demo.prepare, what
  `make demo` runs before training), its four commands; the training at a test's scale (a shorter
  warm start, 2 steps instead of 20, like test_readme's 3-step demo) and `stagerl show` on a
  trajectory of the last step (the README's uid names step 20 of the full run);
- the real-size model block, verbatim: a Qwen2.5-0.5B-shaped model with random weights, then the
  plan that estimates each stage's memory on it."""
import os
import re
import subprocess
import sys
from pathlib import Path

from _prefect_server import PrefectServer, prefect_env, stop
from test_readme import ELSEWHERE, REPO, checkout_copy, readme_commands, session_script

PREPARE = 'python -c "from configs.loader import load_config; from flows.demo import prepare; prepare(load_config(\'tiny-cpu\'))"'
TOOLS_SCALE = " warmstart.steps=30 trainer.total_training_steps=2"  # appended to the block's `stagerl train`


def block(name: str) -> list[str]:
    commands, _ = readme_commands((REPO / "README.md").read_text())
    found = [next(c for c in commands if c.startswith(start)) for start in ELSEWHERE[name]]
    assert len(found) == len(ELSEWHERE[name])
    return found


def run_session(tmp_path: Path, commands: list[str], timeout_s: float) -> list[tuple[str, str, str]]:
    """[(command, exit code, output)] of the commands run in order in one bash session in a copy of
    the checkout (.venv/bin on the PATH, a Prefect server of its own)."""
    checkout = checkout_copy(tmp_path / "checkout")
    logs = tmp_path / "logs"
    logs.mkdir()
    with PrefectServer(tmp_path / "prefect-server") as server:
        env = prefect_env(tmp_path / "prefect-home", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                          PYTHONPATH=str(checkout), PREFECT_API_URL=server.api_url)
        proc = subprocess.Popen(["bash", "-c", session_script(commands, logs)], cwd=checkout, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        finally:
            stop(proc)
    out = []
    for i, command in enumerate(commands):
        rc = (logs / f"{i}.rc").read_text().split()[0] if (logs / f"{i}.rc").exists() else "-"
        out.append((command, rc, (logs / f"{i}.log").read_text(errors="replace") if (logs / f"{i}.log").exists() else ""))
    return out


def test_readme_tour_step_7_the_calculator_task(tmp_path):
    train, inspect, query, show = block("tools")
    assert train.split(" #")[0].rstrip() == "stagerl train --config tools-tiny-cpu --experiment tools"
    show = re.sub(r"--step \d+ --uid \S+", "--step 2 --uid $(python -c \"import pyarrow.parquet as pq; "
                  "print(pq.read_table('runs/stagerl/tools/steps/000002/rollout.parquet').column('uid')[0])\")", show)
    results = run_session(tmp_path, [PREPARE, train.split(" #")[0].rstrip() + TOOLS_SCALE, inspect, query, show], timeout_s=900)
    for command, rc, out in results:
        assert rc == "0", f"{command}\nexit {rc}:\n{out[-4000:]}"
    out = {command: text for command, _, text in results}
    assert "turns/mean" in out[inspect] and "correct_tool_use" in out[inspect], out[inspect][-3000:]
    assert "calls" in out[query], out[query]
    assert "turns (" in out[show] and "assistant (tokens" in out[show], out[show][-3000:]


def test_readme_real_size_model_block(tmp_path):
    results = run_session(tmp_path, block("real size"), timeout_s=600)
    for command, rc, out in results:
        assert rc == "0", f"{command}\nexit {rc}:\n{out[-4000:]}"
    plan = results[1][2]
    assert "Memory" in plan and "update engine: DeepSpeed" in plan, plan[-3000:]
    assert (tmp_path / "checkout" / "runs" / "models" / "qwen2.5-0.5b-random" / "config.json").exists()
