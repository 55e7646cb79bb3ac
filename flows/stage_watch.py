"""A stage run as a deployment on another machine (orchestration.mode=deployments), watched so
that a lost machine fails the step within a timeout instead of hanging it.

- The stage flow (flows/step.py::stage_flow) runs a `Heartbeat`: a thread writing
  layout.heartbeat(step, stage) = {"host", "pid", "flow_run_id", "beat"} into the store every
  timeout ÷ 4 s (at most 5 s). The store is the one path every machine has (Prefect's own flow
  heartbeats need an automation on the server to act on them).
- The training flow starts the deployment's flow run (`run_stage_deployment`) and polls it every
  second. Once it is Running, a heartbeat of that flow run must change at least every
  orchestration.stage_heartbeat_timeout_s seconds; the clock pauses while the store does not
  answer the training flow either (an S3 outage is not a lost machine). Past it, the flow run is
  marked Crashed and the step fails naming the stage, the step and the host that went silent
  (its machine down, its worker killed, its network cut): bring it back and rerun the training
  flow run (`prefect flow-run retry`), which resumes at that stage.
- A flow run that ends Failed/Crashed/Cancelled raises with its state message, which names the
  host (stage_flow wraps its error with it).
A flow run that no worker picks up (no worker on the pool) waits, shown Late by Prefect."""
from __future__ import annotations

import os
import socket
import threading
import time

POLL_S = 1.0


class StageLost(RuntimeError):
    """A stage's flow run stopped sending heartbeats."""


class Heartbeat:
    """`with Heartbeat(store, key, timeout_s):` writes this process's heartbeat to `key`."""

    def __init__(self, store, key: str, timeout_s: float):
        from prefect.runtime import flow_run

        self.store, self.key = store, key
        self.every = max(0.5, min(5.0, float(timeout_s) / 4))
        self.doc = {"host": socket.gethostname(), "pid": os.getpid(), "flow_run_id": str(flow_run.id or ""),
                    "beat": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stage-heartbeat", daemon=True)

    def _run(self) -> None:
        while True:
            self.doc["beat"] += 1
            self.doc["time"] = time.time()
            try:
                self.store.write_json(self.key, self.doc)
            except Exception:  # noqa: BLE001 - the store is down: the watcher pauses its clock too
                pass
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def heartbeat_timeout(cfg: dict) -> float:
    return float((cfg.get("orchestration") or {}).get("stage_heartbeat_timeout_s") or 60.0)


def run_stage_deployment(name: str, ctx, stage: str, run_uri: str, extra) -> None:
    """Run `stage` of ctx.step as a flow run of deployment `name` and wait for it (see above)."""
    from prefect import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Crashed

    step = ctx.step
    timeout = heartbeat_timeout(ctx.cfg)
    flow_run = run_deployment(name=name, timeout=0, parameters={"stage": stage, "run_uri": run_uri, "step": step,
                                                                "extra": extra or {}})
    key = ctx.layout.heartbeat(step, stage)
    seen, quiet_since, host = None, None, None
    with get_client(sync_client=True) as client:
        while True:
            flow_run = client.read_flow_run(flow_run.id)
            state = flow_run.state
            if state is not None and state.is_final():
                break
            if state is not None and state.is_running():
                now = time.monotonic()
                try:
                    doc = ctx.store.read_json(key)
                    doc = doc if doc.get("flow_run_id") == str(flow_run.id) else None
                except Exception as exc:  # noqa: BLE001
                    doc = None if _missing(exc) else "store-down"
                if doc == "store-down":
                    quiet_since = now  # nobody reaches the store: not this machine's silence
                elif doc != seen or quiet_since is None:
                    seen, quiet_since = doc, now
                    host = (doc or {}).get("host") or host
                elif now - quiet_since > timeout:
                    who = f"host {host}" if host else "its host (no heartbeat ever arrived)"
                    message = (f"{stage} of step {step}: {who} sent no heartbeat for {timeout:.0f} s "
                               f"(orchestration.stage_heartbeat_timeout_s; flow run {flow_run.name}): the "
                               f"machine, its worker or its network is lost. Bring it back, then rerun the "
                               f"training flow run (`prefect flow-run retry`): it resumes at this stage")
                    client.set_flow_run_state(flow_run.id, Crashed(message=message), force=True)
                    raise StageLost(message)
            time.sleep(POLL_S)
    if not state.is_completed():
        why = state.message or ""
        raise RuntimeError(f"deployment {name} (flow run {flow_run.name}) ended {state.name} for step {step} "
                           f"stage {stage!r}: {why} (its logs: `prefect flow-run logs {flow_run.id}`)")


def _missing(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError)  # Store: a missing key; other errors: the store is down
