import sys
import time

from storage.faults import maybe_fault
from storage.artifacts import read_table
from storage.schemas import make_table

from . import write

STAGE = "reward"
INPUTS = ("rollout",)
CONFIG_KEYS = ("data.reward_fn_key",)


def run(ctx):
    t0 = time.perf_counter()
    maybe_fault(STAGE, "start", ctx.step)
    rollout = read_table(ctx.store, ctx.layout, ctx.step, "rollout")
    scores = [float(r.endswith(str(int(g) % 10))) for r, g in
              zip(rollout.column("response").to_pylist(), rollout.column("ground_truth").to_pylist())]
    table = make_table("reward", {"score": scores, "acc": scores})
    return write(ctx, sys.modules[__name__], {"reward.parquet": table}, t0,
                 extra={"metrics": {"critic/score/mean": sum(scores) / len(scores)}})
