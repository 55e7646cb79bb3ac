import random
import sys
import time

from storage.faults import maybe_fault
from storage.artifacts import read_table
from storage.schemas import make_table

from . import write

STAGE = "logprob"
INPUTS = ("rollout",)
CONFIG_KEYS = ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",)


def run(ctx):
    t0 = time.perf_counter()
    maybe_fault(STAGE, "start", ctx.step)
    lengths = read_table(ctx.store, ctx.layout, ctx.step, "rollout").column("response_length").to_pylist()
    rng = random.Random(ctx.seed(STAGE))
    old = [[-rng.random() for _ in range(n)] for n in lengths]
    table = make_table("logprob", {"old_log_probs": old, "ref_log_probs": old,
                                   "entropy": [[1.0] * n for n in lengths]})
    return write(ctx, sys.modules[__name__], {"logprob.parquet": table}, t0)
