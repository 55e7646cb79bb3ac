"""update stage: PPO actor (+ critic) training on the step's rows as a DeepSpeed ZeRO job over the
plan's world (verl: dp_actor.py/dp_critic.py update_policy/update_critic, core_algos.py losses). The ranks (stages.training.worker) train; this
process prepares their inputs and commits what they wrote:

  train_state/step_{k:06d}/actor, .../critic   DeepSpeed checkpoint (module, optimizer partitions,
                                               RNG per rank) that step k+1 continues from
  weights/step_{k:06d}                          the actor as an HF folder (fp32 master weights,
                                               tokenizer) that step k+1 samples from
  weights/critic_step_{k:06d}                   the critic (PPO) as an HF folder
  steps/{k}/update/metrics.json, microbatches.parquet   then the manifest (written last)

microbatches.parquet holds the update ranks' micro-batches (role actor / critic, every epoch) and
the logprob stage's (role logprob/actor, logprob/ref, logprob/critic; epoch 0, no mini-batch), read
from the logprob manifest, so one table has the step's whole batching picture.

Order and resume: state and weights are uploaded before the manifest, so a crash leaves the stage
incomplete and a rerun of step k loads train_state/step_{k-1} again (older states are pruned only
after the manifest). The learning rate is a function of the step (stepped once per training step,
as verl), so it needs no saved scheduler. Multi-node: the ranks write checkpoints into a local
work folder, which must then be on a shared file system (single-node runs need nothing).
"""
from __future__ import annotations

import shutil
import time
from functools import partial
from pathlib import Path

from stages.ranks.files import fetch_shipped
from stages.scratch import scratch_dir

from stages.batches.batching import format_load_line
from stages.training.state import TRAIN_CONFIG_KEYS, prune_states, state_key
from storage.artifacts import read_manifest, write_stage
from storage.schemas import make_table
from storage.weights import adopt_folder, folder_hashes, save_folder, save_weights

STAGE = "update"
INPUTS = ("rollout", "logprob", "advantage")
CONFIG_KEYS = TRAIN_CONFIG_KEYS



def run(ctx) -> dict:
    """Train on N ranks, then commit. With a run session the commit (uploads of the train state
    and weights, metrics, manifest) runs in the background, overlapping the next step's rollout,
    which samples from the exported weights already on this machine; see commit_later."""
    from stages.ranks.launch import run_ranks

    t0 = time.perf_counter()
    world = ctx.plan["n_gpus"]
    roles = ["actor"] + (["critic"] if ctx.plan.get("critic") else [])
    work = scratch_dir("update", f"{ctx.step:06d}-")
    try:
        ctx.extra["update_work_dir"] = str(work)
        t1 = time.perf_counter()
        results = run_ranks("stages.training.worker", ctx, world, device=ctx.get("trainer.device") or "cpu",
                            timeout_s=float(ctx.extra.get("update_timeout_s", 3600)))
        fetch_shipped(ctx, work, STAGE, results)  # files of ranks on other machines (no shared disk)
        t2 = time.perf_counter()
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    commit = partial(_commit, ctx, work, results, roles, world, t0, t2 - t1)
    if ctx.session is None or not ctx.get("orchestration.background_commit", True):
        return commit()
    return commit_later(ctx, work, results, commit, launch_s=t2 - t1)


def commit_later(ctx, work: Path, results: list, commit, launch_s: float) -> dict:
    """Hand the commit to the session's background thread and return what the step needs now:
    the exported actor is hashed and moved into the local weights cache first (ctx.actor_weights
    of step k+1 finds it there through the session), the stage's metrics are returned at once.
    The next rollout waits for this commit before writing its own manifest, so a committed step
    k+1 always has a committed update k; a crash before the commit leaves update k incomplete and
    a resume runs it again from train_state/step_{k-1}."""
    cache = ctx.get("storage.cache_dir") or ctx.store.cache_dir
    hashes = folder_hashes(work / "actor_hf")
    local = adopt_folder(work / "actor_hf", hashes[1], cache) or Path(cache) / "folders" / hashes[1]
    fingerprint = ctx.fingerprint(STAGE, CONFIG_KEYS, INPUTS)
    ctx.session.defer(STAGE, ctx.step, fingerprint, partial(commit, actor_hashes=hashes),
                      local_weights=local)
    metrics = build_metrics(results, launch_s=launch_s, upload_s=0.0)
    metrics.update(engine_mismatch(ctx, results))
    scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {"stage": STAGE, "step": ctx.step, "fingerprint": fingerprint, "row_count": None, "files": {},
            "timings": {}, "extra": {"metrics": scalars, "committing": "in the background"}}


def _commit(ctx, work: Path, results: list, roles: list, world: int, t0: float, launch_s: float,
            actor_hashes=None) -> dict:
    """Upload the ranks' train state and exported weights, then the metrics and the manifest."""
    try:
        t2 = time.perf_counter()
        for role in roles:
            save_folder(ctx.store, work / f"{role}_state", f"{state_key(ctx.layout, ctx.step)}/{role}",
                        extra={"step": ctx.step, "world": world})
        cache = ctx.get("storage.cache_dir") or ctx.store.cache_dir
        actor_hf = work / "actor_hf"
        if actor_hashes is not None:  # already moved into the cache (commit_later)
            actor_hf = Path(cache) / "folders" / actor_hashes[1]
        # the exported folder becomes this machine's cached copy: step k+1's rollout loads it
        # into its engine straight from here, nothing is downloaded back
        save_weights(ctx.store, ctx.layout, ctx.step, actor_hf, extra={"step": ctx.step},
                     adopt_into=None if actor_hashes is not None else cache, hashes=actor_hashes)
        if "critic" in roles:
            save_folder(ctx.store, work / "critic_hf", ctx.layout.critic_weights(ctx.step),
                        extra={"step": ctx.step})
        t3 = time.perf_counter()
        metrics = build_metrics(results, launch_s=launch_s, upload_s=t3 - t2)
        metrics.update(engine_mismatch(ctx, results))
        for line in metrics["update/load_lines"]:
            print(line, flush=True)
        table = microbatch_table(results, logprob_micro_batches(ctx))
        files = {"update/metrics.json": metrics, "update/microbatches.parquet": table}
        if results[0].get("log_probs") is not None:
            files["update/log_probs.parquet"] = forward_log_probs_table(results, ctx.plan["rows_per_step"])
        metrics["timing/update_s"] = time.perf_counter() - t0
        manifest = write_stage(ctx.store, ctx.layout, ctx.step, STAGE, files,
                               fingerprint=ctx.fingerprint(STAGE, CONFIG_KEYS, INPUTS),
                               inputs=ctx.input_fingerprints(INPUTS),
                               timings={k: v for k, v in metrics.items() if k.startswith("timing/")},
                               extra={"world": world, "roles": roles,
                                      "rank_hosts": [r.get("host") for r in results]})
        prune_states(ctx)
        return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_metrics(results: list, launch_s: float, upload_s: float) -> dict:
    """verl's names from rank 0 (already all-reduced), timings and per-rank micro-batch loads."""
    metrics = dict(results[0]["metrics"])
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


def engine_mismatch(ctx, results: list) -> dict:
    """verl's rollout_corr/* diagnostics (stages.algos.rollout_correction.offpolicy_metrics) between the
    rollout engine's log-probs (rollout.calculate_log_probs) and the trainer's old log-probs: those
    of the logprob stage's actor pass, or of the update's own first forward when that replaced it.
    Empty when the rollout stored no log-probs."""
    from stages.algos.rollout_correction import offpolicy_metrics, pad_rows
    from storage.artifacts import read_table

    rollout = read_table(ctx.store, ctx.layout, ctx.step, "rollout")
    if "rollout_log_probs" not in rollout.schema.names or rollout.column("rollout_log_probs").null_count:
        return {}
    if results[0].get("log_probs") is not None:
        old = forward_log_probs_table(results, rollout.num_rows).column("old_log_probs").to_pylist()
    else:
        old = read_table(ctx.store, ctx.layout, ctx.step, "logprob").column("old_log_probs").to_pylist()
    engine = rollout.column("rollout_log_probs").to_pylist()
    if [len(r) for r in old] != [len(r) for r in engine]:
        raise ValueError(f"step {ctx.step}: rollout_log_probs and the trainer's old log-probs differ in length")
    old_t, mask = pad_rows(old)
    return offpolicy_metrics(old_t, pad_rows(engine)[0], mask)


def forward_log_probs_table(results: list, n_rows: int):
    """update/log_probs.parquet: the old log-probs and entropy the ranks' forward gave (when it
    replaced the logprob stage's actor pass), in rollout row order."""
    columns = {"old_log_probs": [None] * n_rows, "entropy": [None] * n_rows}
    for r in results:
        part = r["log_probs"]
        for pos, row in enumerate(part["rows"]):
            columns["old_log_probs"][row] = part["old_log_probs"][pos]
            columns["entropy"][row] = part["entropy"][pos]
    missing = [i for i, v in enumerate(columns["old_log_probs"]) if v is None]
    if missing:
        raise RuntimeError(f"update: rows {missing[:5]} got no forward log-probs from any rank")
    return make_table("update_log_probs", columns)


def logprob_micro_batches(ctx) -> list:
    """The logprob stage's micro-batches of this step (its manifest extra["micro_batches"]) as
    records of role "logprob/<role>", epoch 0, no mini-batch (none for a manifest without them)."""
    manifest = read_manifest(ctx.store, ctx.layout, ctx.step, "logprob") or {}
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
