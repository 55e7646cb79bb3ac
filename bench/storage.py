"""Storage bench: write + read of one step's artifacts (rollout, logprob, reward, advantage,
update) through storage.artifacts, at two scales, on a local folder and on S3 (moto's server,
started here on 127.0.0.1). Prints JSON and writes bench/results/storage.json.

    python bench/storage.py [--step-seconds 300] [--scales tiny,large] [--backends local,s3]

Scales: tiny = the default config (720 rows, 32-token responses); large = seed 000's shape
(720 rows x 8,192-token responses). Throughput is reported on the bytes stored (zstd parquet)
and on the in-memory Arrow bytes; each case runs --repeat times and the fastest run is kept. `--step-seconds` is the wall time of one RL step the storage
cost is compared with; the default, 300 s, is an assumed step of seed 000's shape on GPUs —
pass a measured step time for a sharper fraction.
"""
import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Run as a script, sys.path[0] is bench/, where this file would shadow the `storage` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from storage import artifacts, schemas  # noqa: E402
from storage.layout import RunLayout  # noqa: E402
from storage.store import Store  # noqa: E402

SCALES = {"tiny": {"rows": 720, "response_tokens": 32, "prompt_tokens": 128},
          "large": {"rows": 720, "response_tokens": 8192, "prompt_tokens": 512}}
N_SAMPLES = 8  # rows per prompt (uid)


def _lists(values: np.ndarray, lengths: np.ndarray, typ) -> pa.Array:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, typ))


def _text(rng, lengths, chars_per_token=4) -> pa.Array:
    words = np.array(["the", "answer", "is", "so", "we", "get", "step", "then", "x", "=",
                      "42", "therefore", "compute", "+", "sum", "of"])
    return pa.array([" ".join(rng.choice(words, size=int(n * chars_per_token / 4)))
                     for n in lengths], pa.string())


def step_files(rows: int, response_tokens: int, prompt_tokens: int, seed: int = 0) -> dict:
    """One step's artifacts with realistic value distributions (ids random, log-probs and
    entropies noisy, rewards sparse, advantages constant per row)."""
    rng = np.random.default_rng(seed)
    lens = np.full(rows, response_tokens, np.int32)
    early = rng.random(rows) < 0.3  # 30% of responses stop before the length limit
    lens[early] = rng.integers(1, response_tokens, int(early.sum()))
    p_lens = np.full(rows, prompt_tokens, np.int32)
    n_tok = int(lens.sum())
    f32 = lambda x: x.astype(np.float32)  # noqa: E731
    score = f32(rng.integers(0, 2, rows))
    ends = np.cumsum(lens) - 1
    tlr = np.zeros(n_tok, np.float32)
    tlr[ends] = score
    adv = f32(np.repeat(rng.normal(size=rows), lens))
    rollout = pa.table({
        "uid": pa.array([f"{uuid.UUID(int=i // N_SAMPLES)}" for i in range(rows)]),
        "sample_index": pa.array(np.arange(rows, dtype=np.int32) % N_SAMPLES),
        "prompt": _text(rng, p_lens),
        "prompt_ids": _lists(rng.integers(0, 151_000, int(p_lens.sum()), dtype=np.int32),
                             p_lens, pa.int32()),
        "response": _text(rng, lens),
        "response_ids": _lists(rng.integers(0, 151_000, n_tok, dtype=np.int32), lens, pa.int32()),
        "response_length": pa.array(lens),
        "finish_reason": pa.array(["length" if n == response_tokens else "stop" for n in lens]),
        "data_source": pa.array(["openai/gsm8k"] * rows),
        "ground_truth": pa.array([str(i % 97) for i in range(rows)]),
        "extra_info": pa.array([json.dumps({"index": i, "split": "train"}) for i in range(rows)]),
        "rollout_log_probs": _lists(f32(-rng.exponential(1.0, n_tok)), lens, pa.float32()),
    })
    logprob = pa.table({c: _lists(f32(-rng.exponential(1.0, n_tok)), lens, pa.float32())
                        for c in ("old_log_probs", "ref_log_probs", "entropy")})
    reward = pa.table({"score": pa.array(score), "acc": pa.array(score)})
    advantage = pa.table({
        "token_level_rewards": _lists(tlr, lens, pa.float32()),
        "advantages": _lists(adv, lens, pa.float32()), "returns": _lists(adv, lens, pa.float32()),
        "kl": _lists(f32(rng.normal(0, 0.01, n_tok)), lens, pa.float32())})
    ranks, mbs = 8, 4
    idx = np.array_split(np.arange(rows, dtype=np.int32), ranks * mbs)
    micro = schemas.make_table("microbatches", {
        "rank": [i // mbs for i in range(ranks * mbs)],
        "micro_batch": [i % mbs for i in range(ranks * mbs)],
        "rows": [list(map(int, ix)) for ix in idx],
        "real_tokens": [int(lens[ix].sum()) for ix in idx],
        "padded_tokens": [int(lens[ix].max()) * len(ix) for ix in idx]})
    metrics = {"loss": 0.1, "grad_norm": 1.0, "lr": 1e-6, "clip_frac": 0.01}
    return {"rollout": {"rollout.parquet": rollout}, "logprob": {"logprob.parquet": logprob},
            "reward": {"reward.parquet": reward}, "advantage": {"advantage.parquet": advantage},
            "update": {"update/metrics.json": metrics, "update/microbatches.parquet": micro}}


def bench_one(store: Store, files: dict, step_seconds: float) -> dict:
    layout = RunLayout("bench", uuid.uuid4().hex[:8])
    arrow_bytes = sum(v.nbytes for f in files.values() for v in f.values() if hasattr(v, "nbytes"))
    t0 = time.perf_counter()
    stored = 0
    for stage, f in files.items():
        stored += artifacts.write_stage(store, layout, 0, stage, f, fingerprint=stage)["bytes"]
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    for stage in files:
        artifacts.read_table(store, layout, 0, stage)
    artifacts.read_file(store, layout, 0, "update", "update/metrics.json")
    t_read = time.perf_counter() - t0
    store.delete(layout.base, recursive=True)
    mb, amb = stored / 1e6, arrow_bytes / 1e6
    return {"stored_MB": round(mb, 2), "arrow_MB": round(amb, 2),
            "write_s": round(t_write, 3), "read_s": round(t_read, 3),
            "write_MBps_stored": round(mb / t_write, 1), "read_MBps_stored": round(mb / t_read, 1),
            "write_MBps_arrow": round(amb / t_write, 1), "read_MBps_arrow": round(amb / t_read, 1),
            "fraction_of_step": round((t_write + t_read) / step_seconds, 5)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-seconds", type=float, default=300.0,
                    help="wall time of one RL step to compare with (default 300 s, assumed)")
    ap.add_argument("--scales", default="tiny,large")
    ap.add_argument("--backends", default="local,s3")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the fastest is kept")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "storage.json"))
    args = ap.parse_args(argv)
    scales = args.scales.split(",")
    data = {s: step_files(**SCALES[s]) for s in scales}
    results = {"step_seconds": args.step_seconds, "cpus": os.cpu_count(), "repeat": args.repeat,
               "scales": {s: SCALES[s] for s in scales}, "runs": []}
    server = None
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            if backend == "local":
                store = Store.from_config({"root": f"{tmp}/store"})
            else:
                sys.path.insert(0, str(REPO / "tests"))
                from _s3_server import MotoServer
                server = MotoServer().start()
                server.make_bucket("bench")
                store = Store.from_config({"root": "s3://bench/runs", "key": "bench",
                                           "secret": "bench", "endpoint_url": server.endpoint_url})
            try:
                for s in scales:
                    tries = [bench_one(store, data[s], args.step_seconds)
                             for _ in range(args.repeat)]
                    r = min(tries, key=lambda t: t["write_s"] + t["read_s"])
                    results["runs"].append({"backend": backend, "scale": s, **r})
                    print(f"# {backend} {s}: {r}", file=sys.stderr)
            finally:
                if server:
                    server.stop()
                    server = None
    text = json.dumps(results, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
