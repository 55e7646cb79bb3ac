"""update stage: PPO actor (+ critic) training on the step's rows as a DeepSpeed ZeRO job over the
plan's world (verl: dp_actor.py/dp_critic.py update_policy/update_critic, core_algos.py losses). The
ranks (stages.training.worker) train and hand the new weights to the rollout engine in memory
(stages.training.handoff); this process then commits, in the background when the run has a session:

  weights/step_{k:06d}                          the actor as an HF folder (in the rollout dtype:
                                               fp32 on a CPU) that step k+1 samples from, written
                                               and hashed by the background writer
  weights/critic_step_{k:06d}                   the critic (PPO) as an HF folder
  train_state/step_{k:06d}/actor, .../critic   DeepSpeed checkpoint (module, optimizer partitions,
                                               RNG per rank), every trainer.save_freq steps and at
                                               the last step (stages.training.state)
  steps/{k}/update/metrics.json, microbatches.parquet   then the manifest (written last)

microbatches.parquet holds the update ranks' micro-batches (role actor / critic, every epoch) and
the logprob stage's (role logprob/actor, logprob/ref, logprob/critic; epoch 0, no mini-batch), read
from the logprob manifest, so one table has the step's whole batching picture.

Order and resume: the weights and state are stored before the manifest, so a crash leaves the stage
incomplete and a rerun of step k restores the newest stored train state and replays the updates of
the steps after it from their stored rows (stages.training.worker.restore_job): the same weights,
bit for bit. The learning rate is a function of the step (stepped once per training step, as verl),
so it needs no saved scheduler. Multi-node: the ranks write checkpoints into a local work folder,
which must then be on a shared file system (single-node runs need nothing).
"""
from __future__ import annotations

import shutil
import time
from functools import partial
from pathlib import Path

from stages.batches.batching import format_load_line
from stages.ranks.files import fetch_shipped
from stages.scratch import scratch_dir
from stages.training import forward_values
from stages.training.state import TOTAL_KEY, TRAIN_CONFIG_KEYS, prune_states, schedule_keys, state_key
from storage.artifacts import read_manifest, write_stage
from storage.faults import maybe_fault
from storage.schemas import make_table
from storage.weights import adopt_folder, folder_hashes, save_folder, save_weights

STAGE = "update"
INPUTS = ("rollout", "logprob", "advantage")
CONFIG_KEYS = TRAIN_CONFIG_KEYS + (TOTAL_KEY,)  # what it reads: the total for the schedule and the last state


def stage_fingerprint(ctx) -> str:
    """ctx.fingerprint over the keys that shape the update: the run's total steps only when a
    learning-rate schedule depends on it (stages.training.state.schedule_keys), so extending a run
    with a constant schedule leaves its finished updates (and the rollouts after them) complete."""
    keys = TRAIN_CONFIG_KEYS + ((TOTAL_KEY,) if schedule_keys(ctx.cfg) else ())
    return ctx.fingerprint(STAGE, keys, INPUTS)


def run(ctx) -> dict:
    """Train on N ranks, hand the new weights to the rollout engine, then commit. With a run
    session the commit (the weights version written and hashed, the train state when due, metrics,
    manifest) runs in the background, overlapping the next step's rollout, which samples from the
    weights the engine already holds (stages.training.handoff); see commit_later."""
    from stages.ranks.launch import run_ranks

    t0 = time.perf_counter()
    world = ctx.plan["n_gpus"]
    roles = ["actor"] + (["critic"] if ctx.plan.get("critic") else [])
    work = scratch_dir("update", f"{ctx.step:06d}-")
    handoff = _plan_handoff(ctx, world)
    if handoff is not None and ctx.session is not None:
        ctx.session.wait_commits()  # a previous version's writer never reads tensors being replaced
    try:
        ctx.extra["update_work_dir"] = str(work)
        ctx.extra["handoff"] = handoff
        t1 = time.perf_counter()
        results = run_ranks("stages.training.worker", ctx, world, device=ctx.get("trainer.device") or "cpu",
                            timeout_s=float(ctx.extra.get("update_timeout_s", 3600)))
        fetch_shipped(ctx, work, STAGE, results)  # files of ranks on other machines (no shared disk)
        t2 = time.perf_counter()
        if handoff is not None:
            _finish_handoff(ctx, handoff, results)
        maybe_fault(STAGE, "after_train", ctx.step)  # trained and handed over, nothing stored yet
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        if handoff is not None:
            shutil.rmtree(handoff["dir"], ignore_errors=True)
        raise
    finally:
        ctx.extra.pop("handoff", None)
    commit = partial(_commit, ctx, work, results, roles, world, t0, t2 - t1, handoff=handoff)
    if ctx.session is None or not ctx.get("orchestration.background_commit", True):
        return commit()
    return commit_later(ctx, work, results, commit, launch_s=t2 - t1, handoff=handoff)


def _plan_handoff(ctx, world: int) -> dict | None:
    """How this step's weights reach the rollout engine (stages.training.handoff.mode), the folder
    that holds the version's files meanwhile and the dtype it is served in; None: the export."""
    from stages.training import handoff as ho

    how = ho.mode(ctx, world)
    if how is None:
        return None
    folder = ho.shm_dir(f"{ctx.step:06d}-version-") if how == "folder" else scratch_dir("update", f"{ctx.step:06d}-v-")
    return {"mode": how, "dir": str(folder), "version": ctx.weights_version(ctx.step),
            "dtype": str(ho.persist_dtype(ctx)).removeprefix("torch.")}


def _finish_handoff(ctx, handoff: dict, results: list) -> None:
    """A folder handoff: the flow's engines load the version rank 0 wrote. Records handoff_s,
    from the end of the last optimizer step to every started engine holding the version."""
    from stages.engines import VERSION_FILE

    done = results[0]["handoff"]
    if handoff["mode"] == "folder":
        ctx.session.engines().take_folder(handoff["dir"], handoff["version"])
        handoff["handoff_s"] = time.time() - done["trained_at"]
    else:
        handoff["handoff_s"] = done["handoff_s"]
    if not (Path(handoff["dir"]) / VERSION_FILE).exists():
        raise RuntimeError(f"update of step {ctx.step}: the version folder {handoff['dir']} was not written")


def commit_later(ctx, work: Path, results: list, commit, launch_s: float, handoff=None) -> dict:
    """Hand the commit to the session's background thread and return what the step needs now:
    the new weights are already in the rollout engine (handoff), or the exported actor is hashed
    and moved into the local weights cache first; ctx.actor_weights of step k+1 finds the version
    folder through the session. At trainer.staleness >= 1 the first rollout to sample from this
    version (step k+1+s) starts after this update, so the export is hashed and moved in the commit
    instead, off the trainer's critical path (2.1 s a step at Qwen2.5-0.5B's size: bench/handoff.py),
    and that reader waits for the commit. The stage's metrics are returned at once. The next rollout waits
    for this commit before writing its own manifest, so a committed step k+1 always has a
    committed update k; a crash before the commit leaves update k incomplete and a resume runs it
    again (from the newest stored train state, replaying the updates after it). At staleness 0 the
    commit's thread starts when the next step's generation does (RunSession.compute_starts), so
    its Python does not slow the short stages before it."""
    fingerprint = stage_fingerprint(ctx)
    if handoff is not None:
        local, hashes = Path(handoff["dir"]), None
    elif ctx.staleness():  # no rollout reads this version before the commit: hashed there
        local, hashes = None, None  # (its first reader waits for it: StageContext._load_weights)
    else:
        cache = ctx.store.cache_dir
        hashes = folder_hashes(work / "actor_hf")
        local = adopt_folder(work / "actor_hf", hashes[1], cache) or Path(cache) / "folders" / hashes[1]
    mismatch = engine_mismatch(ctx, results)  # once: the commit's metrics reuse it
    ctx.session.defer(STAGE, ctx.step, fingerprint, partial(commit, actor_hashes=hashes, mismatch=mismatch),
                      local_weights=local, at_compute=not ctx.staleness())
    metrics = build_metrics(results, launch_s=launch_s, upload_s=0.0, handoff=handoff)
    metrics.update(mismatch)
    scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {"stage": STAGE, "step": ctx.step, "fingerprint": fingerprint, "row_count": rows_trained(results),
            "files": {},
            "timings": {}, "extra": {"metrics": scalars, "committing": "in the background"}}


def _persist_version(ctx, handoff: dict) -> tuple[Path, tuple]:
    """The handed-over version into the local weights cache, hashed as it is written: the engine's
    own tensors (memory) or rank 0's file (folder). Returns (cached folder, hashes)."""
    from stages.training import handoff as ho

    cache = ctx.store.cache_dir
    weights = None
    if handoff["mode"] == "memory":
        engine = ctx.session.engines().local[1]
        weights = ho.serialize(engine.named_weights())
    maybe_fault(STAGE, "persist", ctx.step)  # the background writer, before the version is stored
    return ho.persist_version(Path(handoff["dir"]), cache, weights=weights)


def _release_version_dirs(ctx, handoff: dict) -> None:
    """Version folders of earlier steps are removed once a later version is committed (an engine
    may reload the newest one until then); the run's last ones when the session closes."""
    dirs = ctx.session.memo("update: version folders", list) if ctx.session is not None else []
    if ctx.session is not None:
        ctx.session.on_close("update: version folders",
                             lambda: [shutil.rmtree(d, ignore_errors=True) for d in dirs])
    for old in [d for d in dirs if d != handoff["dir"]]:
        shutil.rmtree(old, ignore_errors=True)
        dirs.remove(old)
    if handoff["dir"] not in dirs:
        dirs.append(handoff["dir"])


def _commit(ctx, work: Path, results: list, roles: list, world: int, t0: float, launch_s: float,
            actor_hashes=None, handoff=None, mismatch: dict | None = None) -> dict:
    """Store the weights version (and the ranks' train state when they saved it), then the
    metrics and the manifest (`mismatch`: engine_mismatch's metrics, when already computed)."""
    try:
        t2 = time.perf_counter()
        cache = ctx.store.cache_dir
        persist_s = None
        if handoff is not None:
            tp = time.perf_counter()
            actor_hf, actor_hashes = _persist_version(ctx, handoff)
            save_weights(ctx.store, ctx.layout, ctx.step, actor_hf, extra={"step": ctx.step}, hashes=actor_hashes)
            persist_s = time.perf_counter() - tp
            _release_version_dirs(ctx, handoff)
        else:
            actor_hf = work / "actor_hf"
            if actor_hashes is not None:  # already moved into the cache (commit_later)
                actor_hf = Path(cache) / "folders" / actor_hashes[1]
            # the exported folder becomes this machine's cached copy: step k+1's rollout loads it
            # into its engine straight from here, nothing is downloaded back
            save_weights(ctx.store, ctx.layout, ctx.step, actor_hf, extra={"step": ctx.step},
                         adopt_into=None if actor_hashes is not None else cache, hashes=actor_hashes)
        _store_states(ctx, work, roles, world)
        if "critic" in roles:
            save_folder(ctx.store, work / "critic_hf", ctx.layout.critic_weights(ctx.step),
                        extra={"step": ctx.step})
        t3 = time.perf_counter()
        metrics = build_metrics(results, launch_s=launch_s, upload_s=t3 - t2, handoff=handoff)
        if persist_s is not None:
            metrics["timing/persist_s"] = persist_s
        forward = (forward_values.table(results, ctx.plan["rows_per_step"])  # built once: the file and the mismatch
                   if results[0].get("log_probs") is not None else None)
        metrics.update(engine_mismatch(ctx, results, forward) if mismatch is None else mismatch)
        for line in metrics["update/load_lines"]:
            print(line, flush=True)
        table = microbatch_table(results, logprob_micro_batches(ctx))
        files = {"update/metrics.json": metrics, "update/microbatches.parquet": table}
        if forward is not None:
            files["update/log_probs.parquet"] = forward
        metrics["timing/update_s"] = time.perf_counter() - t0
        manifest = write_stage(ctx.store, ctx.layout, ctx.step, STAGE, files,
                               fingerprint=stage_fingerprint(ctx), row_count=rows_trained(results),
                               inputs=ctx.input_fingerprints(INPUTS),
                               timings={k: v for k, v in metrics.items() if k.startswith("timing/")},
                               extra={"world": world, "roles": roles,
                                      "rank_hosts": [r.get("host") for r in results],
                                      "handoff": None if handoff is None else handoff["mode"],
                                      "train_state_stored": bool(results[0].get("state_saved", True)),
                                      "replayed_steps": results[0].get("replayed_steps") or []})
        prune_states(ctx)
        return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if handoff is not None and (ctx.session is None or ctx.session.closed):
            shutil.rmtree(handoff["dir"], ignore_errors=True)


def _store_states(ctx, work: Path, roles: list, world: int) -> None:
    """Upload the train state the ranks saved into `work` (every trainer.save_freq steps, at the
    last step, at the run's end: stages.training.state), one folder per role."""
    for role in roles:
        if (work / f"{role}_state").is_dir():
            save_folder(ctx.store, work / f"{role}_state", f"{state_key(ctx.layout, ctx.step)}/{role}",
                        extra={"step": ctx.step, "world": world})


def store_kept_state(ctx) -> bool:
    """Store the train state of step ctx.step (its update committed) from the engines the ranks
    kept, when the step stored none (save_freq not due): what a run does when it ends, fails or is
    stopped, so its resume replays nothing. False when there is nothing to store (no kept
    engines: a resume then replays from the newest stored state)."""
    from stages.ranks.launch import run_ranks
    from stages.training.state import stored_states

    roles = ["actor"] + (["critic"] if ctx.plan.get("critic") else [])
    if ctx.step < 1 or ctx.step in stored_states(ctx) or read_manifest(ctx.store, ctx.layout, ctx.step, STAGE) is None:
        return False
    work = scratch_dir("update", f"{ctx.step:06d}-state-")
    try:
        ctx.extra.update(update_work_dir=str(work), save_only=True)
        results = run_ranks("stages.training.worker", ctx, ctx.plan["n_gpus"],
                            device=ctx.get("trainer.device") or "cpu",
                            timeout_s=float(ctx.extra.get("update_timeout_s", 3600)))
        if not all(r.get("saved") for r in results):
            return False
        fetch_shipped(ctx, work, STAGE, results)
        _store_states(ctx, work, roles, ctx.plan["n_gpus"])
        prune_states(ctx)
        return True
    finally:
        ctx.extra.pop("save_only", None)
        shutil.rmtree(work, ignore_errors=True)


def rows_trained(results: list) -> int:
    """The rows the update trained on: the distinct rows of every rank's micro-batches (each role,
    first PPO epoch). The manifest's row_count and the step report's rows."""
    return len({row for r in results for rec in r["records"] if rec["epoch"] == 0 for row in rec["rows"]})


def build_metrics(results: list, launch_s: float, upload_s: float, handoff=None) -> dict:
    """verl's names from rank 0 (already all-reduced), timings and per-rank micro-batch loads."""
    metrics = dict(results[0]["metrics"])
    if handoff is not None and handoff.get("handoff_s") is not None:
        metrics["timing/handoff_s"] = handoff["handoff_s"]
    metrics["update/replayed_steps"] = len(results[0].get("replayed_steps") or [])
    metrics["update/train_state_stored"] = int(bool(results[0].get("state_saved", True)))
    compute = max(r["timings"]["train_s"] for r in results)
    rank_total = max(sum(r["timings"].values()) for r in results)
    metrics.update({"timing/launch_s": launch_s, "timing/rank_train_s": compute,
                    "timing/rank_init_s": max(r["timings"]["init_s"] for r in results),
                    "timing/rank_save_export_s": max(r["timings"]["save_export_s"] for r in results),
                    "timing/launch_overhead_s": max(0.0, launch_s - rank_total),
                    "timing/upload_s": upload_s,
                    "update/engine_reused": bool(results[0].get("engine_reused", False))})
    loads, lines = {}, []
    for r in results:
        for role in sorted({rec["role"] for rec in r["records"]}):
            recs = [rec for rec in r["records"] if rec["role"] == role and rec["epoch"] == 0]
            load = {"rows": sum(len(x["rows"]) for x in recs), "micro_batches": len(recs),
                    "real_tokens": sum(x["real_tokens"] for x in recs),
                    "padded_tokens": sum(x["padded_tokens"] for x in recs),
                    "max_tokens_per_micro_batch": max((x["padded_tokens"] for x in recs), default=0)}
            load["padding_fraction"] = (1 - load["real_tokens"] / load["padded_tokens"]) if load["padded_tokens"] else 0.0
            loads[f"{role}/rank_{r['rank']}"] = load
            lines.append(f"{role} " + format_load_line(r["rank"], load))
    metrics["update/micro_batch_loads"] = loads
    metrics["update/load_lines"] = lines
    return metrics


def engine_mismatch(ctx, results: list, forward=None) -> dict:
    """verl's rollout_corr/* diagnostics (stages.algos.rollout_correction.offpolicy_metrics) between the
    rollout engine's log-probs (rollout.calculate_log_probs) and the trainer's old log-probs: those
    of the logprob stage's actor pass, or of the update's own first forward when that replaced it.
    Empty when the rollout stored no log-probs. `forward`: update/log_probs.parquet's table when
    the caller built it already (stages.training.forward_values)."""
    from stages.algos.rollout_correction import offpolicy_metrics, pad_rows

    rollout = ctx.read_input("rollout")
    if "rollout_log_probs" not in rollout.schema.names or rollout.column("rollout_log_probs").null_count:
        return {}
    if results[0].get("log_probs") is not None:
        forward = forward if forward is not None else forward_values.table(results, rollout.num_rows)
        old = forward.column("old_log_probs").to_pylist()
    else:
        old = ctx.read_input("logprob").column("old_log_probs").to_pylist()
    engine = rollout.column("rollout_log_probs").to_pylist()
    if [len(r) for r in old] != [len(r) for r in engine]:
        raise ValueError(f"step {ctx.step}: rollout_log_probs and the trainer's old log-probs differ in length")
    old_t, mask = pad_rows(old)
    if "response_mask" in rollout.schema.names:  # multi-turn: only the tokens the engine sampled
        mask = mask * pad_rows(rollout.column("response_mask").to_pylist(), mask.shape[1])[0]
    return offpolicy_metrics(old_t, pad_rows(engine)[0], mask)


def logprob_micro_batches(ctx) -> list:
    """The logprob stage's micro-batches of this step (its manifest extra["micro_batches"]) as
    records of role "logprob/<role>", epoch 0, no mini-batch (none for a manifest without them)."""
    manifest = ctx.input_manifest("logprob") or {}
    recs = []
    for role, per_rank in ((manifest.get("extra") or {}).get("micro_batches") or {}).items():
        for rank, mbs in enumerate(per_rank):
            for j, (rows, real, padded) in enumerate(zip(mbs["rows"], mbs["real_tokens"], mbs["padded_tokens"])):
                recs.append({"role": f"logprob/{role}", "rank": rank, "epoch": 0, "mini_batch": None,
                             "micro_batch": j, "rows": rows, "real_tokens": real, "padded_tokens": padded})
    return recs


def microbatch_table(results: list, extra_records=()):
    """One row per (role, rank, epoch, mini-batch, micro-batch) of the update ranks' records, then
    `extra_records` (the logprob stage's micro-batches)."""
    recs = [rec for r in results for rec in r["records"]] + list(extra_records)
    cols = {k: [rec[k] for rec in recs] for k in ("rank", "micro_batch", "rows", "real_tokens", "padded_tokens",
                                                    "mini_batch", "epoch", "role")}
    return make_table("microbatches", cols)
