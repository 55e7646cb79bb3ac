"""What `stagerl inspect` and `stagerl show` compute from a run (storage.run_view.RunView): one
step's per-stage summary, the best and worst samples, one sample joined across the five stages;
plus opening the run a command names (its arguments: flows/cli/args.py) and the error handling
every run command shares."""
from __future__ import annotations

import functools
import os
import sys

from storage.layout import STAGES

ERROR_EXIT = 2


# ---- shared CLI plumbing (the arguments themselves: flows/cli/args.py) ----------------------------
def load_cli_config(args, overrides=()):
    from configs.loader import load_config

    return load_config(args.config, list(overrides))


def open_view(args, cfg=None):
    """The RunView named by --root/--project/--config and args.experiment."""
    from storage.run_view import RunView
    from storage.store import Store

    cfg = cfg or load_cli_config(args)
    storage = dict(cfg.get("storage") or {})
    storage["root"] = args.root or os.environ.get("STAGERL_ROOT") or storage.get("root")
    project = args.project or (cfg.get("trainer") or {}).get("project_name")
    return RunView.open(Store.from_config(storage), project, args.experiment)


def find_experiment(args):
    """(store, root, project, experiment) of args.experiment (EXP or PROJECT/EXP) under --root,
    else $STAGERL_ROOT, else ./runs; LookupError naming it when there is no such run."""
    from storage.layout import RunLayout
    from storage.store import Store

    root = args.root or os.environ.get("STAGERL_ROOT") or "./runs"
    store = Store.from_config({"root": root})
    return (store, root, *RunLayout.find(store, args.experiment))


def find_experiment_or_say(args):
    """find_experiment for the commands that act on a run (resume, verify, delete): None after
    printing "error: ..." when there is no such run (the caller exits 2)."""
    try:
        return find_experiment(args)
    except LookupError as exc:
        print(f"error: {exc}")
        return None


def guarded(func):
    """Run a command; a missing run/step, bad config or bad name prints one line, exit code 2."""
    @functools.wraps(func)
    def wrapper(args):
        from configs.schema import ConfigError
        from storage.artifacts import ChecksumError, IncompleteError
        from storage.layout import InvalidName
        from storage.run_view import RunNotFound, StepIncomplete

        try:
            return func(args)
        except (RunNotFound, StepIncomplete, IncompleteError, ChecksumError, ConfigError,
                InvalidName, FileNotFoundError, LookupError, ValueError) as exc:
            msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            print(f"stagerl {args.command}: error: {msg}", file=sys.stderr)
            return ERROR_EXIT
    return wrapper


# ---- numbers from tables ------------------------------------------------------------------------
def _stats(values) -> dict:
    values = [float(v) for v in values if v is not None]
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def token_mean(table, column: str, mask=None):
    """Mean over every token of every row (None when the column is absent or has no tokens);
    with `mask` (response_mask_of: a multi-turn rollout's) over the tokens the policy sampled only."""
    import pyarrow.compute as pc

    if column not in table.schema.names:
        return None
    flat = pc.list_flatten(table.column(column))
    if mask is not None and len(mask) == len(flat):
        flat = pc.filter(flat, mask)
    return None if len(flat) == 0 else float(pc.mean(flat).as_py())


def response_mask_of(view, step: int):
    """A multi-turn rollout's response_mask, flattened to one boolean per response token (True:
    sampled by the policy, False: a tool response); None for a single-turn rollout."""
    import pyarrow.compute as pc

    if view.manifest(step, "rollout") is None:   # (a stage's section read before the rollout committed)
        return None
    rollout = view.table(step, "rollout")
    if "response_mask" not in rollout.schema.names:
        return None
    return pc.equal(pc.list_flatten(rollout.column("response_mask")), 1)


def turns_table(view, step: int):
    """The turns of a multi-turn step (one row per assistant turn and tool call), else None."""
    from storage.query import step_turns

    return step_turns(view.store, view.layout, step, view.manifest(step, "rollout") or {})


def multi_turn_metrics(view, step: int) -> dict | None:
    """Turns per trajectory, tool calls per tool, error counts and rates by kind, the
    correct-tool-use rate (stages.engines.agent_loop.correct_tool_use), tool latency and the share
    of response tokens that are tool responses, from the step's turns table."""
    from stages.engines.agent_loop import correct_tool_use

    turns = turns_table(view, step)
    if turns is None:
        return None
    rollout = view.table(step, "rollout")
    t = turns.to_pydict()
    tool = [i for i, role in enumerate(t["role"]) if role == "tool"]
    per_row: dict = {}
    for i, role in enumerate(t["role"]):
        if role == "assistant":
            per_row[t["row"][i]] = per_row.get(t["row"][i], 0) + 1
    calls, errors = {}, {}
    for i in tool:
        calls[t["tool"][i] or "?"] = calls.get(t["tool"][i] or "?", 0) + 1
        if t["error"][i]:
            errors[t["error"][i]] = errors.get(t["error"][i], 0) + 1
    masks = rollout.column("response_mask").to_pylist()
    tokens = sum(len(m) for m in masks)
    return {"num_turns": _stats(rollout.column("num_turns").to_pylist()),
            "assistant_turns": _stats(per_row.get(r, 0) for r in range(rollout.num_rows)),
            "tool_calls": len(tool), "tool_calls_per_sample": len(tool) / rollout.num_rows if rollout.num_rows else 0.0,
            "calls_by_tool": calls, "errors": errors,
            "correct_tool_use": correct_tool_use(t, rollout.column("ground_truth").to_pylist()),
            "error_rate": {kind: n / len(tool) for kind, n in errors.items()},
            "tool_latency_s": _stats(t["latency_s"][i] for i in tool),
            "tool_token_share": (tokens - sum(sum(m) for m in masks)) / tokens if tokens else 0.0}


def seq_means(table, column: str) -> list:
    """Per-row mean of a per-token column (None for empty rows)."""
    return [sum(v) / len(v) if v else None for v in table.column(column).to_pylist()]


def stage_header(view, step: int, stage: str) -> dict:
    manifest = view.manifest(step, stage)
    if manifest is None:
        return {"status": "incomplete"}
    return {"status": "complete", "rows": manifest.get("row_count"),
            "bytes": manifest.get("bytes"), "timings": manifest.get("timings") or {}}


def rollout_metrics(view, step: int) -> dict:
    t = view.table(step, "rollout")
    lengths = t.column("response_length").to_pylist()
    limit = view.max_response_length
    resp = _stats(lengths)
    resp["clip_ratio"] = (sum(1 for n in lengths if n >= limit) / len(lengths)
                          if limit and lengths else None)
    reasons = {}
    for r in t.column("finish_reason").to_pylist():
        reasons[r] = reasons.get(r, 0) + 1
    out = {"response_length": resp,
           "prompt_length": _stats(len(ids) for ids in t.column("prompt_ids").to_pylist()),
           "finish_reason": reasons, "prompts": len(set(t.column("uid").to_pylist()))}
    multi = multi_turn_metrics(view, step)
    if multi is not None:  # multi-turn: the turns table's numbers
        out["multi_turn"] = multi
    filtered = (view.manifest(step, "rollout").get("extra") or {}).get("filter_groups")
    if filtered:  # DAPO's dynamic sampling: what was generated, kept and filtered
        out["filter_groups"] = filtered
    baseline = baseline_table(view, step, "rollout")
    if baseline is not None:  # greedy baseline answers (remax), not training rows
        reasons = {}
        for r in baseline.column("finish_reason").to_pylist():
            reasons[r] = reasons.get(r, 0) + 1
        out["baseline"] = {"prompts": baseline.num_rows,
                           "response_length": _stats(baseline.column("response_length").to_pylist()),
                           "finish_reason": reasons}
    return out


def policy_lag(view, step: int) -> dict:
    """Which weights step `step`'s rollout sampled (trainer.staleness: the update max(0, k-1-s),
    0 = the initial or warm-start weights), its staleness, and, when the rollout kept the engine's
    log-probs and the old log-probs were computed, the behaviour (engine) vs proximal (trainer)
    gap per response token: k1 KL(engine || trainer) = mean(lp_engine - lp_trainer) and the
    importance weights exp(lp_trainer - lp_engine) (mean, quantiles, max, the share above the
    rollout correction's threshold)."""
    import pyarrow.compute as pc

    extra = (view.manifest(step, "rollout") or {}).get("extra") or {}
    version = extra.get("policy_version", max(step - 1, 0))
    out = {"policy_version": version, "staleness": extra.get("staleness", step - 1 - version)}
    rollout = view.table(step, "rollout")
    if "rollout_log_probs" not in rollout.schema.names or not view.manifest(step, "logprob"):
        return out
    logprob = view.table(step, "logprob")
    if "old_log_probs" not in logprob.schema.names:
        return out
    engine = pc.list_flatten(rollout.column("rollout_log_probs"))
    trainer = pc.list_flatten(logprob.column("old_log_probs"))
    if len(engine) != len(trainer) or not len(engine):
        return out
    mask = response_mask_of(view, step)
    if mask is not None:  # multi-turn: the tokens the engine sampled, not the tool responses
        engine, trainer = pc.filter(engine, mask), pc.filter(trainer, mask)
    log_ratio = pc.subtract(trainer, engine)  # log(pi_trainer / pi_engine) per token
    weights = pc.exp(log_ratio)
    threshold = float(view.config_value("algorithm.rollout_correction.rollout_is_threshold", 2.0) or 2.0)
    q = pc.quantile(weights, q=[0.05, 0.5, 0.95])
    out["engine_vs_trainer"] = {"kl_k1": -float(pc.mean(log_ratio).as_py()),
                                "abs_log_ratio_mean": float(pc.mean(pc.abs(log_ratio)).as_py()),
                                "tokens": len(engine)}
    out["is_weights"] = {"mean": float(pc.mean(weights).as_py()), "p05": q[0].as_py(), "p50": q[1].as_py(),
                         "p95": q[2].as_py(), "max": float(pc.max(weights).as_py()),
                         f"share_above_{threshold:g}": float(pc.mean(pc.greater(weights, threshold)).as_py())}
    return out


def baseline_table(view, step: int, stage: str):
    """The step's greedy baseline answers (stage rollout: rollout/baseline.parquet) or their scores
    (stage reward: reward/baseline.parquet), when the estimator needed them (remax); else None."""
    from stages.data import baseline_answers
    from storage.artifacts import read_file

    name = baseline_answers.ANSWERS if stage == "rollout" else baseline_answers.SCORES
    manifest = view.manifest(step, stage)
    if manifest is None or name not in (manifest.get("files") or {}):
        return None
    return read_file(view.store, view.layout, step, stage, name)


def logprob_metrics(view, step: int) -> dict:
    t = view.table(step, "logprob")
    mask = response_mask_of(view, step)  # multi-turn: means over the sampled tokens
    out = {"entropy/token_mean": token_mean(t, "entropy", mask),
           "old_log_prob/token_mean": token_mean(t, "old_log_probs", mask)}
    if "ref_log_probs" in t.schema.names and "old_log_probs" in t.schema.names:
        # (the old log-probs may come from the update's forward: absent until the update commits)
        import pyarrow.compute as pc
        old = pc.list_flatten(t.column("old_log_probs"))
        ref = pc.list_flatten(t.column("ref_log_probs"))
        if mask is not None and len(mask) == len(old):
            old, ref = pc.filter(old, mask), pc.filter(ref, mask)
        out["kl_old_ref_k1/token_mean"] = (float(pc.mean(pc.subtract(old, ref)).as_py())
                                           if len(old) else None)
    if "values" in t.schema.names:
        out["values/token_mean"] = token_mean(t, "values")
    extra = view.stage_extra(step, "logprob")  # loads {role: [per rank]}, rank_timings
    return {"metrics": out, "loads": {k: extra[k] for k in ("loads", "rank_timings") if k in extra}}


def reward_metrics(view, step: int) -> dict:
    t = view.table(step, "reward")
    out = {"score": _stats(t.column("score").to_pylist()),
           "acc_mean": _stats(t.column("acc").to_pylist())["mean"]}
    if "error" in t.schema.names:
        out["errors"] = sum(1 for e in t.column("error").to_pylist() if e)
    baseline = baseline_table(view, step, "reward")
    if baseline is not None:  # the greedy baseline answers' scores (remax subtracts them)
        out["baseline_score"] = _stats(baseline.column("score").to_pylist())
    return out


def advantage_metrics(view, step: int) -> dict:
    t = view.table(step, "advantage")
    mask = response_mask_of(view, step)
    return {"advantage/token_mean": token_mean(t, "advantages", mask),
            "kl_in_reward/token_mean": token_mean(t, "kl", mask),
            "data_metrics": view.data_metrics(step)}


def update_pass(microbatches, role: str = "actor") -> list:
    """An update role's micro-batches of the first PPO epoch (the table also holds the other
    role's, the logprob passes' and later epochs', which repeat the same rows), as dicts. Default:
    the policy's, stages.training.roles.policy_role() (not imported here: it loads torch); a row
    without a role is the actor's."""
    return [r for r in microbatches.to_pylist() if (r.get("role") or "actor") == role and not r.get("epoch")]


def rank_balance(microbatches) -> dict:
    """Per rank (actor, first epoch): micro-batches, rows, real and padded tokens; max/mean of
    rows and real tokens."""
    ranks = {}
    for r in update_pass(microbatches):
        entry = ranks.setdefault(r["rank"], {"rank": r["rank"], "micro_batches": 0, "rows": 0,
                                             "real_tokens": 0, "padded_tokens": 0})
        entry["micro_batches"] += 1
        entry["rows"] += len(r["rows"])
        entry["real_tokens"] += r["real_tokens"]
        entry["padded_tokens"] += r["padded_tokens"]
    per_rank = [ranks[k] for k in sorted(ranks)]

    def max_over_mean(key):
        vals = [e[key] for e in per_rank]
        mean = sum(vals) / len(vals) if vals else 0
        return max(vals) / mean if mean else None
    return {"ranks": per_rank, "rows_max_over_mean": max_over_mean("rows"),
            "tokens_max_over_mean": max_over_mean("real_tokens")}


def update_metrics(view, step: int) -> dict:
    metrics = {k: v for k, v in view.update_metrics(step).items()
               if not k.startswith(LOAD_METRICS)}
    balance = rank_balance(view.table(step, "update"))
    return {"rows": sum(r["rows"] for r in balance["ranks"]), "metrics": metrics,
            "losses": {k: v for k, v in metrics.items() if "loss" in k},
            "balance": balance,
            "loads": view.update_metrics(step, raw=True).get(LOAD_METRICS) or {}}


LOAD_METRICS = "update/micro_batch_loads"  # per role/rank loads the update stage records
STAGE_METRICS = {"rollout": rollout_metrics, "logprob": logprob_metrics,
                 "reward": reward_metrics, "advantage": advantage_metrics,
                 "update": update_metrics}


def samples(view, step: int, k: int = 2) -> dict:
    """The k best and k worst rows by score (ties: higher advantage first for best)."""
    rollout, reward = view.table(step, "rollout"), view.table(step, "reward")
    adv = (seq_means(view.table(step, "advantage"), "advantages")
           if view.manifest(step, "advantage") else [None] * rollout.num_rows)
    rows = []
    for i, (uid, idx, prompt, response, score, acc) in enumerate(zip(
            rollout.column("uid").to_pylist(), rollout.column("sample_index").to_pylist(),
            rollout.column("prompt").to_pylist(), rollout.column("response").to_pylist(),
            reward.column("score").to_pylist(), reward.column("acc").to_pylist())):
        rows.append({"row": i, "uid": uid, "sample_index": idx, "prompt": prompt,
                     "response": response, "score": score, "acc": acc, "advantage": adv[i]})
    adv_key = lambda r: r["advantage"] if r["advantage"] is not None else 0.0  # noqa: E731
    best = sorted(rows, key=lambda r: (-r["score"], -adv_key(r), r["row"]))[:k]
    worst = sorted(rows, key=lambda r: (r["score"], adv_key(r), r["row"]))[:k]
    return {"best": best, "worst": worst}


def step_summary(view, step: int, stage: str = None, n_samples: int = 2) -> dict:
    """Per stage: status, rows, timings and metrics; the step's best/worst samples."""
    status = view.status(step)
    out = {"step": step, "status": "complete" if all(status.values()) else "incomplete",
           "stages": {}}
    for name in ([stage] if stage else STAGES):
        section = stage_header(view, step, name)
        if section["status"] == "complete":
            section.update(STAGE_METRICS[name](view, step))
        out["stages"][name] = section
    if stage is None:
        out["time_s"] = stored_time_split(view, step)
    if stage in (None, "rollout") and status["rollout"]:
        out["policy"] = policy_lag(view, step)
    if (stage in (None, "reward")) and status["rollout"] and status["reward"]:
        out["samples"] = samples(view, step, n_samples)
    return out


# the seconds each stage's manifest records for its own work (its storage writes included)
STAGE_SECONDS = {"rollout": ("rollout_s", "table_s", "storage_write_s"), "logprob": ("logprob_s", "storage_write_s"),
                 "reward": ("score_s", "storage_write_s"), "advantage": ("adv_s", "storage_write_s"),
                 "update": ("timing/update_s",)}


def stored_time_split(view, step: int) -> dict:
    """flows.step_report.time_split of a step from what its manifests record: generation, the
    update's train loop and each stage's own seconds (the flow's step time and orchestration are
    not stored: the console line and bench/step.py have them)."""
    from flows.step_report import time_split

    metrics = {}
    for stage, keys in STAGE_SECONDS.items():
        manifest = view.manifest(step, stage)
        timings = (manifest or {}).get("timings") or {}
        parts = [timings[k] for k in keys if isinstance(timings.get(k), (int, float))]
        if parts:
            metrics[f"timing_s/{stage}"] = sum(parts)
        if stage == "rollout" and isinstance(timings.get("generate_s"), (int, float)):
            metrics["timing/generate_s"] = timings["generate_s"]
        if stage == "update" and isinstance(timings.get("timing/update_compute_s"), (int, float)):
            metrics["timing/update_compute_s"] = timings["timing/update_compute_s"]
    return time_split(metrics)


def overview_row(view, step: int) -> dict:
    """One line of `stagerl inspect EXP`: the main numbers of a step from what is complete."""
    status = view.status(step)
    row = {"step": step, "status": "complete" if all(status.values()) else "incomplete",
           "missing": [s for s in STAGES if not status[s]]}
    if status["rollout"]:
        row["rows"] = view.table(step, "rollout").num_rows
        row["response_length/mean"] = rollout_metrics(view, step)["response_length"]["mean"]
        lag = policy_lag(view, step)  # trainer.staleness: the weights sampled and the IS weights
        row["version"], row["staleness"] = lag["policy_version"], lag["staleness"]
        row["is_weight/mean"] = (lag.get("is_weights") or {}).get("mean")
        row["engine_kl_k1"] = (lag.get("engine_vs_trainer") or {}).get("kl_k1")
        multi = multi_turn_metrics(view, step)
        if multi is not None:  # multi-turn: turns per sample, tool calls, their errors
            row["turns/mean"] = multi["num_turns"]["mean"]
            row["tool_calls/sample"] = multi["tool_calls_per_sample"]
            row["tool_error_rate"] = sum(multi["errors"].values()) / multi["tool_calls"] if multi["tool_calls"] else 0.0
            row["correct_tool_use"] = multi["correct_tool_use"]
    if status["reward"]:
        r = reward_metrics(view, step)
        row["score/mean"], row["acc/mean"] = r["score"]["mean"], r["acc_mean"]
    if status["logprob"]:
        m = logprob_metrics(view, step)["metrics"]
        row["entropy"], row["kl"] = m["entropy/token_mean"], m.get("kl_old_ref_k1/token_mean")
    if status["update"]:
        m = view.update_metrics(step)
        row["pg_loss"] = m.get("actor/pg_loss")
        row["engine_kl"] = m.get("rollout_corr/kl")  # rollout engine vs trainer (calculate_log_probs runs)
    return row


# ---- one sample across the stages ---------------------------------------------------------------
def find_row(view, step: int, uid: str, sample: int) -> int:
    t = view.table(step, "rollout")
    uids, idx = t.column("uid").to_pylist(), t.column("sample_index").to_pylist()
    for i, (u, s) in enumerate(zip(uids, idx)):
        if u == uid and s == sample:
            return i
    known = sorted(set(uids))
    if uid not in known:
        raise LookupError(f"step {step} of {view.name} has no uid {uid!r} (uids: "
                          f"{', '.join(known[:10])}{' ...' if len(known) > 10 else ''})")
    have = sorted(s for u, s in zip(uids, idx) if u == uid)
    raise LookupError(f"uid {uid!r} of step {step} has no sample {sample} (samples: {have})")


def load_tokenizer_for(view, step: int):
    """The tokenizer the step sampled with: the run's model path, else weights/step_{k-1};
    None (token ids shown) when neither is readable here."""
    from stages.model.models import load_tokenizer

    candidates = []
    path = view.config_value("actor_rollout_ref.model.path")
    if path:
        candidates.append(lambda: load_tokenizer(os.path.expanduser(str(path))))
    if step > 1:
        from storage.weights import load_weights
        candidates.append(lambda: load_tokenizer(load_weights(view.store, view.layout, step - 1)))
    for make in candidates:
        try:
            return make()
        except Exception:
            continue
    return None


def sample_view(view, step: int, uid: str, sample: int = 0, tokenizer=None) -> dict:
    """One rollout row joined with its logprob, reward, advantage rows and update micro-batches;
    `tokens` lists per-token id, text, and every per-token value of the complete stages."""
    view.require(step, ["rollout"])
    row = find_row(view, step, uid, sample)
    status = view.status(step)
    r = view.table(step, "rollout").slice(row, 1).to_pylist()[0]
    out = {"step": step, "row": row, "uid": uid, "sample_index": sample,
           "status": {s: ("complete" if status[s] else "incomplete") for s in STAGES},
           "rollout": {k: v for k, v in r.items() if k not in ("response_ids", "rollout_log_probs")}}
    per_token = {"token_id": r["response_ids"]}
    if r.get("response_mask") is not None:  # multi-turn: 1 sampled by the policy, 0 a tool response
        per_token["mask"] = r["response_mask"]
        out["rollout"].pop("response_mask", None)
        turns = turns_table(view, step)
        if turns is not None:
            out["turns"] = [{k: v for k, v in t.items() if k not in ("step", "row", "uid", "sample_index")}
                            for t in turns.filter(_equal(turns, "row", row)).to_pylist()]
    if r.get("rollout_log_probs") is not None:
        per_token["rollout_log_prob"] = r["rollout_log_probs"]
    for stage, columns in (("logprob", {"old_log_probs": "old_log_prob",
                                        "ref_log_probs": "ref_log_prob",
                                        "entropy": "entropy", "values": "value"}),
                           ("advantage", {"advantages": "advantage", "returns": "return",
                                          "token_level_rewards": "token_reward", "kl": "kl"})):
        if status[stage]:
            rec = view.table(step, stage).slice(row, 1).to_pylist()[0]
            for col, label in columns.items():
                if rec.get(col) is not None:
                    per_token[label] = rec[col]
    if status["reward"]:
        out["reward"] = view.table(step, "reward").slice(row, 1).to_pylist()[0]
    answers = baseline_table(view, step, "rollout")
    if answers is not None:  # the prompt's greedy baseline answer and its score (remax)
        at = answers.column("uid").to_pylist().index(uid)
        a = answers.slice(at, 1).to_pylist()[0]
        out["baseline"] = {k: a[k] for k in ("response", "response_length", "finish_reason")}
        scores = baseline_table(view, step, "reward") if status["reward"] else None
        if scores is not None:
            out["baseline"]["score"] = scores.column("score").to_pylist()[scores.column("uid").to_pylist().index(uid)]
    if status["update"]:
        out["update"] = [{k: v for k, v in mb.items() if k != "rows"}
                         for mb in view.table(step, "update").to_pylist() if row in mb["rows"]]
    if tokenizer is not None:
        per_token["token"] = [tokenizer.decode([t]) for t in r["response_ids"]]
    out["tokens"] = [dict(zip(per_token, vals)) for vals in zip(*per_token.values())]
    return out


def _equal(table, column: str, value):
    import pyarrow.compute as pc

    return pc.equal(table.column(column), value)
