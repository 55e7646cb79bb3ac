"""Step bench: one RL step of the CPU default (configs/tiny-cpu.yaml: 60 prompts x 12 = 720 rows,
2 ranks) through the real `rl-train` flow, its time split into stage compute, storage I/O,
orchestration (Prefect tasks/subflow/artifacts) and process launch. Prints JSON and writes
bench/results/step.json.

    python bench/step.py [--steps 1] [key=value ...]      # overrides, e.g. data.train_batch_size=8

Builds the tiny model and the arithmetic data in a scratch folder; runs against a temporary local
Prefect server unless PREFECT_API_URL is set. Split, per step:
  stage compute  = each stage task's wall time minus its storage I/O and launch time
  storage I/O    = the manifests' write timings (storage_write_s, upload_s) + reads measured here
  launch         = update/logprob launch overhead reported by the stages (timing/launch_* keys)
  orchestration  = step wall time minus the stage tasks' wall times (Prefect bookkeeping,
                   artifacts, fingerprints)."""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stagerl-bench-step-"))
    from flows.cmd_train import prefect_env

    prefect_env(str(work / "runs"))
    from stages.data_tools import write_arith_dataset
    from stages.tiny_model import save_tiny_model

    save_tiny_model(work / "model")
    write_arith_dataset(work / "train.parquet", n=600)
    write_arith_dataset(work / "test.parquet", n=20, split="test")
    overrides = [f"data.train_files={work}/train.parquet", f"data.val_files={work}/test.parquet",
                 f"actor_rollout_ref.model.path={work}/model", f"storage.root={work}/runs",
                 f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1",
                 "warmstart.enable=false", "trainer.val_before_train=false",
                 *args.overrides]
    from flows.train import train
    from storage.artifacts import read_manifest
    from storage.layout import STAGES, RunLayout
    from storage.store import Store

    t0 = time.perf_counter()
    result = train(config="tiny-cpu", overrides=overrides, experiment_name="bench-step")
    flow_s = time.perf_counter() - t0
    store = Store.from_config({"root": str(work / "runs")})
    layout = RunLayout("stagerl", "bench-step")
    metrics = result["last_metrics"]
    step = args.steps
    stage_s = {s: float(metrics.get(f"timing_s/{s}", 0.0)) for s in STAGES}
    storage_s, launch_s = 0.0, 0.0
    for stage in STAGES:
        timings = (read_manifest(store, layout, step, stage) or {}).get("timings") or {}
        storage_s += sum(float(v) for k, v in timings.items()
                         if isinstance(v, (int, float)) and k.endswith(("storage_write_s", "upload_s")))
    launch_s += sum(float(v) for k, v in metrics.items() if k.startswith("timing/launch_overhead"))
    step_s = float(metrics.get("timing_s/step", sum(stage_s.values())))
    orchestration_s = max(0.0, step_s - sum(stage_s.values()))
    compute_s = max(0.0, sum(stage_s.values()) - storage_s - launch_s)
    out = {"config": "tiny-cpu", "overrides": args.overrides, "step": step,
           "rows": metrics.get("reward/rows"), "step_s": round(step_s, 3),
           "stage_s": {k: round(v, 3) for k, v in stage_s.items()},
           "split_s": {"stage_compute": round(compute_s, 3), "storage_io": round(storage_s, 3),
                       "orchestration": round(orchestration_s, 3), "process_launch": round(launch_s, 3)},
           "non_compute_fraction": round(1 - compute_s / step_s, 4) if step_s else None,
           "flow_wall_s_including_setup": round(flow_s, 3),
           "machine": f"{os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(out, indent=2))
    results = REPO / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "step.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
