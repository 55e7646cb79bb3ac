"""stagerl's side of the peer benchmark: one run of the real `rl-train` flow in a fresh process.

    .venv/bin/python bench/peer/stagerl_run.py --out run.json --experiment NAME [--t0 T] key=value ...

Runs flows.train.train(config="tiny-cpu", overrides) as `stagerl train` does (the run's fork
server started first: stages.ranks.zygote.prestart) against the Prefect server named by
PREFECT_API_URL (bench/peer_trl.py starts one for all runs) and writes one JSON: for every step
the wall-clock time (time.time()) at which the flow logged it and the metrics it logged, which
include timing_s/step (the training loop's whole iteration, measured by the flow from the top of
the iteration) and timing_s/{stage}.

Step markers, from the flow's own measurement: step k ends when the flow logs it (right after
timing_s/step is taken) and begins timing_s/step earlier; that is the top of the loop iteration,
after everything that is start-up (imports, Prefect flow run, run.json, dataset, rank pool). As a
cross-check the JSON also holds the rollout manifest's written_at minus its stage time for step 1
(when the first stage's work began, a little after the iteration began).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

T_MAIN = time.time()
REPO = Path(__file__).resolve().parents[2]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench" / "peer"]
sys.path.insert(0, str(REPO))


def numbers(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def rollout_began(storage_root: str, experiment: str, step: int) -> float | None:
    """time.time() at which step's rollout work began, from its manifest (written_at minus the
    stage's load, generation and write seconds), or None."""
    from storage.artifacts import read_manifest
    from storage.layout import RunLayout
    from storage.store import Store

    manifest = read_manifest(Store.from_config({"root": storage_root}), RunLayout("stagerl", experiment),
                             step, "rollout")
    if not manifest:
        return None
    timings = manifest.get("timings") or {}
    parts = [timings.get(k) for k in ("load_s", "rollout_s", "storage_write_s")]
    return manifest["written_at"] - sum(float(p) for p in parts if isinstance(p, (int, float)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--experiment", required=True)
    parser.add_argument("--t0", type=float, default=T_MAIN, help="time.time() when the parent started us")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if not os.environ.get("PREFECT_API_URL"):
        raise SystemExit("PREFECT_API_URL is not set: bench/peer_trl.py starts the Prefect server for all runs")
    import gc

    gc.disable()  # as `stagerl train` does (flows.cli.train): on again after step 1 (freeze_heap)
    from configs.loader import load_config
    from stages.ranks.zygote import prestart

    spawner = prestart(load_config("tiny-cpu", list(args.overrides)))  # as `stagerl train` does
    import torch

    import flows.train as train_mod
    from flows.cli.train import drain_prefect_senders
    t_imported = time.time()

    events: list = []
    original_log = train_mod.MetricSinks.log

    def recording_log(self, step, metrics):
        events.append({"step": step, "logged_at": time.time(), "metrics": numbers(metrics)})
        return original_log(self, step, metrics)

    train_mod.MetricSinks.log = recording_log
    error = None
    try:
        state = train_mod.train(config="tiny-cpu", overrides=args.overrides,
                                experiment_name=args.experiment, return_state=True)
        if not state.is_completed():
            try:
                state.result()
                error = f"flow ended in state {state.type}"
            except Exception as exc:  # the flow's own failure, reported by the bench
                import traceback

                error = "".join(traceback.format_exception(exc))
    finally:
        drain_prefect_senders()
        if spawner is not None:
            spawner.close()
    t_done = time.time()
    root = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("storage.root=")), "./runs")
    out = {
        "side": "stagerl", "t0": args.t0, "t_main": T_MAIN, "t_imported": t_imported, "t_train_done": t_done,
        "ok": error is None, "error": error, "steps": events,
        "step1_rollout_began": rollout_began(root, args.experiment, 1) if events else None,
        "threads": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                    "torch.get_num_threads (flow process)": torch.get_num_threads()},
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": _version("transformers"),  # not imported: at 2 ranks this process never does
                     "deepspeed": _version("deepspeed"), "prefect": _version("prefect")},
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if error is None else 1


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    from flows.cli import finish_process

    finish_process(main())  # as `stagerl train` ends: the measured steps are over, and the
    #                         interpreter's teardown of torch & co. only lengthens the sweep
