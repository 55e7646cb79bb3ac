import json
import random
import sys
import time

import pyarrow.parquet as pq

from storage.faults import maybe_fault
from storage.schemas import make_table

from . import write

STAGE = "rollout"
INPUTS = ()
CONFIG_KEYS = ("data", "actor_rollout_ref.rollout", "actor_rollout_ref.model.path")


def run(ctx):
    t0 = time.perf_counter()
    maybe_fault(STAGE, "start", ctx.step)
    weights = ctx.actor_weights()  # step k samples from the weights of step k-1
    policy = (weights / "policy.txt").read_text() if (weights / "policy.txt").exists() else "init"
    records = pq.read_table(ctx.get("data.train_files")).to_pylist()
    pos = ctx.extra["data_position"]
    n_prompts, n = ctx.plan["prompts_per_step"], ctx.plan["rollout_n"]
    rng = random.Random(ctx.seed(STAGE))
    cols = {k: [] for k in ("uid", "sample_index", "prompt", "prompt_ids", "response", "response_ids",
                            "response_length", "finish_reason", "data_source", "ground_truth",
                            "extra_info")}
    for i in range(n_prompts):
        rec = records[(pos["index"] + i) % len(records)]
        for j in range(n):
            ids = [rng.randrange(500) for _ in range(rng.randint(1, 6))]
            cols["uid"].append(f"{ctx.step}-{i}")
            cols["sample_index"].append(j)
            cols["prompt"].append(rec["prompt"][-1]["content"])
            cols["prompt_ids"].append([1, 2, 3])
            cols["response"].append(f"{policy[:6]} {ids[0] % 10}")
            cols["response_ids"].append(ids)
            cols["response_length"].append(len(ids))
            cols["finish_reason"].append("stop")
            cols["data_source"].append(rec["data_source"])
            cols["ground_truth"].append(str(rec["reward_model"]["ground_truth"]))
            cols["extra_info"].append(json.dumps(rec.get("extra_info") or {}))
    table = make_table("rollout", cols)
    return write(ctx, sys.modules[__name__], {"rollout.parquet": table}, t0,
                 extra={"metrics": {"response_length/mean": sum(cols["response_length"]) / len(cols["uid"])}})
