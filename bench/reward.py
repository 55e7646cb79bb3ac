"""Reward bench: one step's 720 rows of the arithmetic task (stagerl's built-in scorer,
data_source "stagerl/arith") scored --calls times three ways:

- one_shot: `score_batch` without a pool, as every RL step did before (spawn, score, stop);
- pool_per_row: one resident ScorerPool sending one row per message (max_chunk_rows=1), which
  separates the saving of not spawning from the saving of chunking;
- pool: one resident ScorerPool with its default chunks (what a training run uses).

Prints JSON and writes bench/results/reward.json: seconds per call, the first call of a pool
(it spawns the workers) apart from the rest, and ratios one_shot / pool.

    python bench/reward.py [--rows 720] [--calls 5] [--workers 2] [--timeout-s 10]
"""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))

from stages.data.tools import make_arith_dataset  # noqa: E402
from stages.scoring.pool import score_batch  # noqa: E402
from stages.scoring.pool import ScorerPool  # noqa: E402


def arith_rows(n: int) -> list[dict]:
    """Scoring rows like the reward stage builds: a response per question, about 3 in 4 right."""
    rows = []
    for record in make_arith_dataset(n, seed=0):
        truth = record["reward_model"]["ground_truth"]
        answer = truth if record["extra_info"]["index"] % 4 else str(int(truth) + 1)
        expression = record["extra_info"]["answer"].split(" = ")[0]
        rows.append({"data_source": record["data_source"], "ground_truth": truth,
                     "solution_str": f"{expression} = {answer}\n#### {answer}",
                     "extra_info": record["extra_info"]})
    return rows


def timed(call) -> tuple[float, list]:
    start = time.perf_counter()
    results, metrics = call()
    assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0, metrics
    return round(time.perf_counter() - start, 4), [r["score"] for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=720)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2, help="reward.num_workers (default config: 2)")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    args = parser.parse_args()
    rows = arith_rows(args.rows)
    expected = [1.0 if i % 4 else 0.0 for i in range(args.rows)]

    modes: dict[str, list[float]] = {"one_shot": [], "pool_per_row": [], "pool": []}
    for _ in range(args.calls):
        seconds, scores = timed(lambda: score_batch(rows, None, args.workers, args.timeout_s))
        assert scores == expected
        modes["one_shot"].append(seconds)
    for mode, chunk in (("pool_per_row", 1), ("pool", None)):
        extra = {} if chunk is None else {"max_chunk_rows": chunk}
        with ScorerPool(None, args.workers, args.timeout_s, **extra) as pool:
            for _ in range(args.calls):
                seconds, scores = timed(lambda: pool.score(rows))
                assert scores == expected
                modes[mode].append(seconds)

    def summary(times: list[float]) -> dict:
        rest = times[1:] or times
        return {"per_call_s": times, "total_s": round(sum(times), 4), "first_call_s": times[0],
                "later_calls_mean_s": round(sum(rest) / len(rest), 4)}

    out = {"bench": "reward", "rows": args.rows, "calls": args.calls, "num_workers": args.workers,
           "data_source": "stagerl/arith", "python": platform.python_version(),
           **{mode: summary(times) for mode, times in modes.items()}}
    out["ratio_total_one_shot_over_pool"] = round(out["one_shot"]["total_s"] / out["pool"]["total_s"], 2)
    out["ratio_later_calls_one_shot_over_pool"] = round(
        out["one_shot"]["later_calls_mean_s"] / out["pool"]["later_calls_mean_s"], 2)
    out["ratio_later_calls_pool_per_row_over_pool"] = round(
        out["pool_per_row"]["later_calls_mean_s"] / out["pool"]["later_calls_mean_s"], 2)
    out["note"] = ("one machine shared with other work: compare ratios within this run, not absolute "
                   "seconds; a pool's first call includes spawning its workers")
    text = json.dumps(out, indent=2)
    print(text)
    results_dir = REPO / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "reward.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
