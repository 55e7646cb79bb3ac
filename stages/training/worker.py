"""One rank of the update job: PPO actor (and critic) training with DeepSpeed ZeRO.

Exact loss scaling (token-mean and every other loss_agg_mode):
  For each mini-batch the ranks all-reduce (SUM) its valid response tokens (`global_tokens`) and
  its rows with >= 1 valid token (`global_rows`). Every micro-batch loss is
  stages.algos.policy_losses.agg_loss(..., global_tokens, global_rows, dp_size=dp) — e.g. for token-mean
  sum(L * m) / global_tokens * dp — so the sum over a rank's micro-batches, averaged over ranks, is
  exactly the loss of one call over all the mini-batch's rows on all ranks.
  DeepSpeed's own scaling is cancelled as follows:
    * gradient accumulation: the engine is configured with gradient_accumulation_steps=1, each
      backward is `engine.backward(loss, scale_wrt_gas=False)` (no 1/GAS factor), and the
      accumulation boundary is set by hand: set_gradient_accumulation_boundary(False) for all but
      the mini-batch's last micro-batch, True for the last, then one engine.step(). So gradients of
      any number of micro-batches (static or token-budget, different per mini-batch) are summed.
    * data parallelism: ZeRO reduces gradients with a SUM followed by a division by dp (its
      gradient averaging); the dp_size factor inside agg_loss cancels that division.
  seq-mean-token-sum-norm uses data.max_response_length as its constant (verl's padded response
  width), never the micro-batch's padded width, so it too is split-invariant.
Non-finite gradient norm: ZeRO's step detects it (overflow check, bf16 check_grad_overflow on),
discards the gradients and skips the update; it is counted in actor/skipped_steps with a warning.
All ranks run the same number of backward passes (token-budget counts are all-reduced MAX), as
ZeRO-2/3 reduce gradients inside backward. Micro-batches are stages.batches.binning.micro_batches, the
function the logprob stage uses: token-budget ones hold at most ppo_max_token_len_per_gpu padded
tokens in wide bins (several whole sequences per tensor row, first fit, longest first,
block-diagonal attention: few full micro-batches, as a backward's fixed cost per micro-batch
outweighs the masked attention), not verl's KK grouping of padded rows, which mixes long and
short rows and pads heavily (bench/update.py); static ones are ppo_micro_batch_size_per_gpu rows,
packed into bins too with model.use_remove_padding. The loss is exact for any grouping.
"""
from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from stages.batches import batching, binning
from stages.progress import progress
from stages.ranks.files import ship_work_dir
from stages.training import engine as update_engine
from stages.training.forward_values import pack as pack_forward_values
from stages.training.roles import ACTOR, ActorRole, planned_roles
from stages.training.state import TRAIN_CONFIG_KEYS, newest_state, state_due, state_folder


def _all_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


class UpdateJob:
    """Engines of one rank; `train_step(ctx)` trains on a step's rows and may be called again
    with the next step's context (what two consecutive update jobs do through train_state/)."""

    def __init__(self, ctx, rank: int, world: int, device: str = "cpu"):
        from stages.model.models import load_tokenizer

        self.rank, self.world, self.device = rank, world, device
        self.forward_values = None  # {row: (old log-probs, entropy)} while train_step keeps them
        self.templates: dict = {}  # dtype -> folder of the actor's small files (_copy_template)
        model_dtype = "bf16" if ctx.get(f"{ACTOR}.deepspeed.dtype") == "bf16" else "fp32"
        self.init_path = ctx.reference_weights()
        self.pad_id = load_tokenizer(self.init_path).pad_token_id
        self.roles = planned_roles(ctx)  # verl's order: critic first
        self.actor = next(r for r in self.roles if isinstance(r, ActorRole))
        torch.manual_seed(ctx.seed("update"))
        for role in sorted(self.roles, key=lambda r: r is not self.actor):  # built actor first
            role.build(ctx, self.init_path, model_dtype, device)

    def load_state(self, dirs: dict) -> None:
        for role in self.roles:
            if dirs.get(role.name):
                update_engine.load_state(role.engine, Path(dirs[role.name]), self.rank)

    def save_state(self, work_dir: Path) -> dict:
        out = {}
        for role in self.roles:
            folder = Path(work_dir) / f"{role.name}_state"
            update_engine.save_state(role.engine, folder, self.rank)
            out[role.name] = str(folder)
        return out

    def export(self, work_dir: Path, roles=None) -> dict:
        """Each role's HF folder (fp32). The actor's small files (config, generation config,
        tokenizer: the same at every step) are copied from this job's template, its weights written
        as one safetensors file: the bytes save_pretrained writes (a pipelined run exports every
        step, on the update's critical path: ~13 -> ~3 ms at the demo's size). With LoRA
        adapters to merge, and for the critic, save_pretrained as before."""
        from stages.model.lora import adapter_scalings
        from stages.training import handoff as ho

        out = {}
        for role in self.roles if roles is None else [r for r in self.roles if r.name in roles]:
            folder = Path(work_dir) / f"{role.name}_hf"
            if role is self.actor and not adapter_scalings(role.engine.module):
                state = dict(ho.rollout_tensors(role.engine, torch.float32, self.rank))  # a collective
                if self.rank == 0:  # the fp32 masters, without a copy where the parameters hold them
                    self._copy_template(folder, torch.float32)
                    ho.write_weights(folder / ho.WEIGHTS_FILE, state)  # save_pretrained's bytes
            else:
                update_engine.export_hf(role.engine, folder, self.rank,
                                        tokenizer_from=self.init_path if role.exports_tokenizer else None)
            out[role.name] = str(folder)
        return out

    def hand_over(self, ctx, handoff: dict) -> dict:
        """The actor's new weights to the rollout engine (stages.training.handoff): "memory" copies
        them into the engine in this process, "folder" has rank 0 write them into the version
        folder (shared memory) that the flow's engines then load. Both also get the version's
        small files (config, tokenizer). Every rank calls it (a gather is a collective)."""
        from stages.training import handoff as ho

        t0 = time.perf_counter()
        folder, dtype = Path(handoff["dir"]), getattr(torch, handoff["dtype"])
        if self.rank == 0:
            self._small_files(folder, dtype, handoff["version"])
        pairs = ho.rollout_tensors(self.actor.engine, dtype, self.rank)
        if handoff["mode"] == "memory":
            took = ctx.session.engines().take_tensors(pairs, handoff["version"], folder)
        else:
            named = dict(pairs)
            if self.rank == 0:
                ho.write_weights(folder / ho.WEIGHTS_FILE, named)
            took = None
        return {"mode": handoff["mode"], "load_s": took, "handoff_s": time.perf_counter() - t0}

    def _small_files(self, folder: Path, dtype, version: str) -> None:
        """A version folder's config, generation config and tokenizer (_copy_template) and its
        version file."""
        from stages.training import handoff as ho

        self._copy_template(folder, dtype)
        (folder / ho.VERSION_FILE).write_text(json.dumps({"version": version}) + "\n")

    def _copy_template(self, folder: Path, dtype) -> None:
        """The actor's small files served in `dtype`: written once per job and dtype into a
        template, then copied (they are the same at every step)."""
        import shutil

        from stages.scratch import scratch_dir
        from stages.training import handoff as ho

        if dtype not in self.templates:
            folder_t = scratch_dir("update", "version-template-")
            ho.write_small_files(folder_t, self.actor.engine.module, self.init_path, dtype)
            self.templates[dtype] = folder_t
        folder.mkdir(parents=True, exist_ok=True)
        for f in self.templates[dtype].iterdir():
            if f.is_file():
                shutil.copy(f, folder / f.name)

    # ---- data ---------------------------------------------------------------------------------
    def rank_rows(self, ctx) -> list[dict]:
        """This rank's rows (balance_batch partition when trainer.balance_batch): the columns the
        roles read, as Python values (only those columns are converted)."""
        cols = {"prompt_ids": "rollout", "response_ids": "rollout", "advantages": "advantage",
                "returns": "advantage"}
        for role in self.roles:
            cols.update(role.columns())
        tables = {name: ctx.read_input(name) for name in ("rollout", "logprob", "advantage")}
        if "response_mask" in tables["rollout"].column_names:  # multi-turn: tool-response tokens are not trained
            cols["response_mask"] = "rollout"
        n = tables["rollout"].num_rows
        for name, t in tables.items():
            rows = t.num_rows if t.num_columns else 0
            if rows != n:
                raise ValueError(f"step {ctx.step}: {name}.parquet has {rows} rows, rollout.parquet {n}")
        for c, t in cols.items():
            if c not in tables[t].column_names:
                raise ValueError(f"step {ctx.step}: {t}.parquet has no {c!r} column, needed by the update")
        values = {c: tables[t].column(c).to_pylist() for c, t in cols.items()}
        dp = self.actor.plan["dp_size"]
        if ctx.get("trainer.balance_batch"):
            seqlens = [len(p) + len(r) for p, r in zip(values["prompt_ids"], values["response_ids"])]
            parts = batching.balance_partitions(seqlens, dp)
        else:
            per = n // dp
            parts = [list(range(r * per, (r + 1) * per)) for r in range(dp)]
        rows = []
        for i in parts[self.rank]:
            row = {c: v[i] for c, v in values.items()}
            row["index"] = i
            rows.append(row)
        return rows

    # ---- training -----------------------------------------------------------------------------
    def train_step(self, ctx) -> dict:
        t0 = time.perf_counter()
        rows = self.rank_rows(ctx)
        # plan rollout.old_log_prob_pass false: no logprob-stage actor pass ran; the actor's one
        # forward per row (one mini-batch, one epoch) gives the old log-probs and entropy
        self.forward_values = None if ctx.plan["rollout"].get("old_log_prob_pass", True) else {}
        total = ctx.extra.get("total_training_steps") or ctx.get("trainer.total_training_steps")
        metrics, records = {}, []
        for role in self.roles:
            lr = update_engine.step_lr(role.cfg["optim"], ctx.step, total, f"{role.prefix}.optim")
            update_engine.set_lr(role.engine, lr)
            if not role.trains_at(ctx):
                continue
            m, rec = self._train_role(ctx, role, rows)
            m[f"{role.name}/lr"] = lr
            metrics.update(m)
            records += rec
        metrics["timing/update_compute_s"] = time.perf_counter() - t0
        out = {"metrics": metrics, "records": records}
        if self.forward_values is not None:
            index = sorted(self.forward_values)
            out["log_probs"] = pack_forward_values(index, [self.forward_values[i][0] for i in index],
                                                   [self.forward_values[i][1] for i in index])
            self.forward_values = None
        return out

    def _train_role(self, ctx, role, rows: list[dict]):
        plan, engine = role.plan, role.engine
        dp = plan["dp_size"]
        mini = plan["ppo_mini_batch_size_per_gpu"]
        gen = torch.Generator().manual_seed(ctx.seed("update") + role.seed_offset)
        sums: dict[str, float] = {}
        grad_norms, skipped, steps, records = [], 0, 0, []
        bar = progress(f"update {role.name}", total=plan["ppo_epochs"] * -(-len(rows) // mini),
                       unit="mini-batch", rank=self.rank)
        for epoch in range(plan["ppo_epochs"]):
            order = list(range(len(rows)))
            if role.cfg.get("shuffle"):
                order = torch.randperm(len(rows), generator=gen).tolist()
            for mb_index, start in enumerate(range(0, len(order), mini)):
                mini_rows = [rows[i] for i in order[start:start + mini]]
                stats = self._mini_batch(ctx, role, mini_rows, dp, epoch, mb_index, records)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                before = engine.skipped_steps
                engine.step()
                norm = engine.get_global_grad_norm()
                norm = float(norm) if norm is not None else float("nan")
                steps += 1
                if engine.skipped_steps > before or not torch.isfinite(torch.tensor(norm)):
                    skipped += 1
                    print(f"WARN: rank {self.rank} {role.name} grad_norm is not finite: {norm}; "
                          f"optimizer step skipped", file=sys.stderr, flush=True)
                else:
                    grad_norms.append(norm)
                bar.update(1)
        bar.close()
        return self._role_metrics(role, sums, grad_norms, skipped, steps), records

    def _mini_batch(self, ctx, role, mini_rows, dp, epoch, mb_index, records) -> dict:
        plan, engine = role.plan, role.engine
        resp = [len(r["response_ids"]) for r in mini_rows]
        masked = "response_mask" in mini_rows[0] if mini_rows else False
        trained = [sum(r["response_mask"]) for r in mini_rows] if masked else resp
        global_tokens, global_rows = _all_sum([sum(trained), sum(1 for n in resp if n > 0)], "cpu")
        if global_tokens <= 0:
            raise ValueError(f"step {ctx.step}: a {role.name} mini-batch has no response tokens on any rank")
        dynamic = plan["use_dynamic_bsz"]
        micro = binning.micro_batches(  # a token budget packs wide bins: few, full micro-batches
            [len(r["prompt_ids"]) + n for r, n in zip(mini_rows, resp)],
            rows_per_micro=plan["ppo_micro_batch_size_per_gpu"], budget=plan["max_token_len_per_micro_batch"],
            dynamic=dynamic, packed=bool(ctx.get(f"{role.model_key}.use_remove_padding")),
            wide_bins=True, budget_key=f"{role.prefix}.ppo_max_token_len_per_gpu")
        agg = {"global_tokens": global_tokens, "global_rows": global_rows, "dp_size": dp,
               "loss_scale_factor": ctx.get("data.max_response_length")}
        stats: dict[str, float] = {}
        for j, idx in enumerate(micro):
            part = [mini_rows[i] for i in binning.rows_of(idx)]
            batch = binning.collate_bins([[mini_rows[i] for i in b] for b in idx], self.pad_id, self.device)
            if masked:  # multi-turn: the stored response_mask (0 on tool-response tokens)
                mask = self.per_token(part, "response_mask", batch["response_width"])
                batch["response_mask"] = batch["response_mask"] * mask.to(batch["response_mask"].dtype)
            engine.set_gradient_accumulation_boundary(j == len(micro) - 1)
            loss, micro_stats = role.loss(ctx, self, part, batch, agg)
            engine.backward(loss, scale_wrt_gas=False)
            tokens = float(batch["response_mask"].sum())
            for k, v in micro_stats.items():
                stats[k] = stats.get(k, 0.0) + v
            stats["tokens"] = stats.get("tokens", 0.0) + tokens
            records.append({"role": role.name, "rank": self.rank, "epoch": epoch, "mini_batch": mb_index,
                            "micro_batch": j, "rows": [r["index"] for r in part],
                            "real_tokens": int(batch["real_tokens"]), "padded_tokens": int(batch["padded_tokens"])})
        return stats

    def per_token(self, part, key, width):
        """Column `key` of the micro-batch's rows as a [rows, width] tensor on this rank's device."""
        return batching.pad_per_token([r[key] for r in part], width, device=self.device)

    def keep_forward(self, part, old, entropy) -> None:
        """The actor's forward replaces the old-log-prob pass: keep its values per row."""
        if self.forward_values is None:
            return
        old, entropy = (np.array(t.detach().float().cpu()) for t in (old, entropy))  # copies, float32
        for j, row in enumerate(part):
            n = len(row["response_ids"])
            values = (old[j, :n], entropy[j, :n])
            if "response_mask" in row:  # as the logprob stage stores them: 0 on tool-response tokens
                keep = np.asarray(row["response_mask"][:n], dtype=bool)
                values = tuple(np.where(keep, v[:len(keep)], np.float32(0.0)) for v in values)
            self.forward_values[row["index"]] = values

    def _role_metrics(self, role, sums, grad_norms, skipped, steps) -> dict:
        keys = sorted(sums)
        totals = dict(zip(keys, _all_sum([sums[k] for k in keys], "cpu")))
        tokens = totals.pop("tokens", 0.0) or 1.0
        loss_keys = {"pg_loss", "kl_loss", "vf_loss"}  # exact global losses, summed per mini-batch
        out = {}
        for k, v in totals.items():
            out[f"{role.name}/{k}"] = v / steps if k in loss_keys else v / tokens
        out[f"{role.name}/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        out[f"{role.name}/skipped_steps"] = skipped
        out[f"{role.name}/optimizer_steps"] = steps
        return out


# Engines kept between steps in the session of the process that trained them (a rank pool's rank,
# or the training process for one rank): {key: (job, step, rng)} in session.memo(KEPT). Step k
# reuses the job that trained step k-1 of the same run and config instead of building engines,
# restoring the newest stored train state and replaying the updates after it (restore_job: the
# same weights, optimizer and RNG, so the result is bit-identical); anything else (another run, a
# rerun, step 1) builds afresh.
KEPT = "stages.training.worker: kept engines"


def _job_key(ctx, world: int) -> str:
    from storage.artifacts import fingerprint

    return fingerprint({"run": ctx.store.url(ctx.layout.train_state), "world": world, "plan": ctx.plan,
                        "config": {k: ctx.get(k) for k in TRAIN_CONFIG_KEYS + ("warmstart.enable", "trainer.seed")}})


def _prepare(ctx, rank: int, world: int, device: str, kept: dict | None, key, t0: float) -> dict:
    """Build the engines step ctx.step will train with (and load the previous step's state), then
    keep them as if that step's predecessor had just trained: the step reuses them. A training
    run submits this in the background before its first update (stages.ranks.pool
    submit_background), so DeepSpeed's set-up overlaps the first rollout. The kept RNG state is
    the one the step would have after building and loading, so the result is unchanged."""
    from stages.ranks.launch import rank_device

    if kept is None:  # engines are not kept here: nothing to prepare
        return {"rank": rank, "prepared": False}
    job, replayed = restore_job(ctx, rank, world, rank_device(device))
    kept.clear()
    kept[key] = (job, ctx.step - 1, update_engine.rng_state())
    return {"rank": rank, "prepared": True, "prepare_s": round(time.perf_counter() - t0, 3),
            "replayed_steps": replayed}


def _save_kept(ctx, rank: int, kept: dict | None, key) -> dict:
    """The train state of step ctx.step from the engines kept after its update (a run that
    ends or stops before its next save_freq step), with the RNG state the step ended with."""
    entry = (kept or {}).get(key)
    if entry is None or entry[1] != ctx.step:
        return {"rank": rank, "saved": False}
    job, _, rng = entry
    now = update_engine.rng_state()
    update_engine.restore_rng(rng)
    try:
        job.save_state(Path(ctx.extra["update_work_dir"]))
    finally:
        update_engine.restore_rng(now)
    return {"rank": rank, "saved": True, "shipped": ship_work_dir(ctx, Path(ctx.extra["update_work_dir"]),
                                                                  "update", rank)}


def restore_job(ctx, rank: int, world: int, device: str) -> tuple[UpdateJob, list[int]]:
    """The engines as they were after step ctx.step-1's update, without a job kept from it: the
    newest stored train state (stages.training.state.newest_state; none: the initial weights),
    then the updates of the steps after it replayed from their stored rows (no rollout runs, no
    artifact is written). Returns (job, the steps replayed)."""
    from dataclasses import replace

    roles = [r.name for r in planned_roles(ctx)]
    start = newest_state(ctx, roles)
    job = UpdateJob(replace(ctx, step=start + 1), rank, world, device)  # seeded as step start+1's job
    if start:
        job.load_state({role: str(state_folder(ctx, start, role)) for role in roles})
    replayed = list(range(start + 1, ctx.step))
    for s in replayed:
        print(f"update of step {ctx.step}: replaying step {s}'s update from its stored rows "
              f"(newest stored train state: step {start})", flush=True)
        job.train_step(replace(ctx, step=s))
    return job, replayed


def release_kept_jobs(kept: dict) -> None:
    """Drop the engines kept between steps (the end of a training run, or of a rank pool)."""
    import gc

    if kept:
        kept.clear()
        gc.unfreeze()
        gc.collect()


def _take_kept_job(ctx, kept: dict, key: str):
    """The kept job that trained step k-1 of this run (its RNG restored), else None; other kept
    jobs are freed."""
    import gc

    entry = kept.pop(key, None)
    dropped = bool(kept) or (entry is not None and entry[1] != ctx.step - 1)
    kept.clear()
    if dropped:  # the rank server froze kept jobs (gc.freeze): let their cycles be collected
        gc.unfreeze()
        gc.collect()
    if entry is None or entry[1] != ctx.step - 1:
        return None
    job, _, rng = entry
    update_engine.restore_rng(rng)
    return job


def kept_jobs(ctx) -> dict | None:
    """The session's kept-engine table (None: nothing is kept, e.g. a per-call launch's rank, or
    extra keep_update_engine false to free device memory for other stages)."""
    session = getattr(ctx, "session", None)
    if session is None or not ctx.extra.get("keep_update_engine", True):
        return None
    kept = session.memo(KEPT, dict)
    session.on_close(KEPT, lambda: release_kept_jobs(kept))
    return kept


def rank_main(ctx, rank: int, world: int) -> dict:
    """Entry of one rank (stages.ranks.launch.run_ranks): load state, train the step, save, export.
    The engines are kept for the next step in the session of the process that runs the rank (a
    rank pool's rank, or the training process for one rank), see kept_jobs."""
    from stages.ranks.launch import init_distributed, rank_device

    t0 = time.perf_counter()
    device = ctx.extra.get("device") or ctx.get("trainer.device") or "cpu"
    init_distributed(device)
    kept = kept_jobs(ctx)
    key = _job_key(ctx, world) if kept is not None else None
    if ctx.extra.get("prepare_only"):
        return _prepare(ctx, rank, world, device, kept, key, t0)
    if ctx.extra.get("save_only"):
        return _save_kept(ctx, rank, kept, key)
    job = _take_kept_job(ctx, kept, key) if kept is not None else None
    reused, replayed = job is not None, []
    t1 = time.perf_counter()
    if job is None:  # no engine kept from step k-1: the newest stored state, then a replay
        job, replayed = restore_job(ctx, rank, world, rank_device(device))
    t2 = time.perf_counter()
    if ctx.session is not None:  # the train loop starts in this process (one rank, or a pool's rank)
        ctx.session.compute_starts()
    out = job.train_step(ctx)
    t3 = time.perf_counter()
    trained_at = time.time()
    work = Path(ctx.extra["update_work_dir"])
    handoff = ctx.extra.get("handoff")  # set by the update stage (stages.training.handoff.mode)
    if handoff:
        out["handoff"] = {**job.hand_over(ctx, handoff), "trained_at": trained_at}
        job.export(work, roles=[r.name for r in job.roles if r is not job.actor])  # the critic's
    else:
        job.export(work)
    t4 = time.perf_counter()
    saved = state_due(ctx, every_step=kept is None)  # a kept job trains on: a resume replays from the newest state
    if saved:
        job.save_state(work)
    rng = update_engine.rng_state()  # what save_state wrote into rng_rank<r>.pt
    shipped = ship_work_dir(ctx, work, "update", rank)  # ranks on other machines: through the store
    t5 = time.perf_counter()
    if kept is not None:
        kept[key] = (job, ctx.step, rng)
    out["timings"] = {"init_s": t1 - t0, "load_state_s": t2 - t1, "train_s": t3 - t2, "save_export_s": t5 - t3}
    out["phases"] = {"handoff_or_export_s": t4 - t3, "save_state_s": t5 - t4}
    out["state_saved"] = saved
    out["replayed_steps"] = replayed
    out["rank"] = rank
    out["host"] = socket.gethostname()
    out["shipped"] = shipped
    out["engine_reused"] = reused
    return out
