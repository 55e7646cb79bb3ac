"""reward stage: score every rollout row (verl: the reward manager, verl/workers/reward_manager/naive.py).

Each row is routed by its `data.reward_fn_key` column (default data_source) to the built-in rule
scorers (stages.scoring.scorers: in this process, as verl's reward manager) or scored by the user's
`custom_reward_function.path/.name` in worker processes with a per-row timeout
(stages.scoring.pool.score_batch; reward.num_workers, .timeout_s, .strict). A row whose scorer raises, returns a non-number/non-finite value, or times out scores 0
with the reason in `error` and is counted in reward/errors or reward/timeouts (strict: the stage
fails). With reward_model.enable, an HF sequence-classification model scores prompt + response in
batches and its score is added to the rule score (column rm_score keeps it).

reward.parquet, one row per rollout row in the same order: score, acc, extras (JSON of the reward
function's other keys; scalar extras also get a column of their own), error, rm_score (RM only).
The score is a scalar per row; the advantage stage places it at the last valid response token.

When the rollout stored greedy baseline answers (rollout/baseline.parquet: estimators that need a
"baseline", remax), they are scored the same way (rule scorers, DAPO's overlong penalty, the
reward model: verl scores its ReMax baseline with the same reward function) into
reward/baseline.parquet: uid, score, acc, extras, error; metrics reward/baseline/score/mean and
reward/baseline/acc/mean.
"""
from __future__ import annotations

import json
import math
import os
import time

import pyarrow as pa

from stages.batches.batching import restore_order
from stages.data import baseline_answers
from storage.artifacts import write_stage
from storage.schemas import make_table

STAGE = "reward"
INPUTS = ("rollout",)
CONFIG_KEYS = ("data.reward_fn_key", "custom_reward_function", "reward", "reward_model")
RESERVED_COLUMNS = ("score", "acc", "extras", "error", "rm_score", "overlong_reward", "overlong")


class RewardInputError(ValueError):
    """The rollout cannot be scored as configured (missing column, bad extra_info)."""


class NonFiniteScoreError(ValueError):
    """A final score is NaN or infinite; the message names the rows."""


def run(ctx) -> dict:
    rollout = ctx.read_input("rollout")
    table, metrics, timings = score_rows(ctx, rollout)
    if table.num_rows != rollout.num_rows:  # cannot happen unless score_batch drops rows
        raise RuntimeError(f"reward table has {table.num_rows} rows, rollout has {rollout.num_rows}")
    files = {"reward.parquet": table}
    baseline = baseline_answers.read_answers(ctx) if baseline_answers.needs_baseline(ctx) else None
    if baseline is not None:
        t1 = time.perf_counter()
        scored, baseline_metrics, _ = score_rows(ctx, baseline, "baseline score")
        files[baseline_answers.SCORES] = scored.append_column("uid", baseline.column("uid"))
        metrics.update({"reward/baseline/score/mean": baseline_metrics["reward/score/mean"],
                        "reward/baseline/acc/mean": baseline_metrics["reward/acc/mean"]})
        timings["baseline_score_s"] = round(time.perf_counter() - t1, 4)
    fingerprint = stage_fingerprint(ctx)
    return write_stage(ctx.store, ctx.layout, ctx.step, STAGE, files, fingerprint=fingerprint,
                       inputs=ctx.input_fingerprints(INPUTS), timings=timings,
                       extra={"metrics": metrics})


def score_rows(ctx, rollout: pa.Table, what: str = "score"):
    """(reward table, metrics, timings) of rollout-schema rows: rule scores (+ overlong penalty),
    plus the reward model's when reward_model.enable."""
    t0 = time.perf_counter()
    results, scores, metrics, overlong = rule_rewards(ctx, rollout)
    timings = {"score_s": round(time.perf_counter() - t0, 4)}
    rm_scores = None
    if ctx.get("reward_model.enable"):
        t1 = time.perf_counter()
        rm_scores = reward_model_scores(ctx, rollout)
        scores = [s + rm for s, rm in zip(scores, rm_scores)]
        timings["reward_model_s"] = round(time.perf_counter() - t1, 4)
    check_finite(scores, what)
    table = reward_table(results, scores, rm_scores, overlong)
    metrics.update(score_metrics(table))
    return table, metrics, timings


def rule_rewards(ctx, rollout: pa.Table):
    """Score the rows with the rule scorers / the user's function (isolated, with timeouts), plus
    DAPO's overlong penalty when reward_model.reward_manager=dapo and overlong_buffer.enable.
    Returns (scorer results, scores, metrics, overlong penalties or None). The dynamic sampling of
    the rollout stage scores its generation batches with the same function."""
    from stages.scoring.pool import in_process, score_batch

    rows = scoring_rows(rollout, ctx.get("data.reward_fn_key", "data_source"))
    fn_spec = reward_fn_spec(ctx)
    workers, timeout = int(ctx.get("reward.num_workers", 2)), float(ctx.get("reward.timeout_s", 10.0))
    pool = ctx.session.scorers(fn_spec, workers, timeout) if ctx.session is not None and not in_process(fn_spec, workers) else None
    results, metrics = score_batch(rows, fn_spec, num_workers=workers, timeout_s=timeout,
                                   strict=bool(ctx.get("reward.strict", False)), pool=pool)
    scores = [r["score"] for r in results]
    overlong = None
    if ctx.get("reward_model.reward_manager") == "dapo" and ctx.get("reward_model.overlong_buffer.enable"):
        overlong = overlong_penalties(rollout.column("response_length").to_pylist(),
                                      int(ctx.get("data.max_response_length")),
                                      int(ctx.get("reward_model.overlong_buffer.len")),
                                      float(ctx.get("reward_model.overlong_buffer.penalty_factor")))
        scores = [s + o for s, o in zip(scores, overlong)]
        metrics["reward/overlong/fraction"] = sum(o < 0 for o in overlong) / max(1, len(overlong))
    return results, scores, metrics, overlong


def overlong_penalties(lengths, max_response_length: int, buffer_len: int, penalty_factor: float) -> list[float]:
    """verl's DAPORewardManager: min(-(length - (max_response_length - buffer_len)) / buffer_len ×
    penalty_factor, 0) per response (length in tokens, EOS included)."""
    expected = max_response_length - buffer_len
    return [min(-(n - expected) / buffer_len * penalty_factor, 0.0) for n in lengths]


def reward_fn_spec(ctx) -> dict:
    """verl's custom_reward_function keys (no path: the built-in scorers)."""
    return {"path": ctx.get("custom_reward_function.path"), "name": ctx.get("custom_reward_function.name"),
            "reward_kwargs": ctx.get("custom_reward_function.reward_kwargs") or {}}


def stage_fingerprint(ctx) -> str:
    """ctx.fingerprint plus the content of the custom reward file (editing it reruns the stage)."""
    from storage.artifacts import fingerprint as hash_obj

    base = ctx.fingerprint(STAGE, CONFIG_KEYS, INPUTS)
    path = ctx.get("custom_reward_function.path")
    if not path:
        return base
    from stages.scoring.reward_fns import reward_file_sha256

    digest = reward_file_sha256(os.path.abspath(os.path.expanduser(path)))
    return hash_obj({"base": base, "custom_reward_file_sha256": digest})


def scoring_rows(rollout: pa.Table, reward_fn_key: str) -> list[dict]:
    """score_batch rows (data_source, solution_str, ground_truth, extra_info) from rollout rows."""
    if reward_fn_key not in rollout.schema.names:
        raise RewardInputError(f"data.reward_fn_key={reward_fn_key!r} is not a column of "
                               f"rollout.parquet (columns: {', '.join(rollout.schema.names)})")
    sources = rollout.column(reward_fn_key).to_pylist()
    responses = rollout.column("response").to_pylist()
    truths = rollout.column("ground_truth").to_pylist()
    extras = rollout.column("extra_info").to_pylist()
    rows, flat = [], {}  # flat: extra_info text -> its object when that is a dict of scalars
    for i, (source, response, truth, extra) in enumerate(zip(sources, responses, truths, extras)):
        parsed = flat.get(extra)  # the n samples of a prompt share its text: parsed once, each
        if parsed is not None:    # row gets its own copy (a function may change the dict it gets)
            info = dict(parsed)
        else:
            info = parse_extra_info(extra, i)
            if type(info) is dict and all(v is None or type(v) in _SCALARS for v in info.values()):
                flat[extra] = dict(info)
        rows.append({"data_source": source, "solution_str": response or "",
                     "ground_truth": truth, "extra_info": info})
    return rows


_SCALARS = (str, int, float, bool)


def parse_extra_info(text, row: int):
    """rollout's extra_info column is JSON text (empty or null: None)."""
    if text is None or text == "":
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RewardInputError(f"rollout.parquet row {row}: extra_info is not valid JSON "
                               f"({exc}): {text[:80]!r}") from exc


def check_finite(values, what: str, where: str = "reward") -> None:
    bad = [i for i, v in enumerate(values) if v is None or not math.isfinite(v)]
    if bad:
        shown = ", ".join(str(i) for i in bad[:20]) + (" ..." if len(bad) > 20 else "")
        raise NonFiniteScoreError(f"{where}: {what} is NaN/inf/missing in {len(bad)} row(s): "
                                  f"rows {shown}")


def reward_table(results: list[dict], scores: list[float], rm_scores=None, overlong=None) -> pa.Table:
    """score, acc (the scorer's acc; else the score), extras JSON, error, scalar extras, rm_score,
    overlong_reward/overlong (DAPO's overlong buffer)."""
    columns = {
        "score": scores,
        "acc": [0.0 if r["error"] else float(r["acc"]) if r["acc"] is not None else float(r["score"])
                for r in results],
        "extras": [json.dumps(r["extras"], sort_keys=True, default=str) if r["extras"] else "{}" for r in results],
        "error": [r["error"] for r in results],
    }
    if rm_scores is not None:
        columns["rm_score"] = rm_scores
    if overlong is not None:
        columns["overlong_reward"], columns["overlong"] = overlong, [o < 0 for o in overlong]
    for key in sorted({k for r in results for k in r["extras"]}):
        if key in RESERVED_COLUMNS:
            continue
        values = [r["extras"].get(key) for r in results]
        if all(v is None or isinstance(v, (bool, int, float, str)) for v in values):
            try:
                columns[key] = pa.array(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                pass  # mixed types: only in the extras JSON
    columns["error"] = pa.array(columns["error"], type=pa.string())
    return make_table("reward", columns)


def score_metrics(table: pa.Table) -> dict:
    scores = table.column("score").to_pylist()
    accs = table.column("acc").to_pylist()
    metrics = {"reward/score/mean": sum(scores) / len(scores) if scores else 0.0,
               "reward/score/max": max(scores, default=0.0),
               "reward/score/min": min(scores, default=0.0),
               "reward/acc/mean": sum(accs) / len(accs) if accs else 0.0}
    if "rm_score" in table.schema.names:
        rm = table.column("rm_score").to_pylist()
        metrics["reward/rm_score/mean"] = sum(rm) / len(rm) if rm else 0.0
    return metrics


# ---- reward model ---------------------------------------------------------------------------
def reward_model_scores(ctx, rollout: pa.Table) -> list[float]:
    """Score prompt + response text with reward_model.model.path (num_labels=1), batched."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = os.path.expanduser(ctx.get("reward_model.model.path"))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"reward_model.model.path {path!r} is not a folder "
                                "(an HF sequence-classification model)")
    trust = bool(ctx.get("reward_model.model.trust_remote_code", False))
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    model = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=trust,
                                                               dtype=torch.float32)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {path} has num_labels={model.config.num_labels}; "
                         "a reward model outputs one score (num_labels=1)")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    device = "cuda" if ctx.get("trainer.device") == "cuda" and torch.cuda.is_available() else "cpu"
    model.to(device).eval()
    max_length = ctx.get("reward_model.max_length")
    texts = [(p or "") + (r or "") for p, r in zip(rollout.column("prompt").to_pylist(),
                                                   rollout.column("response").to_pylist())]
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    if max_length:
        encoded = [ids[-int(max_length):] for ids in encoded]  # keep the response end
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batches, chunks = rm_batches(ctx, encoded), []
    with torch.no_grad():
        for batch in batches:
            width = max(len(encoded[i]) for i in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attn = torch.zeros((len(batch), width), dtype=torch.long)
            for j, i in enumerate(batch):  # right padding: the model reads the last non-pad token
                ids[j, :len(encoded[i])] = torch.tensor(encoded[i])
                attn[j, :len(encoded[i])] = 1
            logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits
            # transformers pools at the rightmost token != pad id: wrong only when a text ends in
            # the pad token itself, then those rows are scored one by one without padding
            chunks.append(logits[:, 0].float().cpu().tolist() if _pad_safe(encoded, batch, pad)
                          else _last_token_scores(model, ids, attn, device))
    return restore_order(chunks, batches)  # token-budget batches are not in row order


def _pad_safe(encoded, batch, pad) -> bool:
    return all(encoded[i] and encoded[i][-1] != pad for i in batch)


def _last_token_scores(model, ids, attn, device) -> list[float]:
    """Per-row forward (no padding) when the pad id also occurs in the text."""
    out = []
    for j in range(ids.shape[0]):
        n = int(attn[j].sum())
        out.append(float(model(input_ids=ids[j:j + 1, :n].to(device)).logits[0, 0]))
    return out


def rm_batches(ctx, encoded: list) -> list[list[int]]:
    """Row batches from the plan, grouped as every stage's micro-batches (binning.micro_batches)
    with one sequence per tensor row (the head reads each row's last token):
    micro_batch_size_per_gpu consecutive rows, or with use_dynamic_bsz at most
    forward_max_token_len_per_gpu padded tokens per batch, longest rows first."""
    from stages.batches.binning import micro_batches, rows_of

    plan_rm = ctx.plan["reward_model"]  # the plan checked the sizes (configs/plan.py::_reward_model)
    dynamic, micro = plan_rm["use_dynamic_bsz"], plan_rm["micro_batch_size_per_gpu"]
    key = "reward_model.forward_max_token_len_per_gpu"
    budget = int(plan_rm["forward_max_token_len_per_gpu"]) if dynamic else None
    groups = micro_batches([len(ids) for ids in encoded], rows_per_micro=micro, budget=budget,
                           dynamic=dynamic, packed=False, all_reduce=False, budget_key=key)
    return [rows_of(group) for group in groups]
