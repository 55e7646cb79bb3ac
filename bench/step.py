"""Step bench: one RL step of the CPU default (configs/tiny-cpu.yaml: 60 prompts x 12 = 720 rows,
2 ranks) through the real `rl-train` flow, its time split into stage compute, storage I/O,
orchestration (Prefect tasks/subflow/artifacts) and process launch. Prints JSON and writes
bench/results/step.json.

    python bench/step.py [--steps 3] [key=value ...]      # overrides, e.g. data.train_batch_size=8

Three variants side by side, each a fresh experiment on the same Prefect server:
tasks_in_training_flow (the default: the vLLM engine, orchestration.step_subflow=false: the stage
tasks run in the rl-train flow run), hf_engine (the same with the transformers engine, the
fallback) and step_subflow (each step an `rl-step` subflow). Reports the mean of steps
2.. (the resident workers are warm by then; step 1 pays their start) and every step under
per_step, with each stage's own split (rollout: weights, data, engine call, table, waiting for the
previous update's background commit; update: rank work, save/export, upload) under stage_detail_s.

Builds the tiny model and the arithmetic data in a scratch folder; runs against a temporary local
Prefect server unless PREFECT_API_URL is set. Split, per step:
  stage compute  = each stage task's wall time minus its storage I/O and launch time
  storage I/O    = the manifests' write timings (storage_write_s, upload_s) + reads measured here
  launch         = update/logprob launch overhead reported by the stages (timing/launch_* keys)
  orchestration  = step wall time (timing_s/step: the training loop's whole iteration) minus
                   the stage tasks' wall times: Prefect subflow and task runs, fingerprints and
                   manifest checks, metrics, weights pruning (orchestration_detail_s splits it
                   into prefect_subflow_and_tasks, stage_checks and training_loop). The step's
                   Prefect artifacts are published by a thread beside the next step's first
                   stage; its duration is orchestration_detail_s.publish_artifacts_in_background."""
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
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stagerl-bench-step-"))
    from flows.cli.train import prefect_env

    prefect_env(str(work / "runs"))
    from stages.data.tools import write_arith_dataset
    from stages.model.tiny import save_tiny_model

    save_tiny_model(work / "model")
    write_arith_dataset(work / "train.parquet", n=600)
    write_arith_dataset(work / "test.parquet", n=20, split="test")
    overrides = [f"data.train_files={work}/train.parquet", f"data.val_files={work}/test.parquet",
                 f"actor_rollout_ref.model.path={work}/model", f"storage.root={work}/runs",
                 f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1",
                 "warmstart.enable=false", "trainer.val_before_train=false",
                 *args.overrides]
    import flows.train as train_mod
    import flows.step as step_mod
    import flows.step_report as report_mod
    from storage.artifacts import read_manifest
    from storage.layout import STAGES, RunLayout
    from storage.store import Store

    rec = {"logged": {}, "publish": {}, "subflow": {}, "checks": {}}  # step -> ..., per variant
    original_log = train_mod.MetricSinks.log
    original_publish, original_execute = report_mod.publish_step, step_mod.execute_stage
    original_subflow = train_mod.run_step_subflow

    def recording_log(self, step, metrics):  # the metrics the flow logs (timing_s/* included)
        rec["logged"][step] = dict(metrics)
        return original_log(self, step, metrics)

    def timed_publish(ctx, summaries):  # Prefect artifacts, in the background
        t = time.perf_counter()
        try:
            return original_publish(ctx, summaries)
        finally:
            rec["publish"][ctx.step] = time.perf_counter() - t

    def timed_subflow(run, step, extra=None):
        t = time.perf_counter()
        try:
            return original_subflow(run, step, extra)
        finally:
            rec["subflow"][step] = time.perf_counter() - t

    def timed_execute(stage, run, step, extra=None, deployment=None):  # checks = all but run
        t = time.perf_counter()
        out = original_execute(stage, run, step, extra, deployment)
        ran = out.get("seconds") if isinstance(out, dict) else 0.0
        rec["checks"][step] = rec["checks"].get(step, 0.0) + time.perf_counter() - t - (ran or 0.0)
        return out

    train_mod.MetricSinks.log, report_mod.publish_step = recording_log, timed_publish
    train_mod.run_step_subflow, step_mod.execute_stage = timed_subflow, timed_execute
    out = {"config": "tiny-cpu", "overrides": args.overrides, "variants": {}}
    for variant, extra in (("tasks_in_training_flow", ["orchestration.step_subflow=false"]),
                           ("hf_engine", ["orchestration.step_subflow=false", "actor_rollout_ref.rollout.name=hf"]),
                           ("step_subflow", ["orchestration.step_subflow=true"])):
        for table in rec.values():
            table.clear()
        t0 = time.perf_counter()
        train_mod.train(config="tiny-cpu", overrides=overrides + extra, experiment_name=f"bench-{variant}")
        flow_s = time.perf_counter() - t0
        store = Store.from_config({"root": str(work / "runs")})
        layout = RunLayout("stagerl", f"bench-{variant}")
        steps = [split_step(store, layout, read_manifest, STAGES, k, rec["logged"][k])
                 for k in sorted(rec["logged"]) if k >= 1]
        for st in steps:
            k, stages_s = st["step"], sum(st["stage_s"].values())
            checks = rec["checks"].get(k, 0.0)
            sub = rec["subflow"].get(k)  # None without subflows: Prefect and loop not separable
            st["orchestration_detail_s"] = {
                "prefect_subflow_and_tasks" if sub else "prefect_tasks_and_training_loop":
                    round((sub if sub else st["step_s"]) - stages_s - checks, 3),
                "stage_checks": round(checks, 3),
                "publish_artifacts_in_background": round(rec["publish"].get(k, 0.0), 3)}
            if sub:
                st["orchestration_detail_s"]["training_loop"] = round(st["step_s"] - sub, 3)
        warm = [st for st in steps if st["step"] >= 2] or steps
        mean = lambda key, sub=None: round(sum((st[sub].get(key, 0.0) if sub else st[key])
                                               for st in warm) / len(warm), 3)
        split = {k: mean(k, "split_s") for k in warm[0]["split_s"]}
        step_s = mean("step_s")
        out["variants"][variant] = {
            "overrides": extra, "steps_run": len(steps), "reported_steps": [st["step"] for st in warm],
            "rows": warm[-1]["rows"], "step_s": step_s, "stage_s": {k: mean(k, "stage_s") for k in STAGES},
            "split_s": split,
            "time_split_s": {k: round(sum(st["time_split_s"].get(k) or 0.0 for st in warm) / len(warm), 4)
                             for k in warm[0]["time_split_s"]},
            "non_compute_fraction": round(1 - split["stage_compute"] / step_s, 4) if step_s else None,
            "orchestration_detail_s": {k: mean(k, "orchestration_detail_s")
                                       for k in warm[0]["orchestration_detail_s"]},
            "update_detail_s": {k: mean(k, "update_detail_s") for k in warm[0]["update_detail_s"]},
            "stage_detail_s": {stage: {k: round(sum(st["stage_detail_s"][stage].get(k, 0.0) for st in warm)
                                                / len(warm), 4) for k in warm[-1]["stage_detail_s"][stage]}
                               for stage in STAGES},
            "per_step": steps, "flow_wall_s_including_setup": round(flow_s, 3)}
    out.update({"goal_non_compute_fraction": 0.10, "machine": f"{os.cpu_count()} CPUs",
                "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d")})
    print(json.dumps(out, indent=2))
    results = REPO / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "step.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


def split_step(store, layout, read_manifest, stages, step: int, metrics: dict) -> dict:
    """One step's wall time split into compute, storage I/O, orchestration and launch."""
    stage_s = {s: float(metrics.get(f"timing_s/{s}", 0.0)) for s in stages}
    storage_s, detail_by_stage = 0.0, {}
    background = bool((read_manifest(store, layout, step, "rollout") or {}).get("timings", {})
                      .get("wait_for_update_commit_s") is not None)
    for stage in stages:
        timings = (read_manifest(store, layout, step, stage) or {}).get("timings") or {}
        detail_by_stage[stage] = {k: round(float(v), 4) for k, v in timings.items()
                                  if isinstance(v, (int, float)) and not k.startswith("timing/launch_over")}
        if stage == "update" and background:
            continue  # committed in the background: its uploads overlap the next step's rollout
        storage_s += sum(float(v) for k, v in timings.items() if isinstance(v, (int, float))
                         and k.endswith(("storage_write_s", "upload_s", "wait_for_update_commit_s")))
    launch_s = sum(float(v) for k, v in metrics.items() if k.startswith("timing/launch_overhead"))
    step_s = float(metrics.get("timing_s/step", sum(stage_s.values())))
    compute_s = max(0.0, sum(stage_s.values()) - storage_s - launch_s)
    detail = {k.split("/", 1)[1]: round(float(metrics[k]), 3) for k in
              ("timing/launch_s", "timing/rank_init_s", "timing/rank_train_s",
               "timing/rank_save_export_s", "timing/upload_s") if k in metrics}
    from flows.step_report import time_split

    return {"step": step, "rows": metrics.get("reward/rows"), "step_s": round(step_s, 3),
            "time_split_s": time_split(metrics),
            "stage_s": {k: round(v, 3) for k, v in stage_s.items()},
            "split_s": {"stage_compute": round(compute_s, 3), "storage_io": round(storage_s, 3),
                        "orchestration": round(max(0.0, step_s - sum(stage_s.values())), 3),
                        "process_launch": round(launch_s, 3)},
            "update_detail_s": detail, "stage_detail_s": detail_by_stage}


if __name__ == "__main__":
    sys.exit(main())
