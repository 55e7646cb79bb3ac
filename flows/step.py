"""One RL step as a Prefect flow: rollout -> logprob -> reward -> advantage -> update, each a task.

The training flow passes the step's flow and its tasks a RunHandle (flows/run_handle.py: the run
URI, and in the training flow's process its resolved config, plan, store and run session), the step
number and a small `extra` dict; each task builds its StageContext from the handle. A stage flow
run by a deployment in another process gets the URI only and rebuilds the handle from the run's
run.json. A stage whose manifest exists with the fingerprint the stage would write is not
run again: its task ends in a Completed state named "Cached" with the reason as its message.

Retries: storage I/O errors (StoreError, connection/timeouts, other OSErrors) retry with
exponential backoff (orchestration.storage_retries, orchestration.retry_delay_s); out-of-memory,
bad config and bad input (ConfigError, ValueError incl. SchemaError, missing files) fail at once.
With orchestration.mode=deployments rollout and update run as `rl-stage/*` deployments through
run_deployment, and logprob (the other N-rank stage: its ranks run where the update's do, e.g. a
DeepSpeed launch over the training nodes' hostfile) on the update deployment when it has passes to
run (stages.logprob.runs_on_ranks; else it runs here and the update's job gives the old
log-probs); the deployment's parameters are
only the URI, the stage, the step and `extra`. A stage flow that fails says on which host."""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import socket
import time

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from flows import step_report
from flows.run_handle import RunHandle
from flows.stage_watch import Heartbeat, heartbeat_timeout, run_stage_deployment
from storage.artifacts import read_manifest
from storage.layout import STAGES, RunLayout
from storage.store import StoreError

# Stages that read only the rollout run as two concurrent task runs (the flow's thread pool): the
# reward's scorer processes work while the logprob stage runs, instead of after it. Not with a
# reward model, which would share this process's CPU (and device) with the logprob pass.
SIDE_BY_SIDE = ("logprob", "reward")
STAGES_ENV = "STAGERL_STAGES"  # package holding the stage modules (default: stages)
REMOTE_STAGES = ("rollout", "update")
ON_UPDATE_DEPLOYMENT = ("logprob",)  # N-rank stages run by the update deployment, on its pool
STAGE_MODULES = {"warmstart": "model.warmstart"}  # stages whose module is not at the package's top
# Stages whose start releases the Prefect events held since the last one (flows/task_events.py):
# generation or the train loop follows. Where the pacer is released by the session instead (its
# stages call RunSession.compute_starts where that compute starts: trainer.staleness 0), only a
# stage run as a deployment, elsewhere, releases them at its start.
RELEASE_EVENTS_AT = ("rollout", "update")


# ---- stages and their fingerprints ------------------------------------------------------------
def stage_module(stage: str):
    """The module implementing `stage` (STAGE, INPUTS, CONFIG_KEYS, run)."""
    package = os.environ.get(STAGES_ENV) or "stages"
    return importlib.import_module(f"{package}.{STAGE_MODULES.get(stage, stage)}")


def stage_fingerprint(module, ctx) -> str:
    """The fingerprint the stage writes: its own stage_fingerprint(ctx) when it defines one
    (e.g. reward adds the custom reward file), else ctx.fingerprint(STAGE, CONFIG_KEYS, INPUTS)."""
    own = getattr(module, "stage_fingerprint", None)
    if callable(own):
        return own(ctx)
    return ctx.fingerprint(module.STAGE, module.CONFIG_KEYS, module.INPUTS)


def stage_is_complete(ctx, stage: str) -> bool:
    module = stage_module(stage)
    manifest = read_manifest(ctx.store, ctx.layout, ctx.step, stage)
    return bool(manifest) and manifest.get("fingerprint") == stage_fingerprint(module, ctx)


def step_is_complete(ctx) -> bool:
    """Every stage of the step has a manifest with the fingerprint it would write now."""
    return all(stage_is_complete(ctx, stage) for stage in STAGES)


# ---- retries ----------------------------------------------------------------------------------
def is_retryable(exc: BaseException | None) -> bool:
    """Storage I/O errors retry; out-of-memory and bad input do not."""
    if exc is None or isinstance(exc, (MemoryError, ValueError, KeyError, TypeError)):
        return False
    if "OutOfMemoryError" in type(exc).__name__:  # torch.OutOfMemoryError (a RuntimeError)
        return False
    if isinstance(exc, (StoreError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    return isinstance(exc, OSError)


def _retry_condition(task_, task_run, state) -> bool:
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            exc = state.result(raise_on_failure=False)
        except Exception:
            return False
    return is_retryable(exc if isinstance(exc, BaseException) else None)


def retry_options(cfg: dict) -> dict:
    orch = cfg.get("orchestration") or {}
    retries = int(orch.get("storage_retries", 5))
    first = float(orch.get("retry_delay_s", 2.0))
    return {"retries": retries, "retry_delay_seconds": [first * 2 ** i for i in range(retries)]}


def retrying_stage_task(cfg: dict):
    """stage_task with the run's retry options (retry_options)."""
    options = retry_options(cfg)
    return _stage_task_with(options["retries"], tuple(options["retry_delay_seconds"]))


@functools.lru_cache(maxsize=8)
def _stage_task_with(retries: int, delays: tuple):
    """One Task per retry policy, made once: Task.with_options copies and validates the task
    (~0.8 ms), which the step loop otherwise paid every step."""
    return stage_task.with_options(retries=retries, retry_delay_seconds=list(delays))


# ---- the stage task ---------------------------------------------------------------------------
def summarize(manifest: dict, skipped: bool, seconds: float | None = None, started_at: float | None = None) -> dict:
    """What a stage task returns: small, JSON-able (started_at: wall-clock seconds, for overlaps;
    committed: False while the stage commits in the background, its manifest not yet written)."""
    files = manifest.get("files") or {}
    return {"stage": manifest.get("stage"), "step": manifest.get("step"), "skipped": skipped,
            "committed": not (manifest.get("extra") or {}).get("committing"),
            "fingerprint": manifest.get("fingerprint"), "rows": manifest.get("row_count"),
            "paths": {name: e.get("path") for name, e in files.items()},
            "timings": manifest.get("timings") or {}, "seconds": seconds, "started_at": started_at,
            "metrics": (manifest.get("extra") or {}).get("metrics") or {}}


def execute_stage(stage: str, run: RunHandle, step: int, extra: dict | None = None,
                  deployment: str | None = None):
    """Run one stage unless complete. Returns its summary, or a Cached state carrying it."""
    ctx = run.context(step, extra)
    ctx.memo = {}  # this stage run reads each input's manifest once (StageContext.input_manifest)
    module = stage_module(stage)
    fingerprint = stage_fingerprint(module, ctx)
    manifest = read_manifest(ctx.store, ctx.layout, step, stage)
    if manifest and manifest.get("fingerprint") == fingerprint:
        message = f"skipped: {stage} of step {step} is complete (fingerprint {fingerprint[:12]})"
        return Completed(name="Cached", message=message, data=summarize(manifest, skipped=True))
    if stage in RELEASE_EVENTS_AT and run.events is not None and (deployment or not run.events.by_session):
        run.events.release()
    t0, started_at = time.perf_counter(), time.time()
    if deployment:
        run_stage_deployment(deployment, ctx, stage, run.uri, extra)
        manifest = read_manifest(ctx.store, ctx.layout, step, stage)
        if not manifest:
            raise RuntimeError(f"deployment {deployment} finished but step {step} stage {stage!r} "
                               f"has no manifest in {run.uri}")
    else:
        from storage.faults import maybe_fault

        maybe_fault(stage, "start", step)
        manifest = module.run(ctx)
    return summarize(manifest, skipped=False, seconds=round(time.perf_counter() - t0, 3), started_at=started_at)


@task(name="stage", task_run_name="{stage}-step-{step}", cache_policy=NO_CACHE,
      retry_condition_fn=_retry_condition)
def stage_task(stage: str, run: RunHandle, step: int, extra: dict | None = None,
               deployment: str | None = None):
    """One stage of one step. Its parameters are not recorded by Prefect and, with NO_CACHE, make
    no cache key: the run handle is passed as the object it is. A complete stage ends as Cached."""
    return execute_stage(stage, run, step, extra, deployment)


def check_stage_deployments(cfg: dict) -> dict:
    """{stage: deployment name} for orchestration.mode=deployments; refuses a deployment that
    is missing or not on the configured work pool."""
    orch = cfg.get("orchestration") or {}
    if orch.get("mode", "local") != "deployments":
        return {}
    from prefect import get_client

    out = {}
    with get_client(sync_client=True) as client:
        for stage in REMOTE_STAGES:
            name, pool = orch[f"{stage}_deployment"], orch[f"{stage}_pool"]
            try:
                dep = client.read_deployment_by_name(name)
            except Exception as exc:
                raise RuntimeError(f"orchestration.{stage}_deployment={name!r}: no such deployment "
                                   f"({type(exc).__name__}); deploy it with `prefect deploy -n "
                                   f"{name.split('/', 1)[-1]}` from the checkout") from None
            if dep.work_pool_name != pool:
                raise RuntimeError(f"deployment {name} is on work pool {dep.work_pool_name!r}, but "
                                   f"orchestration.{stage}_pool={pool!r}")
            out[stage] = name
    for stage in ON_UPDATE_DEPLOYMENT:
        out[stage] = out["update"]
    return out


# ---- flows ------------------------------------------------------------------------------------
@flow(name="rl-stage", flow_run_name="{stage}-step-{step}")
def stage_flow(stage: str, run_uri: str, step: int, extra: dict | None = None) -> dict:
    """One stage as its own flow run: what the rl-stage/* deployments run on their work pools.
    Its parameters are JSON (the run's URI): the run is opened here from its run.json."""
    from stages.ranks.launch import forget_inherited_rank_env

    forget_inherited_rank_env()
    host = socket.gethostname()
    logger().info(f"{stage} of step {step} on host {host}")
    try:
        run = RunHandle(uri=run_uri)
        cfg, _, store = run.open()
        with Heartbeat(store, RunLayout.from_config(cfg).heartbeat(step, stage), heartbeat_timeout(cfg)):
            return task_result(retrying_stage_task(cfg)(stage, run, step, extra,
                                                                          return_state=True))
    except Exception as exc:  # the driver's error names the host this stage ran on
        raise RuntimeError(f"{stage} of step {step} failed on host {host}: "
                           f"{type(exc).__name__}: {exc}") from exc


def task_result(state) -> dict:
    """A task's summary from its final state (a Cached state carries it as its data). A completed
    state of this process holds its value (or an in-memory ResultRecord): read directly, as
    State.result() would return it but without its trip through Prefect's event loop thread
    (~1 ms a task); anything else (failed, crashed, a persisted result) goes through result()."""
    from prefect._internal.result_records import ResultRecordMetadata
    from prefect.results import ResultRecord
    from prefect.states import State

    while True:
        data = state.data
        if isinstance(data, ResultRecord) and state.is_completed():
            value = data.result
        elif data is None or isinstance(data, ResultRecordMetadata) or not state.is_completed():
            value = state.result()  # failed or crashed (raises), or a result stored elsewhere
        else:
            value = data
        if not isinstance(value, State):
            return value
        state = value


@flow(name="rl-step", flow_run_name="step-{step}")
def rl_step(run: RunHandle, step: int, extra: dict | None = None, publish: bool = True,
            background_publish: bool = False) -> dict:
    """rollout -> logprob and reward side by side -> advantage -> update for one step; {stage: summary}.
    `run` is recorded by Prefect as {"uri": ...} only (flows/run_handle.py); a handle rebuilt from
    that reads run.json. With background_publish and the run's session (the training flow's
    handle), the step's Prefect artifacts are written by the session's publisher thread (attached
    to this flow run) while the caller goes on; closing the session waits for them."""
    cfg, plan, _ = run.open()
    remote = check_stage_deployments(cfg)
    if "logprob" in remote and not getattr(stage_module("logprob"), "runs_on_ranks", lambda p: True)(plan):
        remote.pop("logprob")  # no pass to run on ranks: the old log-probs come with the update
    run_task = retrying_stage_task(cfg)
    session = run.session
    publisher = step_report.background_publisher(session) if background_publish and session else None
    summaries = {}
    side_by_side = SIDE_BY_SIDE if not cfg.get("reward_model", {}).get("enable") else ()
    for stage in STAGES:
        if stage in summaries:
            continue
        if stage in side_by_side:  # both read only the rollout: their task runs overlap
            futures = {s: run_task.submit(s, run, step, extra, remote.get(s)) for s in side_by_side}
            for future in futures.values():
                future.wait()
            for s, future in futures.items():  # both ended before a failure is raised
                summaries[s] = task_result(future.state)
        else:
            summaries[stage] = task_result(run_task(stage, run, step, extra, remote.get(stage),
                                                    return_state=True))
        if publisher is not None and stage == STAGES[0]:
            publisher.start()  # the previous step's artifacts, after the rollout: not beside its
            #                    generate, which Python and CPU work beside it slow the most
    if publish and publisher is not None:
        publisher.submit(run.context(step), summaries)
    elif publish:
        step_report.publish_step(run.context(step), summaries)
    return summaries


def run_step_subflow(run: RunHandle, step: int, extra: dict | None = None) -> dict:
    """rl_step as a subflow of the training flow, its artifacts published in the background
    (see rl_step). The training flow runs its steps inside subflow_heartbeats_off()."""
    return rl_step(run, step, extra, background_publish=True)


def subflow_heartbeats_off():
    """A context in which flow runs started from this thread send no heartbeats: Prefect's flow
    engine joins the heartbeat thread when a flow run ends and that thread sleeps in 1 s slices,
    so every rl-step subflow paid ~0.5-1 s (measured: 1.1 s vs 0.1 s per empty subflow). Entered
    once by the training flow after its own heartbeats started (their thread keeps its interval
    and its copy of the settings), so a crashed run is still detected."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


class _CompletedTaskRunLines(logging.Filter):
    """Drops Prefect's "Finished in state Completed()" record of a task run (and only it: Cached,
    Failed, Crashed and retrying task runs keep their lines)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and record.msg == "Finished in state Completed()")


@contextlib.contextmanager
def completed_stage_lines(cfg: dict):
    """orchestration.log_completed_stages=false: while the training flow runs its steps, the stage
    task runs that complete write no "Finished in state Completed()" line (five a step, each sent
    to the console and to Prefect's API: ~1.5 ms of this process's CPU and an insert by the server
    apiece). Their states are recorded as before; a cached, failed or retried stage is logged."""
    if (cfg.get("orchestration") or {}).get("log_completed_stages", True):
        yield
        return
    task_runs, dropped = logging.getLogger("prefect.task_runs"), _CompletedTaskRunLines()
    task_runs.addFilter(dropped)
    try:
        yield
    finally:
        task_runs.removeFilter(dropped)


def logger():
    try:
        return get_run_logger()
    except Exception:
        return logging.getLogger("stagerl")
