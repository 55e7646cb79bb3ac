"""Token-length statistics and length/budget recommendations (`stagerl stats`).

Prompt lengths are counted as the rollout sees them: the dataset's chat messages through the
tokenizer's chat template (add_generation_prompt=True, data.apply_chat_template_kwargs), no
special tokens added. Response lengths come from a run's committed rollout.parquet files.

Recommendations (each with its reasoning):
  data.max_prompt_length    the longest prompt rounded up to a multiple of 64 (truncation=error
                            refuses any prompt over it); p99 rounded up when overlong prompts
                            may be filtered (filter_overlong_prompts=true), with the count lost
  data.max_response_length  p95 of the run's responses rounded up to a multiple of 64 when at
                            most 5 % were clipped; twice the run's limit when more were clipped
                            (the model wants to say more); the config's value without a run
  ppo_max_token_len_per_gpu the budget that fits N typical rows (N = the static micro-batch
                            size, typical = p50 prompt + p50 response) rounded up to 64, never
                            below one longest row (max_prompt_length + max_response_length)
  log_prob_max_token_len_per_gpu  the same for the log-prob micro-batch size
"""
from __future__ import annotations

import math

PERCENTILES = (50, 90, 95, 99)
ROUND_TO = 64
CLIP_LIMIT = 0.05


def round_up(x: float, multiple: int = ROUND_TO) -> int:
    return int(max(1, math.ceil(x / multiple)) * multiple)


def distribution(lengths) -> dict:
    """count, mean, p50/p90/p95/p99 (observed values: numpy 'higher' method) and max."""
    import numpy as np

    arr = np.asarray(list(lengths), dtype=np.int64)
    if arr.size == 0:
        return {"count": 0}
    out = {"count": int(arr.size), "mean": float(arr.mean())}
    for q in PERCENTILES:
        out[f"p{q}"] = int(np.percentile(arr, q, method="higher"))
    out["max"] = int(arr.max())
    return out


def prompt_lengths(dataset_path: str, data_cfg: dict, tokenizer, chat_template: str | None = None) -> list:
    """Token count of each dataset prompt after the chat template."""
    from stages.data.files import read_parquet_rows

    key = data_cfg.get("prompt_key", "prompt")
    kwargs = dict(data_cfg.get("apply_chat_template_kwargs") or {})
    if chat_template:  # actor_rollout_ref.model.custom_chat_template
        kwargs["chat_template"] = chat_template
    records = read_parquet_rows([dataset_path])
    if not records:
        raise ValueError(f"{dataset_path} has no rows")
    if key not in records[0]:
        raise KeyError(f"prompt column {key!r} (data.prompt_key) not in {dataset_path}; "
                       f"columns: {sorted(records[0])}")
    texts = []
    for i, record in enumerate(records):
        messages = record.get(key)
        if not messages:
            raise ValueError(f"{dataset_path} row {i}: empty prompt (column {key!r})")
        texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=False, **kwargs))
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def run_lengths(view) -> dict:
    """Response lengths (and prompt lengths) of every committed rollout of a run, and the
    fraction clipped at the run's response limit."""
    responses, prompts, steps = [], [], view.complete_steps(["rollout"])
    for step in steps:
        t = view.table(step, "rollout")
        responses += t.column("response_length").to_pylist()
        prompts += [len(ids) for ids in t.column("prompt_ids").to_pylist()]
    if not steps:
        raise LookupError(f"{view.name} has no committed rollout yet: no response lengths")
    limit = view.max_response_length
    clipped = (sum(1 for n in responses if n >= limit) / len(responses)) if limit else None
    return {"steps": steps, "responses": responses, "prompts": prompts, "limit": limit,
            "clip_ratio": clipped}


def recommend(prompt: dict, response: dict | None, run: dict | None, cfg) -> dict:
    """{key: {"value": v, "why": text}} from the distributions (see the module docstring)."""
    get = cfg.get_path
    rec = {}
    max_p = round_up(prompt["max"])
    p99 = round_up(prompt["p99"])
    why = (f"longest prompt is {prompt['max']} tokens after the chat template; rounded up to a "
           f"multiple of {ROUND_TO} -> {max_p} (data.truncation=error refuses longer prompts)")
    if p99 < max_p:
        why += (f"; or {p99} (p99={prompt['p99']} rounded up) with "
                f"data.filter_overlong_prompts=true, dropping the prompts over it")
    rec["data.max_prompt_length"] = {"value": max_p, "why": why}

    current = int(get("data.max_response_length"))
    if response is None or not response.get("count"):
        rec["data.max_response_length"] = {
            "value": current, "why": "no run given (--run): keeping the config's value"}
    elif run["clip_ratio"] is not None and run["clip_ratio"] > CLIP_LIMIT:
        limit = run["limit"]
        rec["data.max_response_length"] = {
            "value": 2 * limit,
            "why": f"{run['clip_ratio']:.1%} of the run's responses hit its limit {limit} "
                   f"(over {CLIP_LIMIT:.0%}): the limit cuts answers short; doubled -> {2 * limit}"}
    else:
        value = round_up(response["p95"])
        clip = "" if run["clip_ratio"] is None else f", {run['clip_ratio']:.1%} clipped"
        rec["data.max_response_length"] = {
            "value": value,
            "why": f"p95 of {response['count']} responses is {response['p95']} tokens{clip}; "
                   f"rounded up to a multiple of {ROUND_TO} -> {value}"}

    longest = rec["data.max_prompt_length"]["value"] + rec["data.max_response_length"]["value"]
    typical = prompt["p50"] + (response["p50"] if response and response.get("count")
                               else rec["data.max_response_length"]["value"])
    for key, rows_key in (("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
                          ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu")):
        n = int(get(rows_key) or 4)
        fit = round_up(n * typical)
        value = max(fit, round_up(longest))
        why = (f"fits N={n} rows ({rows_key.rsplit('.', 1)[-1]}) of a typical {typical} tokens "
               f"(p50 prompt + p50 response) -> {n} x {typical} = {n * typical}, rounded up to "
               f"{fit}")
        if value > fit:
            why += f"; raised to {value} so one longest row ({longest} tokens) fits"
        rec[key] = {"value": value, "why": why}
    return rec
