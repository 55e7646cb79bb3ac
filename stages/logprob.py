"""logprob stage: old (actor) log-probs and entropy, reference log-probs, critic values, on N ranks.

1. Rows are balanced over the plan's dp ranks with verl's balance_batch (equal-size
   Karmarkar-Karp on workload 24576·s + s², s = prompt + response tokens); rank r takes
   partitions[r]. The permutation (rank 0's rows, then rank 1's, ...) is stored in the manifest
   extra["permutation"], and each output row's rank in the `rank` column; the artifact itself
   stays in rollout order.
2. Each rank runs, per pass (the LogprobPass objects of PASSES that the plan needs), forwards in
   micro-batches from stages.batches.binning.micro_batches, the grouping the update uses too, and puts
   the outputs back in row order:
   - static: `*_micro_batch_size_per_gpu` consecutive rows, one sequence per tensor row, or with
     model.use_remove_padding the micro-batch's sequences packed into bins (several whole
     sequences per tensor row, positions restarting per sequence);
   - `*_use_dynamic_bsz`: at most `*_max_token_len_per_gpu` padded tokens per micro-batch, runs
     of sequences sorted by length (the count all-reduced MAX over ranks). Not verl's
     Karmarkar-Karp grouping of padded rows: on mixed lengths that padded 77 % and ran at 0.33x
     static; the runs pad 4.6 % and run at 1.6-2.0x static (bench/logprob.py).
   - actor: ctx.actor_weights(), logits / rollout.temperature -> old_log_probs and entropy (and
     sum_pi_squared, Σ_v π_v² per token, when the plan's rollout.sum_pi_squared is on:
     optimal_token_baseline or actor.calculate_sum_pi_squared)
   - ref (plan["ref"] not None): ctx.reference_weights(), same temperature -> ref_log_probs
   - critic (plan["critic"] not None): critic.model.path at step 1, the store's
     weights/critic_step_{k-1} later -> values
3. Each rank prints its load line per role; loads go to the manifest extra["loads"] and its
   micro-batches (rows, real and padded tokens as the bins lay them out) to
   extra["micro_batches"][role][rank], which the update stage adds to microbatches.parquet as
   role "logprob/<role>"; a progress bar (rank 0) counts micro-batches.
The vocab projection is chunked (stages.model.models.response_log_probs): no full-vocab log-softmax
of a whole micro-batch is ever held. A multi-turn rollout's tool-response tokens (rollout.parquet's
response_mask 0) get 0 in every column: they are not the policy's (the update and the advantage
stage mask them too)."""
from __future__ import annotations

import gc
import socket
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from stages.batches import batching, binning

from stages.model import models
from stages.progress import progress

STAGE = "logprob"
INPUTS = ("rollout",)
CONFIG_KEYS = ("actor_rollout_ref.model", "actor_rollout_ref.rollout.temperature",
               "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
               "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
               "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
               "actor_rollout_ref.ref", "actor_rollout_ref.actor.deepspeed.dtype",
               "critic.model", "critic.enable", "trainer.device")
# Not algorithm.adv_estimator: whether a critic gives values is the plan's `critic` (in every
# fingerprint), so estimators that need no values (grpo, rloo, ...) share this stage's output and
# a fork may switch between them after the logprob (flows/fork.py).
# actor_rollout_ref.model.use_remove_padding / critic.model.use_remove_padding: static micro-batches
# run packed (binning: whole sequences share tensor rows, attention kept inside each sequence).
CHUNK = 1024  # positions per vocab projection


def run(ctx) -> dict:
    """Compute the step's logprob.parquet (in rollout row order) and commit it."""
    from stages.ranks.launch import run_ranks
    from storage.artifacts import write_table
    from storage.schemas import make_table

    t0 = time.perf_counter()
    rollout = ctx.read_input("rollout")
    n_rows = rollout.num_rows
    world = ctx.plan["actor"]["dp_size"]
    check_inputs(ctx, rollout, world)
    if not passes(ctx.plan):  # no pass at all: old log-probs come from the update's forward
        return _write_without_passes(ctx, rollout, world, t0)
    device = str(ctx.get("trainer.device") or "cpu")
    if ctx.session is not None and any(p.name != "ref" for p in passes(ctx.plan)):
        # the actor and critic passes read update k-1's weights, which a rank in another process
        # finds only in the store: its commit may still run in the background (trainer.staleness
        # >= 1 runs this stage right after that update; at 0 the rollout between them waited)
        ctx.session.wait_commit("update", ctx.step - 1)
    results = run_ranks("stages.logprob", ctx, world, device=device)
    columns = {name: [None] * n_rows for p in passes(ctx.plan) for name in p.columns(ctx.plan)}
    rank_of = [None] * n_rows
    for rank, result in enumerate(results):
        for pos, row in enumerate(result["rows"]):
            rank_of[row] = rank
            for name in columns:
                columns[name][row] = result[name][pos]
    if any(r is None for r in rank_of):
        missing = [i for i, r in enumerate(rank_of) if r is None][:5]
        raise RuntimeError(f"logprob: rows {missing} were computed by no rank")
    columns["rank"] = rank_of
    table = make_table("logprob", columns)
    permutation = [row for result in results for row in result["rows"]]
    extra = {"world": world, "permutation": permutation, "passes": [p.name for p in passes(ctx.plan)],
             "loads": {role: [r["loads"][role] for r in results] for role in results[0]["loads"]},
             "micro_batches": {role: [r["micro_batches"][role] for r in results]
                               for role in results[0]["micro_batches"]},
             "rank_timings": [r["timings"] for r in results], "rank_hosts": [r.get("host") for r in results]}
    return write_table(ctx.store, ctx.layout, ctx.step, STAGE, table,
                       fingerprint=ctx.fingerprint(STAGE, CONFIG_KEYS, INPUTS),
                       inputs=ctx.input_fingerprints(INPUTS),
                       timings={"logprob_s": round(time.perf_counter() - t0, 4)}, extra=extra)


def _write_without_passes(ctx, rollout, world: int, t0: float) -> dict:
    """No forward to run (GRPO-style on-policy without KL or critic): the table holds only each
    row's rank (the balance_batch partition the ranks would use); nothing is launched."""
    from storage.artifacts import write_table
    from storage.schemas import make_table

    parts = batching.balance_partitions(sequence_lengths(rollout), world)
    rank_of = [0] * rollout.num_rows
    for rank, part in enumerate(parts):
        for row in part:
            rank_of[row] = rank
    table = make_table("logprob", {"rank": rank_of})
    extra = {"world": world, "permutation": [row for part in parts for row in part], "passes": [],
             "old_log_probs": "update/log_probs.parquet (the update's own forward, detached)"}
    return write_table(ctx.store, ctx.layout, ctx.step, STAGE, table,
                       fingerprint=ctx.fingerprint(STAGE, CONFIG_KEYS, INPUTS),
                       inputs=ctx.input_fingerprints(INPUTS),
                       timings={"logprob_s": round(time.perf_counter() - t0, 4)}, extra=extra)


def check_inputs(ctx, rollout, world: int) -> None:
    """Fail before launching ranks: model folders exist, rows split over ranks, every token
    budget covers the longest sequence (the message names the key and the row)."""
    if rollout.num_rows == 0:
        raise ValueError(f"rollout.parquet of step {ctx.step} has no rows")
    if rollout.num_rows % world:
        raise ValueError(f"{rollout.num_rows} rollout rows are not divisible by {world} logprob ranks")
    if not passes(ctx.plan):  # nothing runs: no folder to load, no budget to check
        return
    for lp_pass in passes(ctx.plan):
        lp_pass.check_folder(ctx)
    seqlens = sequence_lengths(rollout)
    longest = max(seqlens)
    for lp_pass in passes(ctx.plan):
        _, dynamic, budget = lp_pass.sizes(ctx.plan)
        if dynamic and (budget is None or budget < longest):
            raise ValueError(f"{lp_pass.budget_key}={budget} is below the longest sequence: row "
                             f"{seqlens.index(longest)} has {longest} tokens (prompt + response); "
                             f"a sequence is never split across micro-batches")


def sequence_lengths(rollout) -> list[int]:
    """Prompt + response tokens of each rollout row (the lists' lengths, not their tokens)."""
    import pyarrow.compute as pc

    return pc.add(pc.list_value_length(rollout.column("prompt_ids")),
                  pc.list_value_length(rollout.column("response_ids"))).to_pylist()


# ---- the forward passes, as objects -----------------------------------------------------------
@dataclass(frozen=True)
class LogprobPass:
    """One forward pass of the stage: where the plan keeps its micro-batching, the config keys of
    its packing and token budget, how its model loads and which columns its forward gives.
    rank_main runs every pass alike without asking which one it holds (as stages.training.roles)."""
    name: str            # plan entry; key of out/extra "loads", "micro_batches", "timings"; printed
    section: str         # plan section of its micro-batching
    size_keys: tuple     # (rows per micro-batch, dynamic?, token budget) keys in that section
    padding_key: str     # use_remove_padding: static micro-batches packed into bins too
    budget_key: str      # the token budget's config key (errors; flows/read/plots.py via BUDGET_KEYS)
    folder_label: str    # how check_inputs names a missing model folder
    weights: Callable    # ctx -> its model folder
    switch: str = ""     # plan[section] flag that turns the pass off (default on)

    def needed(self, plan) -> bool:
        section = plan.get(self.section)
        return section is not None and (not self.switch or bool(section.get(self.switch, True)))

    def sizes(self, plan) -> tuple:
        """(rows per micro-batch, dynamic?, token budget) from the plan."""
        return tuple(plan[self.section][key] for key in self.size_keys)

    def packed(self, ctx) -> bool:
        return bool(ctx.get(self.padding_key))

    def check_folder(self, ctx) -> None:
        models.check_model_folder(self.weights(ctx), self.folder_label)

    def columns(self, plan) -> list[str]:
        raise NotImplementedError

    def load(self, ctx, dtype: str, device):
        raise NotImplementedError

    def forward(self, model, batch, temperature, sum_pi_squared: bool = False) -> dict:
        """Per-row float32 numpy arrays (response length) of one micro-batch
        (binning.collate_bins), rows in bin order."""
        raise NotImplementedError


@dataclass(frozen=True)
class PolicyPass(LogprobPass):
    """A policy's log-probs of logits / rollout.temperature; with `stats` (the actor's old pass)
    also entropy and, when `sum_pi_squared`, Σ_v π_v² per token."""
    column: str = ""
    stats: bool = False

    def columns(self, plan) -> list[str]:
        # sum_pi_squared: optimal_token_baseline / actor.calculate_sum_pi_squared
        extra = ["entropy"] + (["sum_pi_squared"] if plan["rollout"].get("sum_pi_squared") else [])
        return [self.column] + (extra if self.stats else [])

    def load(self, ctx, dtype: str, device):
        return models.load_policy(self.weights(ctx), dtype=dtype, device=device)

    def forward(self, model, batch, temperature, sum_pi_squared: bool = False) -> dict:
        import torch

        lengths = batch["response_lengths"]
        with torch.inference_mode():
            logp, ent, pi2 = models.response_stats(model, batch, temperature=temperature, with_entropy=self.stats,
                                                   chunk_size=CHUNK, with_sum_pi_squared=self.stats and sum_pi_squared)
        out = {self.column: _split(logp, lengths)}
        if self.stats:
            out["entropy"] = _split(ent, lengths)
        if pi2 is not None:
            out["sum_pi_squared"] = _split(pi2, lengths)
        return out


@dataclass(frozen=True)
class ValuePass(LogprobPass):
    """The critic's values (a value head, seeded as the update stage's)."""

    def columns(self, plan) -> list[str]:
        return ["values"]

    def load(self, ctx, dtype: str, device):
        return models.load_critic(self.weights(ctx), dtype=dtype, device=device, seed=critic_seed(ctx))

    def check_folder(self, ctx) -> None:
        if ctx.step <= 1:  # later steps read the store's weights/critic_step_{k-1}
            super().check_folder(ctx)

    def forward(self, model, batch, temperature, sum_pi_squared: bool = False) -> dict:
        import torch

        with torch.inference_mode():
            return {"values": _split(models.response_values(model, batch), batch["response_lengths"])}


_POLICY_SIZES = ("log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu")
# in run order: actor (old log-probs, unless the update's own forward replaces them: plan
# rollout.old_log_prob_pass), ref (with KL: plan["ref"] not None), critic (plan["critic"] not None)
PASSES = (
    PolicyPass("actor", "rollout", _POLICY_SIZES, "actor_rollout_ref.model.use_remove_padding",
               "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "actor_rollout_ref.model.path (policy)",
               lambda ctx: ctx.actor_weights(), switch="old_log_prob_pass", column="old_log_probs", stats=True),
    PolicyPass("ref", "ref", _POLICY_SIZES, "actor_rollout_ref.model.use_remove_padding",
               "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
               "reference policy (actor_rollout_ref.model.path)", lambda ctx: ctx.reference_weights(),
               column="ref_log_probs"),
    ValuePass("critic", "critic", ("forward_micro_batch_size_per_gpu", "use_dynamic_bsz",
                                   "forward_max_token_len_per_gpu"),
              "critic.model.use_remove_padding", "critic.forward_max_token_len_per_gpu", "critic.model.path",
              lambda ctx: critic_weights(ctx)),
)
BUDGET_KEYS = {p.name: p.budget_key for p in PASSES}


def passes(plan) -> list[LogprobPass]:
    """The forward passes this step needs, in run order."""
    return [p for p in PASSES if p.needed(plan)]


# ---- one rank --------------------------------------------------------------------------------
def rank_main(ctx, rank: int, world: int) -> dict:
    """This rank's share: {rows (step row indices), per-token columns (lists), loads, timings}."""
    from stages.ranks.launch import init_distributed, rank_device
    device = str(ctx.extra.get("device") or ctx.get("trainer.device") or "cpu")
    if world > 1:
        init_distributed(device)
    device = rank_device(device)
    rollout = ctx.read_input("rollout")
    prompts = rollout.column("prompt_ids").to_pylist()
    responses = rollout.column("response_ids").to_pylist()
    seqlens = [len(p) + len(r) for p, r in zip(prompts, responses)]
    mine = batching.balance_partitions(seqlens, world)[rank]
    rows = [{"prompt_ids": prompts[i], "response_ids": responses[i]} for i in mine]
    # multi-turn: the values of tool-response tokens (response_mask 0) are stored as 0
    masks = None
    if "response_mask" in rollout.schema.names:
        stored = rollout.column("response_mask").to_pylist()
        masks = [stored[i] for i in mine]
        del stored
    del prompts, responses, rollout
    my_lens = [seqlens[i] for i in mine]
    out = {"rows": mine, "loads": {}, "micro_batches": {}, "timings": {}, "host": socket.gethostname()}
    dtype = _dtype(ctx)
    temperature = float(ctx.get("actor_rollout_ref.rollout.temperature") or 1.0)
    plan = ctx.plan

    for lp_pass in passes(plan):
        role, t0 = lp_pass.name, time.perf_counter()
        micro_size, dynamic, budget = lp_pass.sizes(plan)
        packed = lp_pass.packed(ctx)
        micro = binning.micro_batches(my_lens, rows_per_micro=micro_size, budget=budget, dynamic=dynamic,
                                      packed=packed, all_reduce=world > 1, budget_key=lp_pass.budget_key)
        load = binning.micro_batch_load(my_lens, micro)
        load["packed"] = packed
        load["token_budget"] = budget if dynamic else None
        out["loads"][role] = load
        out["micro_batches"][role] = micro_batch_records(mine, my_lens, micro)
        print(f"logprob step {ctx.step} {role} " + batching.format_load_line(rank, load), flush=True)
        model = lp_pass.load(ctx, dtype, device)
        pad_id = _pad_id(model)
        chunks = {}
        t_fwd, c_fwd = time.perf_counter(), time.process_time()
        with progress(f"logprob {role}", total=len(micro), unit="micro-batch", rank=rank) as bar:
            for mb in micro:
                batch = binning.collate_bins([[rows[i] for i in b] for b in mb], pad_id, device=device)
                for name, values in lp_pass.forward(model, batch, temperature,
                                                    bool(plan["rollout"].get("sum_pi_squared"))).items():
                    chunks.setdefault(name, []).append(values)
                bar.update(1)
        out["timings"][f"{role}_forward_s"] = round(time.perf_counter() - t_fwd, 4)
        out["timings"][f"{role}_forward_cpu_s"] = round(time.process_time() - c_fwd, 4)
        order = [binning.rows_of(mb) for mb in micro]
        for name, per_mb in chunks.items():
            out[name] = [v.tolist() for v in batching.restore_order(per_mb, order)]
            if masks is not None:
                out[name] = [[v if m else 0.0 for v, m in zip(values, mask)] for values, mask in zip(out[name], masks)]
        del model
        gc.collect()
        out["timings"][role] = round(time.perf_counter() - t0, 4)
    return out


def micro_batch_records(mine, seqlens, micro) -> dict:
    """One rank's micro-batches of a role, columnar (the update stage writes them to
    microbatches.parquet): rows (step row indices, in bin order), real and padded tokens as
    binning.collate_bins lays them out (their sums are the rank's load)."""
    loads = [binning.micro_batch_load(seqlens, [mb]) for mb in micro]
    return {"rows": [[mine[i] for i in binning.rows_of(mb)] for mb in micro],
            "real_tokens": [x["real_tokens"] for x in loads],
            "padded_tokens": [x["padded_tokens"] for x in loads]}


def runs_on_ranks(plan) -> bool:
    """Whether the stage runs forward passes on the plan's ranks (else it only writes each row's
    rank: the old log-probs come from the update's own forward). flows/step.py places logprob
    with the update's deployment only then."""
    return bool(passes(plan))


def _split(tensor, lengths) -> list:
    data = tensor.float().cpu().numpy()
    return [np.array(row[:n], dtype=np.float32) for row, n in zip(data, lengths)]


def _pad_id(model) -> int:
    cfg = model.config
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(cfg, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def _dtype(ctx) -> str:
    return "bfloat16" if ctx.get("actor_rollout_ref.actor.deepspeed.dtype") == "bf16" else "float32"


def critic_seed(ctx) -> int:
    """Seed of a new value head (critic from a causal-LM folder); the update stage uses the same."""
    return int(ctx.get("trainer.seed") or 0)


def critic_weights(ctx):
    """The critic this step's values use: critic.model.path at step 1, else the store's
    weights/critic_step_{k-1} (cached locally by checksum)."""
    from pathlib import Path

    if ctx.step <= 1:
        return Path(str(ctx.get("critic.model.path"))).expanduser()
    from storage.weights import load_folder

    return load_folder(ctx.store, ctx.layout.critic_weights(ctx.step - 1),
                       cache_dir=ctx.get("storage.cache_dir"))
