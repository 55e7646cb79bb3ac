"""`make demo`: the main job on the CPU default. Builds the tiny model and the arithmetic data (once),
trains with configs/tiny-cpu.yaml through the `rl-train` Prefect flow (a warm start, then GRPO on
2 CPU ranks, 720 rows per step), then prints the mean reward per step, whether it learned, where
the artifacts are and the commands to look at them.

Learning criterion (issue 9): mean reward of the last 5 steps >= 2x the first 5 and >= 0.5 (a
shorter run, e.g. `python -m flows.demo trainer.total_training_steps=3`, gets no verdict).
Rerunning it resumes the same experiment (complete steps are skipped), so it is cheap to repeat.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

# The demo model: hidden 128, 2 layers, 4 heads (head_dim 32), ~0.4 M parameters.
MODEL_OPTIONS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, seed=0)
TRAIN_ROWS, TEST_ROWS, DIFFICULTY = 1000, 100, 1  # single-digit addition
TOOL_CONFIG, TOOL_TRAIN_ROWS, TOOL_TEST_ROWS = "tools-tiny-cpu", 1000, 100  # the calculator task: a * b, single digits


def prepare(cfg) -> None:
    from stages.data.tools import make_arith_dataset, write_rows
    from stages.model.tiny import describe, save_tiny_model

    model = Path(cfg["actor_rollout_ref"]["model"]["path"])
    if not (model / "config.json").exists():
        save_tiny_model(model, **MODEL_OPTIONS)
    print(describe(model))
    for key, rows, seed, split in (("train_files", TRAIN_ROWS, 1, "train"), ("val_files", TEST_ROWS, 2, "test")):
        path = Path(cfg["data"][key])
        if not path.exists():
            write_rows(make_arith_dataset(rows, seed=seed, difficulty=DIFFICULTY, split=split), path)
        print(f"data {split}: {path} ({rows} arithmetic prompts, difficulty {DIFFICULTY})")
    prepare_tools()


def prepare_tools(overrides=()) -> None:
    """The calculator task's data (configs/tools-tiny-cpu.yaml's files, written once): products
    of single digits in verl's tool-agent schema, each with its demonstration for the warm start."""
    from configs.loader import load_config
    from stages.data.tools import make_tool_arith_dataset, write_tool_rows

    cfg = load_config(TOOL_CONFIG, list(overrides))
    for key, rows, seed, split in (("train_files", TOOL_TRAIN_ROWS, 1, "train"), ("val_files", TOOL_TEST_ROWS, 2, "test")):
        path = Path(cfg["data"][key])
        if not path.exists():
            write_tool_rows(make_tool_arith_dataset(rows, seed=seed, split=split), path)
        print(f"data {split}: {path} ({rows} calculator prompts: a * b, {TOOL_CONFIG})")


def rewards_by_step(cfg) -> list[tuple[int, float]]:
    from storage.artifacts import read_manifest
    from storage.layout import RunLayout
    from storage.store import Store

    store, layout = Store.from_config(cfg["storage"]), RunLayout.from_config(cfg)
    out, step = [], 1
    while True:
        manifest = read_manifest(store, layout, step, "reward")
        if manifest is None:
            return out
        out.append((step, manifest["extra"]["metrics"]["reward/score/mean"]))
        step += 1


def report(cfg, rewards, seconds: float) -> bool:
    print("\nmean reward per step:")
    for step, value in rewards:
        print(f"  step {step:3d}  {value:.3f}  {'#' * round(value * 50)}")
    if len(rewards) < 10:  # a short demo (e.g. `python -m flows.demo trainer.total_training_steps=3`)
        print("fewer than 10 steps: no learning verdict")
        return True
    first = sum(v for _, v in rewards[:5]) / 5
    last = sum(v for _, v in rewards[-5:]) / 5
    ok = last >= 2 * first and last >= 0.5
    print(f"\nfirst 5 steps: {first:.3f}   last 5 steps: {last:.3f}   ratio {last / max(first, 1e-9):.2f}x   "
          f"({'learned' if ok else 'did NOT meet'}: last-5 >= 2x first-5 and >= 0.5)   {seconds / 60:.1f} min")
    exp, root = cfg["trainer"]["experiment_name"], cfg["storage"]["root"]
    run = Path(root) / cfg["trainer"]["project_name"] / exp
    print(f"\nartifacts: {run}/steps/<step>/{{rollout,logprob,reward,advantage}}.parquet, update/, weights/\n"
          f"look at them:\n"
          f"  .venv/bin/stagerl inspect {exp} --step {rewards[-1][0]}\n"
          f"  .venv/bin/stagerl show {exp} --step 1 --uid <uid from inspect>\n"
          f"  .venv/bin/stagerl plot {exp}          # PNGs in {run}/plots/\n"
          f"  .venv/bin/stagerl query --experiment {exp} \"select step, avg(score) from reward group by step order by step\"\n"
          f"  .venv/bin/stagerl runs")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra config overrides for tiny-cpu")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from configs.loader import load_config
    from flows.cli import main as cli

    cfg = load_config("tiny-cpu", args.overrides)
    prepare(cfg)
    t0 = time.perf_counter()
    rc = cli(["train", "--config", "tiny-cpu", *args.overrides])
    if rc:
        return rc
    return 0 if report(cfg, rewards_by_step(cfg), time.perf_counter() - t0) else 1


if __name__ == "__main__":
    from flows.cli import finish_process  # exit skipping the native teardown (see there)

    finish_process(main() or 0)
