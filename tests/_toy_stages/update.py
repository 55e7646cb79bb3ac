import shutil
import sys
import tempfile
import time
from pathlib import Path

from storage.faults import maybe_fault
from storage.artifacts import read_table
from storage.schemas import make_table
from storage.weights import save_weights

from . import digest, write

STAGE = "update"
INPUTS = ("advantage",)
CONFIG_KEYS = ("actor_rollout_ref.actor",)


def run(ctx):
    t0 = time.perf_counter()
    maybe_fault(STAGE, "start", ctx.step)
    adv = read_table(ctx.store, ctx.layout, ctx.step, "advantage").column("advantages").to_pylist()
    src = ctx.actor_weights()
    policy = (src / "policy.txt").read_text() if (src / "policy.txt").exists() else "init"
    new_policy = digest(policy, adv, ctx.seed(STAGE))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "w"
        shutil.copytree(src, out)
        (out / "policy.txt").write_text(new_policy)
        save_weights(ctx.store, ctx.layout, ctx.step, out)
    rows = list(range(len(adv)))
    micro = make_table("microbatches", {"rank": [0], "micro_batch": [0], "rows": [rows],
                                        "real_tokens": [sum(map(len, adv))], "padded_tokens": [0]})
    metrics = {"actor/pg_loss": -sum(a[0] for a in adv) / len(adv), "actor/lr": 1e-4}
    files = {"update/metrics.json": metrics, "update/microbatches.parquet": micro}
    return write(ctx, sys.modules[__name__], files, t0, extra={"policy": new_policy})
