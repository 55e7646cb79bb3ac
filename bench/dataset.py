"""Dataset bench: what a step pays to get its batch (`load_rl_dataset` + `batch_for_step`) with a
100k-row vs a 1k-row arithmetic dataset (stages/data/tools.py) and the tiny model's tokenizer
(stages.model.tiny.save_tiny_model). Prints JSON and writes bench/results/dataset.json.

    python bench/dataset.py [--sizes 1000,100000] [--steps 200] [--batch 60] [--rounds 3]

Per size, each case in its own process:
- uncached: `RLDataset(data, tokenizer)` + the batch, what every step paid before the cache;
- cold: the first call of a run (tokenises, writes the disk cache);
- warm, same process: steps 2..N, each asking with the next step's weights folder (a new
  folder holding a copy of the same tokenizer, as in a run) and, separately, with one folder;
- fresh process, disk cache: a new process's first step (reads and verifies the cache file), its
  later steps, and the process's wall time from start to exit (interpreter and imports included).
  Its rows are decoded when a batch first uses them, so its steps are compared over the small
  dataset's first epoch (every step decodes its batch at both sizes; later, the small dataset is
  all decoded and its steps only look rows up).
Per-step times are medians over the steps. The cold and fresh processes run --rounds times, the
sizes in turn; a ratio is the median of the rounds' ratios, a figure the median of its rounds. The
cases' processes import first what a rollout process has already imported (pyarrow.compute through
storage/schemas.py, importlib.metadata through transformers): those one-off imports are not the
dataset's cost.
Goal: warm per-step ratio 100k/1k <= 1.1.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")


def _config(data_file: str, batch: int) -> dict:
    return {"train_files": data_file, "val_files": data_file, "train_batch_size": batch,
            "max_prompt_length": 64, "truncation": "error", "shuffle": True, "seed": 1}


def _median_ms(values) -> float:
    return round(statistics.median(values) * 1e3, 4)


def _step(config, folder, cache, step):
    from stages.data.cache import load_rl_dataset

    t0 = time.perf_counter()
    data = load_rl_dataset(config, folder, "train", 0, cache_dir=cache)
    batch = data.batch_for_step(step)
    elapsed = time.perf_counter() - t0
    assert len(batch.rows) == config["train_batch_size"]
    return elapsed, data.cache_info["source"]


def child(case: str, args) -> dict:
    """One case, in this (fresh) process."""
    started = float(os.environ["BENCH_STARTED"])
    t0 = time.perf_counter()
    import importlib.metadata  # noqa: F401
    import numpy  # noqa: F401
    import pyarrow.compute  # noqa: F401

    from stages.data import cache as dataset_cache  # noqa: F401
    imports_s = time.perf_counter() - t0
    config, folders, cache = _config(args.data, args.batch), args.folders.split(","), args.cache
    if case == "uncached":
        from stages.data.dataset import RLDataset
        from stages.model.models import load_tokenizer

        t0 = time.perf_counter()
        batch = RLDataset(config, load_tokenizer(folders[0])).batch_for_step(0)
        assert len(batch.rows) == args.batch
        return {"uncached_step_s": round(time.perf_counter() - t0, 4)}
    first, source = _step(config, folders[0], cache, 0)
    out = {"imports_s": round(imports_s, 4), "first_step_s": round(first, 5), "first_source": source}
    moving = [_step(config, folders[s], cache, s) for s in range(1, len(folders))]
    first_epoch = moving[:args.min_rows // args.batch - 1]  # steps 2.. of the small dataset's epoch 0
    out["first_epoch_step_ms"] = _median_ms([t for t, _ in first_epoch])
    same = [_step(config, folders[0], cache, s) for s in range(len(folders), 2 * len(folders))]
    assert {s for _, s in moving + same} == {"memory"}, "a warm step prepared rows again"
    out["warm_step_ms"] = _median_ms([t for t, _ in moving])
    out["warm_step_p90_ms"] = round(sorted(t for t, _ in moving)[int(0.9 * len(moving))] * 1e3, 4)
    out["warm_step_same_folder_ms"] = _median_ms([t for t, _ in same])
    out["since_process_start_s"] = round(time.time() - started, 4)
    return out


def _run_child(case: str, data: str, folders: list, cache: str, batch: int, min_rows: int) -> dict:
    t0 = time.perf_counter()
    env = {**os.environ, "BENCH_STARTED": repr(time.time()), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, __file__, "--child", case, "--data", data, "--batch", str(batch),
                           "--folders", ",".join(map(str, folders)), "--cache", cache,
                           "--min-rows", str(min_rows)],
                          capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"{case} child failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = round(time.perf_counter() - t0, 4)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,100000")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3, help="cold + fresh processes of every size, in turn")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "dataset.json"))
    parser.add_argument("--child")
    parser.add_argument("--data")
    parser.add_argument("--folders")
    parser.add_argument("--cache")
    parser.add_argument("--min-rows", type=int)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return

    from stages.data.tools import write_arith_dataset
    from stages.model.tiny import save_tiny_model

    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="stagerl-bench-dataset-"))
    try:
        model = save_tiny_model(work / "model")
        folders = []  # one weights folder per step, each with a copy of the same tokenizer
        for step in range(args.steps):
            folder = work / "weights" / f"step_{step:06d}"
            folder.mkdir(parents=True)
            for name in TOKENIZER_FILES:
                shutil.copy2(model / name, folder / name)
            folders.append(folder)
        datas = {n: str(write_arith_dataset(work / f"arith-{n}.parquet", n=n, seed=0, difficulty=2)) for n in sizes}
        caches = {n: str(work / f"cache-{n}") for n in sizes}
        runs = {n: {"rows": n, "data_file_bytes": os.path.getsize(datas[n]), "uncached_step_s":
                    _run_child("uncached", datas[n], folders[:1], caches[n], args.batch, min(sizes))["uncached_step_s"]}
                for n in sizes}
        rounds = []  # the sizes' cold and fresh processes in turn, round after round
        for _ in range(args.rounds):
            this = {}
            for n in sizes:
                shutil.rmtree(caches[n], ignore_errors=True)  # cold: this process tokenises again
                cold = _run_child("cold", datas[n], folders, caches[n], args.batch, min(sizes))
                assert cold["first_source"] == "built"
                fresh = _run_child("fresh", datas[n], folders, caches[n], args.batch, min(sizes))
                assert fresh["first_source"] == "disk"
                this[n] = {"cold": cold, "fresh_process": fresh, "cache_file_bytes": sum(
                    p.stat().st_size for p in Path(caches[n], "datasets").glob("*.arrow"))}
                print(f"{n} rows: cold {cold['first_step_s']} s, warm {cold['warm_step_ms']} ms/step, fresh "
                      f"process first step {fresh['first_step_s']} s then {fresh['first_epoch_step_ms']} ms/step "
                      f"(wall {fresh['process_wall_s']} s)", file=sys.stderr)
            rounds.append(this)
        for n in sizes:  # each figure: its median over the rounds
            for case in ("cold", "fresh_process"):
                runs[n][case] = {k: (statistics.median(r[n][case][k] for r in rounds)
                                     if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                                 for k, v in rounds[0][n][case].items()}
            runs[n]["cache_file_bytes"] = rounds[0][n]["cache_file_bytes"]
        small, large = min(sizes), max(sizes)
        compared = {  # ratio name: (case, figure); case None: a figure of the size itself
            "warm_step_same_process": ("cold", "warm_step_ms"),
            "warm_step_same_process_same_folder": ("cold", "warm_step_same_folder_ms"),
            "warm_step_same_process_first_epoch": ("cold", "first_epoch_step_ms"),
            "warm_step_fresh_process_first_epoch": ("fresh_process", "first_epoch_step_ms"),
            "fresh_process_first_step": ("fresh_process", "first_step_s"),
            "fresh_process_wall": ("fresh_process", "process_wall_s"),
            "cold_first_step": ("cold", "first_step_s"),
            "uncached_step": (None, "uncached_step_s"),
        }

        def figure(run, case, name):
            return (run[case] if case else run)[name]

        per_round = {name: [round(figure({**runs[large], **r[large]}, *what)
                                  / figure({**runs[small], **r[small]}, *what), 3) for r in rounds]
                     for name, what in compared.items()}
        result = {
            "cpus": os.cpu_count(), "steps": args.steps, "batch_prompts": args.batch, "rounds": args.rounds,
            "sizes": runs,
            "ratio_large_over_small": {name: statistics.median(v) for name, v in per_round.items()},
            "ratio_per_round": per_round,
            "ratio_note": "median over the rounds of each round's ratio (the two sizes' processes run "
                          "back to back in a round, so a slower machine for a while moves both)",
            "goal": "warm_step_same_process and warm_step_fresh_process_first_epoch <= 1.1",
        }
        ratios = result["ratio_large_over_small"]
        result["goal_met"] = max(ratios["warm_step_same_process"],
                                 ratios["warm_step_fresh_process_first_epoch"]) <= 1.1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
