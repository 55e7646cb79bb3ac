"""The training flow `rl-train`: config -> plan -> lock -> run.json -> steps over epochs.

Rerunning an experiment (same config, `stagerl resume`, `prefect flow-run retry`, a new
`prefect deployment run`) continues at the first incomplete stage of the first incomplete step:
complete steps are recognised from their manifests and not re-entered, complete stages of the
current step end as Cached tasks. A config change that would alter finished work is refused
(listing the keys); keys that cannot (configs/changes.py RESUMABLE_PREFIXES) may change between
runs."""
from __future__ import annotations

import gc
import os
import socket
import sys
import time

from prefect import flow

from flows.run_handle import RunHandle
from flows.step import (check_stage_deployments, completed_stage_lines, is_retryable, logger, rl_step,
                        run_step_subflow, step_is_complete, subflow_heartbeats_off)
from flows.task_events import paced_task_events
from configs.changes import changed_keys  # noqa: F401 (tests import it from here)
from configs.local_paths import check_local_paths
from configs.memory import check_fits, check_host_fits, estimate_memory
from configs.plan import check_trainable
from flows.metric_sinks import MetricSinks, check_sinks
from flows.rerun import RunConfigChanged, check_rerun, has_finished_work, run_total  # noqa: F401 (RunConfigChanged: tests)
from flows.step_report import step_metrics
from stages.ranks.launch import forget_inherited_rank_env
from stages.scratch import remove_orphans
from storage.secrets import scrub_override, take_secret_overrides
from stages.session import DeferredCommitError, RunSession
from storage.artifacts import fingerprint, last_committed, read_manifest, read_run_json, write_run_json
from storage.layout import RunLayout
from storage.lineage import delete_tree
from storage.lock import ExperimentLock, process_alive
from storage.store import Store

def resolve(config: str, overrides: list[str], experiment_name: str | None):
    """load_config + make_plan; a refusal raises ConfigError/PlanError with the keys and fixes."""
    from configs.loader import load_config
    from configs.suggest import make_plan

    items = list(overrides or [])
    if experiment_name:
        items.append(f"trainer.experiment_name={experiment_name}")
    cfg = load_config(config, items)
    return cfg, make_plan(cfg)


def check_run_json(store: Store, layout: RunLayout, cfg: dict, plan: dict, source: dict,
                   total: int | None = None, steps_per_epoch: int | None = None) -> dict:
    """Write run.json, or check the existing one first (flows.rerun.check_rerun): a changed key
    that would alter finished work is refused with the list of keys; a changed total extends the
    run when no finished work changes. run.json records the run's total steps and steps per epoch."""
    from storage.secrets import scrub

    old = read_run_json(store, layout)
    check_rerun(store, layout, cfg, total)
    before = (old or {}).get("total_training_steps")
    if before and total and before != total and has_finished_work(store, layout):
        print(f"{layout.base}: {before} -> {total} steps; it continues after its last complete step "
              f"({last_committed(store, layout, 'update')})", flush=True)
    clean = scrub(dict(cfg), store.secret_values)
    kept = {"lineage": old["lineage"]} if old and old.get("lineage") else {}  # a fork's (flows.fork)
    counts = {"total_training_steps": total, "steps_per_epoch": steps_per_epoch} if total else {}
    return write_run_json(store, layout, dict(cfg), extra={"plan": plan, "source": source, **kept, **counts,
                                                           "config_fingerprint": fingerprint(clean)})


def acquire_lock(store: Store, layout: RunLayout, force: bool) -> ExperimentLock:
    """The experiment lock; a lock left by a dead process on this host is taken over."""
    lock = ExperimentLock(store, layout, force=force, owner="rl-train")
    holder = lock.holder()
    if holder and not force and holder.get("host") == socket.gethostname() \
            and holder.get("pid") and not _pid_alive(int(holder["pid"])):
        logger().warning(f"taking over the lock of dead process {holder['pid']} on this host")
        lock.force = True
    return lock.acquire()


def lock_refresh_s(store: Store) -> float:
    """How often the step loop checks and renews the run's lock: a tenth of the time after which
    another writer may take it over (storage.lock_stale_seconds), at most every 30 s (a read and
    a write of the lock object, ~2 ms, each step at small scale otherwise)."""
    return min(30.0, store.lock_stale_seconds / 10)


def _pid_alive(pid: int) -> bool:
    # a lock record with our own pid is from an earlier run in a reused process
    return pid != os.getpid() and process_alive(pid)


# ---- schedule -------------------------------------------------------------------------------
def load_dataset(cfg: dict, store: Store, split: str = "train"):
    """The training prompts (tokenised once: the rollout stage reads the same cached rows)."""
    from stages.data.cache import load_run_dataset

    return load_run_dataset(cfg, split, store)


def trainer_validates(cfg: dict) -> bool:
    trainer = cfg["trainer"]
    return bool(trainer["val_before_train"]) or trainer["test_freq"] > 0


def check_ground_truth(cfg: dict, dataset) -> None:
    """Rows with a null reward_model or reward_model.ground_truth cannot be scored by the built-in
    rule scorers: refuse them at load, naming file and row. A user's reward function
    (custom_reward_function.path) or a reward model may not need it: then only warn."""
    from stages.data.files import GROUND_TRUTH_REFUSED, ground_truth_problem, rows_without_ground_truth

    missing = rows_without_ground_truth(dataset.files, dataset.rows)
    if not missing:
        return
    what = ground_truth_problem(missing, len(dataset.rows), dataset.split)
    if cfg["custom_reward_function"].get("path") or cfg["reward_model"].get("enable"):
        logger().warning(f"{what} (your reward function receives ground_truth=None for them)")
        return
    raise ValueError(f"{what}. {GROUND_TRUTH_REFUSED}")


def total_steps(cfg: dict, steps_per_epoch: int) -> int:
    """trainer.total_training_steps, else total_epochs × steps per epoch (as verl)."""
    return run_total(cfg, steps_per_epoch)


def step_extra(dataset, step: int, total: int) -> dict:
    """What the flow tells a stage about step k (1-based): epoch and dataset position."""
    position = dataset.position_for_step(step - 1)
    return {"epoch": position.epoch, "data_position": position.to_dict(),
            "steps_per_epoch": dataset.steps_per_epoch, "total_training_steps": total}


# ---- weights kept ---------------------------------------------------------------------------
def weights_to_delete(steps: list[int], latest: int, save_freq: int, keep: int | None) -> list[int]:
    """Weights folders to remove after step `latest`: the latest is always kept (the next step
    samples from it); others only at multiples of save_freq (> 0), at most `keep` in all. The
    warm start's step 0 is never removed (it is the reference policy)."""
    saved = [k for k in steps if k != latest and save_freq > 0 and k % save_freq == 0]
    kept = sorted(saved + ([latest] if latest in steps else []))
    if keep is not None and keep > 0 and len(kept) > keep:
        kept = sorted(set(kept[-keep:]) | {latest})
    # the newest complete folder is kept too: while `latest` is still being committed in the
    # background, the step before it is what a resume samples from
    newest = max(steps, default=None)
    return [k for k in steps if k not in kept and k != newest and 0 < k < latest]  # step 0: the warm start (reference)


def prune_weights(store: Store, layout: RunLayout, latest: int, cfg: dict) -> list[int]:
    """Delete the weights folders weights_to_delete names, counting step `latest` as done only
    once its update manifest is written: while the update still commits in the background, a kill
    leaves step `latest` to run again from the step before it, whose weights must still be there."""
    from storage.weights import list_weights

    if read_manifest(store, layout, latest, "update") is None:
        latest -= 1
    trainer = cfg["trainer"]
    doomed = weights_to_delete(list_weights(store, layout), latest, int(trainer["save_freq"]),
                               trainer.get("max_actor_ckpt_to_keep"))
    for k in doomed:  # a fork that references the folder gets a copy first
        delete_tree(store, layout.weights(k))
    return doomed


PRUNE = "prune-weights"


def prune_in_background(session, store: Store, layout: RunLayout, latest: int, cfg: dict) -> None:
    """prune_weights in the session's background thread (after the previous prune has ended), off
    the step's critical path (a listing and a folder's removal, 2-4 ms a step at small scale),
    at trainer.staleness 0 from when the next compute starts (RunSession.compute_starts: the next
    generation). A
    prune that fails is reported and done again by the next one; finish_run prunes once more
    after the last commit."""
    at_compute = not int(cfg["trainer"].get("staleness") or 0)  # pipelined steps: at once, as the commit
    session.start_background(PRUNE, lambda: prune_weights(store, layout, latest, cfg), at_compute=at_compute)


# ---- logging --------------------------------------------------------------------------------
def validate(run: RunHandle, step: int, extra: dict) -> dict | None:
    """Validation: stages.rollout.generate_validation(ctx) rows, scored by the reward functions;
    returns verl's val/test_score/{data_source} means."""
    from flows.step import stage_module

    fn = getattr(stage_module("rollout"), "generate_validation", None)
    if fn is None:
        logger().warning("validation requested but the rollout stage has no generate_validation")
        return None
    ctx = run.context(step + 1, extra)  # samples the policy after `step` (0: initial)
    rows = fn(ctx) or []
    if not rows:
        return {}
    import pyarrow as pa

    from stages.reward import reward_fn_spec, scoring_rows
    from stages.scoring.pool import in_process, score_batch

    key = ctx.get("data.reward_fn_key", "data_source")
    spec = reward_fn_spec(ctx)  # the reward stage's: the same function, kwargs and pool
    workers, timeout = int(ctx.get("reward.num_workers", 2)), float(ctx.get("reward.timeout_s", 10.0))
    pool = ctx.session.scorers(spec, workers, timeout) if ctx.session is not None and not in_process(spec, workers) else None
    results, _ = score_batch(scoring_rows(pa.Table.from_pylist(rows), key), spec,
                             num_workers=workers, timeout_s=timeout, pool=pool)
    by_source: dict = {}
    for row, result in zip(rows, results):
        by_source.setdefault(row.get(key), []).append(float(result["score"]))
    return {f"val/test_score/{src}": sum(v) / len(v) for src, v in sorted(by_source.items())}


# ---- the flow -------------------------------------------------------------------------------
@flow(name="rl-train", log_prints=True)
def train(config: str = "base", overrides: list[str] = [], experiment_name: str | None = None,
          force_lock: bool = False, fork: dict | None = None, secret_overrides: str | None = None) -> dict:
    """Train (or resume) one experiment: steps over epochs, each a `rl-step` subflow
    (flows.step.run_step_subflow), or with orchestration.step_subflow=false its stage tasks
    directly in this flow run. With `fork` ({"source": SRC, "at": "STEP:STAGE"}) the experiment
    is first made a fork of SRC (flows.fork): its config is SRC's followed by `overrides`.
    `secret_overrides` is the token for the credential overrides `stagerl train` holds in its
    process (storage.secrets.held_secret_overrides), never their values: Prefect stores parameters."""
    forget_inherited_rank_env()
    collecting = gc.isenabled()
    gc.disable()  # the start-up and step 1 without automatic collections (freeze_heap: on again)
    config, overrides, fork = run_arguments(config, overrides, fork, secret_overrides)
    cfg, plan = resolve(config, overrides, experiment_name)
    store, layout = check_before_start(cfg, plan)
    lock = acquire_lock(store, layout, force_lock)
    session, sinks, run, total = new_session(cfg), None, None, 0  # resident workers, background commits
    try:
        session.spawner = start_fork_server(cfg, plan)  # first: its imports overlap the set-up below
        if fork:  # NEW references SRC's finished work up to the fork point
            from flows.fork import create_fork

            create_fork(store, cfg, plan, fork, force_lock)
        dataset, total = load_schedule(cfg, store)
        nothing = check_rerun(store, layout, cfg, total)  # a total at or below the steps done
        if nothing:
            print(nothing, flush=True)
            return {"run": store.url(layout.base), "total_steps": total, "steps_skipped": [],
                    "steps_run": [], "last_metrics": {}, "nothing_to_run": nothing}
        check_run_json(store, layout, cfg, plan,
                       {"config": config, "overrides": [scrub_override(o, store.secret_values) for o in overrides],
                        "experiment_name": experiment_name}, total, dataset.steps_per_epoch)
        sinks = MetricSinks(cfg, store.secret_values)
        run = RunHandle.of(cfg, plan, store, session)  # passed to the steps and their tasks
        print(f"run {run.uri}: {total} steps ({dataset.steps_per_epoch} per epoch), "
              f"{plan['rows_per_step']} rows per step", flush=True)
        name_flow_run(store, layout, total, fork)
        pipelined = int(cfg["trainer"].get("staleness") or 0) > 0  # steps overlap: no window between computes
        with completed_stage_lines(cfg), paced_task_events(cfg, None if pipelined else session) as events:
            run.events = events  # released where a stage computes, or where a rollout or update starts
            before_first_step(run, cfg, plan, dataset, total, sinks)
            done, ran, last = run_steps(run, cfg, store, layout, dataset, total, sinks, lock)
        return finish_run(run, cfg, store, layout, total, done, ran, last)
    except BaseException as exc:
        failed_commit = session.commit_error() if isinstance(exc, Exception) else None
        if run is not None:
            keep_last_state(run, store, layout, total)
        if failed_commit is not None and not isinstance(exc, DeferredCommitError):
            failed_commit.add_note(f"after it: {type(exc).__name__}: {exc}")
            raise failed_commit  # the root cause is reported last, not what failed after it
        raise
    finally:
        close_run(session, sinks, lock)
        if collecting:  # a caller that collected (not `stagerl train`'s start-up) still does
            gc.enable()


def run_name(store: Store, layout: RunLayout, total: int, fork: dict | None = None) -> str:
    """What a run is called in the Prefect UI: its experiment and the steps it runs
    ("tour · steps 1-5"), "(resume)" when earlier steps are done, "(fork of SRC at STEP:STAGE)"."""
    first = last_committed(store, layout, "update") + 1
    name = (f"{layout.experiment} · steps {first}-{total}" if first <= total
            else f"{layout.experiment} · steps 1-{total} done")
    if fork:
        return f"{name} (fork of {fork['source']} at {fork['at']})"
    return f"{name} (resume)" if 1 < first <= total else name


def name_flow_run(store: Store, layout: RunLayout, total: int, fork: dict | None) -> None:
    """Rename this flow run (Prefect gives it a random one) after run_name, so a list of runs
    says which experiment and steps each was."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    name = run_name(store, layout, total, fork)
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=name)
    except Exception as exc:  # noqa: BLE001 - a name is not worth failing a run for
        logger().warning(f"could not name the flow run {name!r} ({type(exc).__name__}: {exc})")


def keep_last_state(run: RunHandle, store: Store, layout: RunLayout, total: int) -> None:
    """A run that fails or is stopped before its last step stores the train state its ranks kept
    after its last committed update (stages/update.py::store_kept_state), so that its resume
    replays no update. Best effort: what cannot be stored is replayed by the resume."""
    from stages.update import store_kept_state
    try:
        run.session.wait_commits()
    except Exception:  # noqa: BLE001 - an uncommitted update is run again by the resume
        pass
    try:
        step = last_committed(store, layout, "update")
        if step and store_kept_state(run.context(step, {"total_training_steps": total})):
            print(f"stored the train state of step {step} (kept by the ranks) before stopping", flush=True)
    except Exception as exc:  # noqa: BLE001 - the run's own error is reported, not this one
        logger().warning(f"could not store the last train state ({type(exc).__name__}: {exc}); "
                         f"a resume replays the updates since the newest stored one")


def run_arguments(config: str, overrides: list, fork: dict | None, secret_overrides: str | None):
    """(config, overrides, fork) the run resolves: the overrides with the held credentials added
    and, for a fork, SRC's config followed by them (flows.fork.fork_arguments)."""
    held = take_secret_overrides(secret_overrides)
    if held is None:  # e.g. a flow run retried from Prefect: this process holds none
        logger().warning("the credential overrides of this run are held by the process that started it, "
                         "not this one: credentials come from this process's environment")
    overrides = list(overrides or []) + (held or [])  # `stagerl train` credentials
    if fork:
        from flows.fork import fork_arguments

        fork = {**fork, "overrides": [scrub_override(o) for o in fork.get("overrides") or overrides]}
        config, overrides = fork_arguments(config, overrides, fork)
    return config, list(overrides or []), fork


def check_before_start(cfg: dict, plan: dict) -> tuple[Store, RunLayout]:
    """Refuse what cannot run before anything starts; (store, layout) of the run."""
    check_trainable(cfg)
    check_local_paths(cfg)  # a deployment run's worker: its own working directory
    estimate = estimate_memory(cfg, plan)
    check_fits(cfg, estimate)  # each stage's estimated peak fits the device
    check_host_fits(cfg, plan, estimate)  # the CPU: engines and ranks in this host's memory
    for folder in remove_orphans():  # scratch folders of killed runs on this host (stages.scratch)
        print(f"removed {folder}: left by a process that is gone", flush=True)
    store = Store.from_config(cfg["storage"])
    layout = RunLayout.from_config(cfg)
    for warning in cfg.warnings:
        logger().warning(warning)
    check_stage_deployments(cfg)  # multi-pool mode: refuse missing/misplaced deployments first
    check_sinks(cfg)  # trainer.logger: known and installed, before anything starts
    return store, layout


def new_session(cfg: dict) -> RunSession:
    orch = cfg["orchestration"]
    return RunSession(retries=int(orch.get("storage_retries", 5)), retry_delay_s=float(orch.get("retry_delay_s", 2.0)),
                      retryable=is_retryable)


def load_schedule(cfg: dict, store: Store):
    """(training dataset, total steps); the ground truth of the training (and validation) rows checked."""
    dataset = load_dataset(cfg, store)
    check_ground_truth(cfg, dataset)
    if trainer_validates(cfg):
        check_ground_truth(cfg, load_dataset(cfg, store, "val"))
    return dataset, total_steps(cfg, dataset.steps_per_epoch)


def before_first_step(run: RunHandle, cfg: dict, plan: dict, dataset, total: int, sinks: MetricSinks) -> None:
    """The rank pool (starting in the background), the warm start (step 0), validation before
    training, the first update's DeepSpeed set-up and the rollout engines; none of it when every
    step is already complete (a rerun of a finished run has nothing to run)."""
    if total >= 1 and step_is_complete(run.context(total, step_extra(dataset, total, total))):
        return
    session = run.session
    session.rank_pool = start_rank_pool(cfg, plan, session.spawner)  # in the background too
    if (cfg.get("warmstart") or {}).get("enable"):  # stages.model.warmstart: step 0, once, resumable
        from flows.step import retrying_stage_task, task_result

        task_result(retrying_stage_task(cfg)(
            "warmstart", run, 0, step_extra(dataset, 1, total), return_state=True))
    if cfg["trainer"]["val_before_train"] and not _first_done(run, total, dataset):
        _log_validation(sinks, 0, validate(run, 0, step_extra(dataset, 1, total)))
    if session.rank_pool is not None:  # the first update's DeepSpeed set-up, beside the first rollout
        prepare_update(session.rank_pool.submit_background, run, dataset, total)
    if cfg["orchestration"]["mode"] == "local":  # rollout runs in this process's session: start its engines now
        from flows.step import stage_module  # (workers in the background; hf in this process here)

        warm = getattr(stage_module("rollout"), "warm_up", None)
        if warm is not None:
            warm(run.context(1, step_extra(dataset, 1, total)))
        if session.rank_pool is None and plan["n_gpus"] == 1 and engines_elsewhere(session):
            prepare_update(in_process_prepare(session), run, dataset, total)


def engines_elsewhere(session) -> bool:
    """True when the run's rollout engines are worker processes (vLLM, several replicas, an hf
    engine in its own process): this process then idles while a rollout samples."""
    engines = session.engines()
    return engines.local is None and bool(engines.workers)


def in_process_prepare(session):
    """At one rank without a rank pool (no fork server: vLLM's workers, a GPU) the update trains in
    this process (stages.ranks.launch.run_ranks): its first DeepSpeed set-up runs in a thread of
    it, beside the first rollout, and the first update waits for it. Only where the rollout
    engines are elsewhere: an hf engine here seeds torch's global
    generator while it samples, and the kept engine's RNG state must be the one a set-up in line
    would leave."""
    from stages.ranks.launch import IN_PROCESS_PREPARE

    def submit(module: str, ctx) -> None:
        import importlib

        session.start_background(IN_PROCESS_PREPARE, lambda: importlib.import_module(module).rank_main(ctx, 0, 1))
    return submit


def run_steps(run: RunHandle, cfg: dict, store: Store, layout: RunLayout, dataset, total: int,
              sinks: MetricSinks, lock: ExperimentLock) -> tuple[list, list, dict]:
    """Steps 1..total: a complete one is skipped (its metrics logged again), the others run.
    (steps skipped, steps run, the last step's metrics)."""
    trainer, orch = cfg["trainer"], cfg["orchestration"]
    if int(trainer.get("staleness") or 0) > 0:
        return run_steps_pipelined(run, cfg, store, layout, dataset, total, sinks, lock)
    done, ran, last = [], [], {}
    with subflow_heartbeats_off():  # the steps' subflows (flows.step)
        for step in range(1, total + 1):
            t0 = time.perf_counter()  # timing_s/step: the whole iteration except validation
            lock.refresh(lock_refresh_s(store))
            extra = step_extra(dataset, step, total)
            ctx = run.context(step, extra)
            if step_is_complete(ctx):
                done.append(step)
                last = step_metrics(ctx)
                sinks.log(step, last)
                continue
            summaries = (run_step_subflow(run, step, extra) if orch["step_subflow"]
                         else rl_step.fn(run, step, extra, background_publish=True))
            last = step_metrics(ctx, summaries)
            if not ran:
                freeze_heap()
            ran.append(step)
            prune_in_background(run.session, store, layout, step, cfg)
            last["timing_s/step"] = round(time.perf_counter() - t0, 3)
            sinks.log(step, last)
            if trainer["test_freq"] > 0 and (step % trainer["test_freq"] == 0 or step == total):
                _log_validation(sinks, step, validate(run, step, extra))
    return done, ran, last


def run_steps_pipelined(run: RunHandle, cfg: dict, store: Store, layout: RunLayout, dataset, total: int,
                        sinks: MetricSinks, lock: ExperimentLock) -> tuple[list, list, dict]:
    """trainer.staleness = s >= 1: the steps' stage task runs in two chains, in this flow run.
    The rollout chain runs step j's rollout and then its reward (and its logprob and advantage
    where they need no current policy: `rollout_chain`) as soon as the weights it samples (after
    update j-1-s) exist and step j-1's rollout has ended (one engine); the trainer chain runs step
    k's other stages and its update once step k's rollout chain and step k-1's update have ended.
    So step k+1's rollout samples while step k trains, and every result is a function of the step
    numbers, never of which chain was faster: the same seed gives the same weights, and a resume
    (complete stages are Cached) gives what an uninterrupted run gives. Each step's metrics add
    timing_s/overlap: the seconds its rollout chain ran beside step k-1's trainer chain. (steps
    skipped, steps run, the last step's metrics)"""
    from flows import step_report
    from flows.step import check_stage_deployments, retrying_stage_task, stage_module, task_result
    from storage.layout import STAGES

    s, trainer = int(cfg["trainer"]["staleness"]), cfg["trainer"]
    remote = check_stage_deployments(cfg)
    passes = getattr(stage_module("logprob"), "runs_on_ranks", lambda p: True)(run.open()[1])
    if "logprob" in remote and not passes:
        remote.pop("logprob")
    chain = rollout_chain(passes)
    run_task = retrying_stage_task(cfg)
    publisher = step_report.background_publisher(run.session)
    restore_threads = training_threads_beside_engine(cfg, run.open()[1])
    ahead: dict = {}  # step -> {stage: future} of its rollout chain
    submitted = 0  # the last step whose rollout chain is submitted
    trained: dict = {}  # step -> (start, end) of its trainer chain (wall clock)
    done, ran, last = [], [], {}

    def submit_through(j_max: int) -> None:
        nonlocal submitted
        while submitted < min(j_max, total):
            j = submitted + 1
            extra_j = step_extra(dataset, j, total)
            before = ahead.get(j - 1, {}).get("rollout")
            futures = {"rollout": run_task.submit("rollout", run, j, extra_j, remote.get("rollout"),
                                                  wait_for=[before] if before is not None else None)}
            for stage in chain[1:]:  # each after the stages of this step it reads (stages' INPUTS)
                needs = [futures[i] for i in getattr(stage_module(stage), "INPUTS", tuple(futures)) if i in futures]
                futures[stage] = run_task.submit(stage, run, j, extra_j, remote.get(stage), wait_for=needs)
            ahead[j] = futures
            submitted = j

    def drain() -> None:  # every submitted rollout chain ended (before validation, or a failure is raised)
        for futures in ahead.values():
            for future in futures.values():
                future.wait()

    try:
        for step in range(1, total + 1):
            t0 = time.perf_counter()
            lock.refresh(lock_refresh_s(store))
            extra = step_extra(dataset, step, total)
            ctx = run.context(step, extra)
            if step not in ahead and step_is_complete(ctx):
                done.append(step)
                submitted = max(submitted, step)
                last = step_metrics(ctx)
                sinks.log(step, last)
                continue
            submit_through(step + s)  # the weights after update step-1 exist: rollouts up to step+s may sample
            futures = ahead.pop(step)
            futures["rollout"].wait()
            summaries = {"rollout": task_result(futures["rollout"].state)}
            publisher.start()  # the previous step's artifacts, beside this step's training
            t_train = None
            for stage in STAGES[1:]:  # the rollout chain's results in stage order, the rest run here
                if stage in futures:
                    futures[stage].wait()
                    summaries[stage] = task_result(futures[stage].state)
                else:
                    t_train = t_train or time.time()
                    summaries[stage] = task_result(run_task(stage, run, step, extra, remote.get(stage),
                                                            return_state=True))
            trained[step] = (t_train, time.time())
            overlap = chain_overlap(summaries, trained.get(step - 1), step, s, chain)
            if overlap:
                summaries["overlap"] = overlap
            publisher.submit(run.context(step), summaries)
            last = step_metrics(ctx, summaries)
            if overlap:
                last["timing_s/overlap"] = overlap["seconds"]
            if not ran:
                freeze_heap()
            ran.append(step)
            prune_in_background(run.session, store, layout, step - s, cfg)  # rollouts up to step+1+s sample the weights after step-s on
            last["timing_s/step"] = round(time.perf_counter() - t0, 3)
            sinks.log(step, last)
            if trainer["test_freq"] > 0 and (step % trainer["test_freq"] == 0 or step == total):
                drain()  # the engine is the rollout chain's: validation samples once it is idle
                _log_validation(sinks, step, validate(run, step, extra))
    except BaseException:
        drain()  # no rollout left sampling while the run closes its engines
        raise
    finally:
        restore_threads()
    return done, ran, last


def rollout_chain(passes: bool) -> tuple:
    """The stages of a pipelined step (trainer.staleness >= 1) that run in its rollout chain, as
    soon as its rollout has ended, beside the previous step's training: the reward, and, where the
    logprob stage runs no forward pass (`passes` False: the old log-probs come from the update's
    own forward), the logprob and the advantage too, which then read nothing that the previous
    update changes. The trainer chain runs the rest (a logprob pass needs the current weights, the
    advantage its output) and the update."""
    return ("rollout", "reward") if passes else ("rollout", "logprob", "reward", "advantage")


def training_threads_beside_engine(cfg: dict, plan: dict):
    """Pipelined steps at one rank on the CPU, the engine unpinned: the update trains in this
    process while the engine samples in its own, so this process's torch threads take the
    training's share of the cores (stages.engines.split_cores; the engine takes the other).
    Returns what puts the thread count back."""
    import torch

    rollout = cfg["actor_rollout_ref"]["rollout"]
    if plan["n_gpus"] != 1 or str(cfg["trainer"]["device"]) != "cpu" or rollout.get("cpu_affinity"):
        return lambda: None
    before = torch.get_num_threads()
    torch.set_num_threads(training_threads(cfg, plan, staleness=1))
    return lambda: torch.set_num_threads(before)


def training_threads(cfg: dict, plan: dict, staleness: int | None = None) -> int:
    """The torch threads a one-rank CPU update trains with: this process's, or, where it trains
    while an unpinned engine samples (trainer.staleness > 0), the training's share of the cores
    (stages.engines.split_cores; the engine takes the other)."""
    import torch

    from stages.engines import available_cores, split_cores

    s = int(cfg["trainer"].get("staleness") or 0) if staleness is None else staleness
    ours = torch.get_num_threads()
    if s > 0 and plan["n_gpus"] == 1 and not cfg["actor_rollout_ref"]["rollout"].get("cpu_affinity"):
        return min(ours, split_cores(available_cores())[1])
    return ours


def chain_overlap(summaries: dict, trained: tuple | None, step: int, staleness: int,
                  chain: tuple = ("rollout", "reward")) -> dict | None:
    """Seconds step `step`'s rollout chain (`chain`'s stages as they ran: summaries' started_at
    and seconds; side by side ones counted once) spent beside step-1's trainer chain (`trained`:
    its wall-clock start and end), and that as a share of the chain; None when either did not
    run now."""
    if not trained:
        return None
    start, end = trained
    beside, reached = 0.0, start
    spans = sorted((s["started_at"], s["started_at"] + s["seconds"]) for s in (summaries.get(n) or {} for n in chain)
                   if s.get("started_at") is not None and s.get("seconds") is not None)
    for a, b in spans:  # the union of the spans within [start, end]
        a, b = max(a, reached), min(b, end)
        if b > a:
            beside, reached = beside + b - a, b
    return {"seconds": round(beside, 3), "share": beside / max(end - start, 1e-9), "chain": list(chain),
            "policy_version": max(0, step - 1 - staleness), "staleness": step - 1 - max(0, step - 1 - staleness)}


def finish_run(run: RunHandle, cfg: dict, store: Store, layout: RunLayout, total: int, done: list,
               ran: list, last: dict) -> dict:
    """Wait for the last update's commit (the run is done once it is in the store), prune the
    weights folder kept while it committed; the flow's result."""
    run.session.wait_commits()
    run.session.join_background(PRUNE)
    if ran:
        prune_weights(store, layout, ran[-1], cfg)
    return {"run": run.uri, "total_steps": total, "steps_skipped": done, "steps_run": ran,
            "last_metrics": last}


def close_run(session: RunSession, sinks: MetricSinks | None, lock: ExperimentLock) -> None:
    """Close the rank pool, the session and the sinks, then release the lock (also while the run
    fails: its error is then reported last)."""
    if session.rank_pool is not None:
        session.rank_pool.close()
    session.close()
    try:
        if sinks is not None:
            sinks.close()
    finally:
        release_lock(lock, failing=sys.exc_info()[0] is not None)


def release_lock(lock: ExperimentLock, failing: bool) -> str | None:
    """Release the run's lock. When that fails too while the run is `failing` (the store is
    down), say so in one line and let the run's own error (the stage that failed) be reported
    last; a lock left behind is taken over once stale or when its process is gone."""
    try:
        lock.release()
        return None
    except Exception as exc:  # noqa: BLE001 - the run's own error is already on its way
        if not failing:
            raise
        warning = (f"could not release the experiment lock ({type(exc).__name__}: {exc}); it is "
                   f"taken over once stale (storage.lock_stale_seconds) or its process is gone")
        logger().warning(warning)
        return warning


def freeze_heap() -> None:
    """After the first step: collect once, then gc.freeze() what is alive (torch, transformers,
    Prefect, ~500 k objects), so Python's automatic full collections scan only what later steps
    create instead of pausing ~0.3 s inside a step (stages.ranks.server does the same per job),
    and turn automatic collections on. The start-up ran without them (`stagerl train` from its
    first import, train() from its call): the imports of torch, transformers, Prefect and
    DeepSpeed spent ~20 % of their CPU in collections that found next to nothing (4.7 s -> 3.8 s
    on this machine); what the start-up left is collected here, once."""
    gc.collect()
    gc.freeze()
    gc.enable()


def start_fork_server(cfg: dict, plan: dict):
    """The run's fork server (stages.ranks.zygote) when it has CPU processes to fork (zygote.wanted):
    the one its launcher started before Prefect (`stagerl train`), else a new one; else None."""
    from stages.ranks import zygote

    if not zygote.wanted(cfg, plan):
        return None
    return zygote.Zygote.adopt(zygote.preload(cfg, plan["n_gpus"])) or zygote.start_for(cfg, plan["n_gpus"])


def start_rank_pool(cfg: dict, plan: dict, spawner=None):
    """One long-lived group of ranks for the whole run (stages.ranks.pool): logprob and update of
    every step reuse it instead of paying a torchrun launch and a DeepSpeed set-up each time. Each
    rank is a process of the pool and keeps its DeepSpeed engine for the run (stages.training.worker).
    With trainer.launcher=deepspeed and a trainer.hostfile the pool's ranks are started once over
    the hostfile's machines by DeepSpeed's launcher (stages.ranks.server's multi-node mode).
    At one rank on the CPU with a fork server (the rollout engine is a forked worker: pinned, or
    trainer.staleness > 0) the one rank is forked from it too, on the cores the engine was not
    pinned to (`training_cpus`) with the threads it would have trained with (`training_threads`,
    at most one per core): this process then imports neither
    transformers nor DeepSpeed, and the first update's set-up runs in the rank beside the first
    rollout instead of in a thread here (measured: its wait 1.3 s -> 0.01 s). Else one rank trains
    in this process (None)."""
    world = plan["n_gpus"]
    trainer = cfg["trainer"]
    hostfile = trainer.get("hostfile") if trainer.get("launcher") == "deepspeed" else None
    if world < 1 or cfg["orchestration"]["mode"] != "local" or (trainer.get("launcher") == "deepspeed"
                                                                and hostfile is None):
        return None
    from stages.ranks.pool import RankPool
    from stages.ranks.zygote import forks_one_rank

    if world == 1 and (spawner is None or not forks_one_rank(cfg, plan)):
        return None  # the one rank trains in this process (stages.ranks.launch.run_ranks)

    threads, cpus = 1, None
    if world == 1:  # this process's cores but a pinned engine's, at most one training thread each
        cpus = training_cpus(cfg)
        threads = min(training_threads(cfg, plan), len(cpus))
    pool = RankPool(world, str(trainer["device"]), hostfile=hostfile, spawner=spawner, threads=threads, cpus=cpus,
                    heartbeat_timeout_s=float(cfg["orchestration"]["rank_heartbeat_timeout_s"]),
                    start_timeout_s=float(cfg["orchestration"]["rank_start_timeout_s"]))
    pool.start(wait=False)  # the ranks start while the first rollout runs; the first job waits
    return pool


def training_cpus(cfg: dict) -> tuple:
    """The cores a one-rank update forked beside the rollout engine trains on: this process's,
    less those the engine is pinned to (`actor_rollout_ref.rollout.cpu_affinity`) where any are
    left. The engine and the rank then each have cores of their own (before, a run that pinned
    only its engine forked the rank onto the engine's core too, with a thread per core), and this
    process, which only orchestrates (Prefect's task runs, the reward, the stages' tables), may use
    any of them (bench/async.py --flow-cpus: BENCHMARKS.md). `actor_rollout_ref.actor.cpu_affinity`
    names the rank's cores instead, any of the machine's: with the engine's, they split it between
    the two while this process runs beside the engine (bench/async.py --flow-cpus engine)."""
    from stages.ranks.zygote import engine_cpus

    chosen = cfg["actor_rollout_ref"]["actor"].get("cpu_affinity")
    if chosen:
        return tuple(sorted({int(c) for c in chosen}))
    ours = set(os.sched_getaffinity(0))
    return tuple(sorted(ours - set(engine_cpus(cfg, 1)) or ours))


def prepare_update(submit, run: RunHandle, dataset, total: int) -> None:
    """Submit (`submit(module, ctx)`: in the background) stages.training.worker's prepare job for
    the first step whose update has not run: the ranks build its engines (and load the previous
    state) while that step's rollout runs."""
    from flows.step import stage_is_complete

    for step in range(1, total + 1):
        ctx = run.context(step, step_extra(dataset, step, total))
        if not stage_is_complete(ctx, "update"):
            ctx.extra["prepare_only"] = True
            submit("stages.training.worker", ctx)
            return


def _first_done(run: RunHandle, total: int, dataset) -> bool:
    """True when step 1 is already complete (a resumed run does not validate before training again)."""
    if total < 1:
        return True
    return step_is_complete(run.context(1, step_extra(dataset, 1, total)))


def _log_validation(sinks: MetricSinks, step: int, metrics: dict | None) -> None:
    if metrics:
        sinks.log(step, metrics)
