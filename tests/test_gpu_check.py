"""bench/gpu_check.py, the script a lent GPU machine runs, on the CPU with the tiny preset: every part
(transformers rollout, resident engines, the DeepSpeed update with the plan's estimate) runs and
prints its JSON, so a GPU session does not find a broken script."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_on_the_cpu():
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--preset", "tiny",
                          "--prompt-len", "16", "--response-len", "8", "--rollout-prompts", "4", "--update-rows", "4",
                          "--update-iters", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout[run.stdout.rindex("\n{"):])
    assert summary["rollout_hf"]["response_tokens"] == 4 * 8
    assert summary["resident_engines"]["hf"]["generate_after_reload_s"] > 0
    update = summary["update_deepspeed_zero2"]
    assert update["tokens_per_step"] == 4 * (16 + 8) and update["step_s"] > 0
    assert update["plan_estimate_gib"]["parts"]["weights"] >= 0 and "training_without_runtime" in update["plan_estimate_gib"]
