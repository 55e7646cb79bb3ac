"""A small run written straight through storage (no stage code): 2 complete steps and a third
with only its rollout, for the inspect/show/query/export/plot/stats tests.

Step k: 2 prompts (uid p0, p1) x 3 samples = 6 rows; scores SCORES[k]; response i has
RESPONSES[i] tokens; logprob old = -(0.1 j + 0.01 k) at token j, ref = old - 0.05, entropy 0.5 + 0.1 j;
advantages per row = score - mean score of its uid; update: rank 0 micro-batches [0, 1], [2],
rank 1 [3, 4, 5]."""
import json

from configs.loader import load_config
from storage.artifacts import write_run_json, write_stage, write_table
from storage.layout import RunLayout
from storage.schemas import make_table

SCORES = {1: [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], 2: [1.0, 1.0, 0.0, 1.0, 1.0, 1.0],
          3: [0.0] * 6}
RESPONSE_TEXTS = ["= 7", "= 12 + 3", "7", "= 1", "= 8 - 2 = 6 done", "9 9"]
QUESTIONS = ["What is 3+4?", "What is 2*5?"]
MAX_RESPONSE = 4
MICRO_BATCHES = [(0, 0, [0, 1]), (0, 1, [2]), (1, 0, [3, 4, 5])]


def run_config(root, model_path, experiment="demo"):
    return load_config("tiny-cpu", ["warmstart.enable=false", 
        f"storage.root={root}", f"trainer.experiment_name={experiment}",
        f"actor_rollout_ref.model.path={model_path}", f"data.max_response_length={MAX_RESPONSE}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96"])


def rollout_table(tokenizer, step):
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=False)
               for q in QUESTIONS]
    rows = {k: [] for k in ("uid", "sample_index", "prompt", "prompt_ids", "response",
                            "response_ids", "response_length", "finish_reason", "data_source",
                            "ground_truth", "extra_info")}
    for i in range(6):
        p = i // 3
        ids = tokenizer(RESPONSE_TEXTS[i], add_special_tokens=False)["input_ids"][:MAX_RESPONSE]
        rows["uid"].append(f"p{p}")
        rows["sample_index"].append(i % 3)
        rows["prompt"].append(prompts[p])
        rows["prompt_ids"].append(tokenizer(prompts[p], add_special_tokens=False)["input_ids"])
        rows["response"].append(tokenizer.decode(ids))
        rows["response_ids"].append(ids)
        rows["response_length"].append(len(ids))
        rows["finish_reason"].append("length" if len(ids) == MAX_RESPONSE else "stop")
        rows["data_source"].append("stagerl/arith")
        rows["ground_truth"].append(["7", "10"][p])
        rows["extra_info"].append(json.dumps({"index": p}))
    return make_table("rollout", rows)


def write_step(store, layout, tokenizer, step, stages=("rollout", "logprob", "reward",
                                                         "advantage", "update")):
    rollout = rollout_table(tokenizer, step)
    lengths = rollout.column("response_length").to_pylist()
    prompt_lengths = [len(x) for x in rollout.column("prompt_ids").to_pylist()]
    scores = SCORES[step]
    fp = lambda s: f"{s}-{step}"  # noqa: E731
    if "rollout" in stages:
        write_table(store, layout, step, "rollout", rollout, fingerprint=fp("rollout"),
                    timings={"generate_s": 1.5})
    if "logprob" in stages:
        old = [[-(0.1 * j + 0.01 * step) for j in range(n)] for n in lengths]
        write_table(store, layout, step, "logprob", make_table("logprob", {
            "old_log_probs": old, "ref_log_probs": [[v - 0.05 for v in r] for r in old],
            "entropy": [[0.5 + 0.1 * j for j in range(n)] for n in lengths]}),
            fingerprint=fp("logprob"), extra={"loads": {"actor": [{"rank": 0, "rows": 3}, {"rank": 1, "rows": 3}]},
                   "permutation": [0, 1, 2, 3, 4, 5]})
    if "reward" in stages:
        write_table(store, layout, step, "reward", make_table("reward", {
            "score": scores, "acc": [float(s > 0) for s in scores]}), fingerprint=fp("reward"))
    if "advantage" in stages:
        means = [sum(scores[3 * (i // 3): 3 * (i // 3) + 3]) / 3 for i in range(6)]
        adv = [[scores[i] - means[i]] * n for i, n in enumerate(lengths)]
        tlr = [[0.0] * (n - 1) + [scores[i]] for i, n in enumerate(lengths)]
        write_table(store, layout, step, "advantage", make_table("advantage", {
            "token_level_rewards": tlr, "advantages": adv, "returns": adv,
            "kl": [[0.0] * n for n in lengths]}), fingerprint=fp("advantage"),
            extra={"metrics": {"critic/score/mean": sum(scores) / 6,
                               "response_length/mean": sum(lengths) / 6}})
    if "update" in stages:
        seq = [p + n for p, n in zip(prompt_lengths, lengths)]
        # as stages/update.py writes it: every (role, epoch); readers keep actor, epoch 0
        passes = [(role, epoch) for role, epoch in (("actor", 0), ("actor", 1), ("critic", 0))]
        recs = [(role, epoch, r, m, rows) for role, epoch in passes for r, m, rows in MICRO_BATCHES]
        mbs = make_table("microbatches", {
            "rank": [x[2] for x in recs], "micro_batch": [x[3] for x in recs],
            "rows": [x[4] for x in recs], "mini_batch": [0] * len(recs),
            "epoch": [x[1] for x in recs], "role": [x[0] for x in recs],
            "real_tokens": [sum(seq[i] for i in x[4]) for x in recs],
            "padded_tokens": [max(seq[i] for i in x[4]) * len(x[4]) for x in recs]})
        metrics = {"actor/pg_loss": 0.1 * step, "actor/entropy": 0.6, "actor/ppo_kl": 0.001 * step,
                   "actor/grad_norm": [1.0, 2.0], "actor/kl_loss": 0.02,
                   "update/micro_batch_loads": {"actor/rank_0": {"rows": 3}, "actor/rank_1": {"rows": 3}},
                   "update/load_lines": ["actor rank 0: 3 rows"]}
        write_stage(store, layout, step, "update", {"update/metrics.json": metrics,
                                                    "update/microbatches.parquet": mbs},
                    fingerprint=fp("update"), timings={"update_s": 4.0})


def build_run(store, cfg, tokenizer, experiment="demo"):
    """run.json + steps 1, 2 complete + step 3 rollout only."""
    layout = RunLayout(cfg["trainer"]["project_name"], experiment)
    write_run_json(store, layout, dict(cfg))
    for step in (1, 2):
        write_step(store, layout, tokenizer, step)
    write_step(store, layout, tokenizer, 3, stages=("rollout",))
    return layout
