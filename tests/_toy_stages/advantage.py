import sys
import time

from storage.faults import maybe_fault
from storage.artifacts import read_table
from storage.schemas import make_table

from . import write

STAGE = "advantage"
INPUTS = ("rollout", "logprob", "reward")
CONFIG_KEYS = ("algorithm",)


def run(ctx):
    t0 = time.perf_counter()
    maybe_fault(STAGE, "start", ctx.step)
    lengths = read_table(ctx.store, ctx.layout, ctx.step, "rollout").column("response_length").to_pylist()
    scores = read_table(ctx.store, ctx.layout, ctx.step, "reward").column("score").to_pylist()
    mean = sum(scores) / len(scores)
    adv = [[s - mean] * n for s, n in zip(scores, lengths)]
    zeros = [[0.0] * n for n in lengths]
    table = make_table("advantage", {"token_level_rewards": adv, "advantages": adv,
                                     "returns": adv, "kl": zeros})
    return write(ctx, sys.modules[__name__], {"advantage.parquet": table}, t0)
