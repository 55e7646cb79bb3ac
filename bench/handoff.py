"""The update's weights to the rollout engine: in-memory handoff against the physical floor and
against the file path it replaced, at Qwen2.5-0.5B's shape. Prints JSON and writes
bench/results/handoff.json.

    python bench/handoff.py [--layers 24 4] [--rows 8] [--tokens 48] [--threads 2]

Per layer count, in a fresh process: qwen2.5-0.5b's architecture (stages/model/shapes.py) with
random fp32 weights; one rank (ZeRO-2, AdamW, fp32: the CPU default's update engine) trains one
mini-batch of --rows sequences; the hf rollout engine runs in the same process (the CPU default's
resident engine). Then, each timed on the same trained weights:

- floor: one in-memory copy of every parameter in the rollout dtype (dst.copy_(src)): the least any
  handoff can cost;
- handoff: what the update now does on the critical path (stages.training.handoff: the module's
  tensors copied into the engine; `timing/handoff_s` of a run), plus the version's small files;
- file path: what the update did before (still its path without a run session): the DeepSpeed
  train state saved, the fp32 HF export written, hashed, and loaded by the engine from the folder;
- persist: the background writer (serialise the served tensors, write them into the weights
  cache hashing as it writes); `timing/persist_s` of a run, off the critical path;
- train state: one DeepSpeed checkpoint (now every trainer.save_freq steps, not every step);
- staleness_1: at trainer.staleness >= 1 the engine samples an older version while the update
  trains, so each update exports its weights (rank 0) and the update stage hashes the folder into
  the weights cache, on the critical path: before (the train state too at every step, the export
  through save_pretrained and the tokenizer saved again) against now (UpdateJob.export: the job's
  template and one safetensors write; the state every save_freq), and whether both folders hash
  the same;
- step: the update's training compute of this mini-batch plus the engine's generation of the
  batch's --tokens/2 response tokens (a lower bound of a real step at this shape).

Bytes written to disk on the critical path per step: before, the train state and the export;
now 0 (only the small files, ~10 MB of tokenizer and config, written from memory: counted too).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

PROMPT = 24


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def case(model: str, work: str, rows: int, tokens: int, repeat: int) -> dict:
    """One process: train one step, then time each way of getting the weights to the engine."""
    import numpy as np
    import torch

    from _update_inputs import make_ctx, write_inputs
    from stages.engines import EngineOptions, Sampling
    from stages.ranks.launch import init_distributed
    from stages.session import RunSession
    from stages.training import engine as update_engine
    from stages.training import handoff as ho
    from stages.training.worker import UpdateJob
    from storage.weights import folder_hashes

    work = Path(work)
    response = tokens - PROMPT
    overrides = [f"data.max_prompt_length={PROMPT}", f"data.max_response_length={response}",
                 f"data.train_batch_size={rows}", "actor_rollout_ref.rollout.n=1",
                 f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
                 f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows}",
                 "actor_rollout_ref.actor.deepspeed.zero_stage=2", "actor_rollout_ref.actor.optim.lr=1e-5"]
    full = lambda rng, n, max_resp: np.full(n, max_resp)
    init_distributed("cpu")
    ctx = make_ctx(work, model, 1, overrides)
    write_inputs(ctx, seed=5, vocab=400, response_lengths=full)
    job = UpdateJob(ctx, 0, 1)
    t0 = time.perf_counter()
    job.train_step(ctx)
    train_s = time.perf_counter() - t0
    dtype = torch.float32  # the hf engine's dtype on a CPU (stages.training.handoff.persist_dtype)

    with RunSession() as session:
        engines = session.engines()
        options = EngineOptions(model_dir=model, rollout={"dtype": "float32"})
        prompts = [list(range(10, 10 + PROMPT)) for _ in range(rows)]
        sampling = Sampling(n=1, max_new_tokens=response, temperature=1.0)
        engines.generate("hf", prompts, list(range(rows)), sampling, options)  # start
        t0 = time.perf_counter()
        engines.generate("hf", prompts, list(range(rows)), sampling, options)
        generate_s = time.perf_counter() - t0
        engine = engines.local[1]
        served = engine.named_weights()
        weights_bytes = sum(p.numel() * p.element_size() for p in served.values())

        # the floor: one copy of every parameter into the engine, in the rollout dtype
        source = {k: v.detach() for k, v in job.actor.engine.module.named_parameters()}
        def floor():
            with torch.no_grad():
                for name, param in served.items():
                    param.copy_(source[name])
        floor_s = best(floor, repeat)

        # the handoff as the update does it (the version's small files included)
        handoff_dirs = []
        def handoff():
            folder = work / f"version-{len(handoff_dirs)}"
            handoff_dirs.append(folder)
            job._small_files(folder, dtype, "bench")
            engines.take_tensors(ho.rollout_tensors(job.actor.engine, dtype, 0), "bench", folder)
        job._small_files(work / "warm", dtype, "bench")  # the once-per-job template
        handoff_s = best(handoff, repeat)
        small_bytes = folder_bytes(handoff_dirs[-1])

        # the background writer
        cache = work / "cache"
        def persist():
            shutil.rmtree(cache, ignore_errors=True)
            ho.persist_version(handoff_dirs[-1], cache, weights=ho.serialize(engine.named_weights()))
        persist_s = best(persist, repeat)

        # today's file path: train state + fp32 export + hash + engine load from the folder
        def state():
            shutil.rmtree(work / "state", ignore_errors=True)
            update_engine.save_state(job.actor.engine, work / "state", 0)
        def export_hash_load():
            shutil.rmtree(work / "export", ignore_errors=True)
            update_engine.export_hf(job.actor.engine, work / "export", 0, tokenizer_from=model)
            folder_hashes(work / "export")
            engine.load_weights(work / "export")
        state_s = best(state, 1)
        state_bytes = folder_bytes(work / "state")
        file_path_s = state_s + best(export_hash_load, repeat)
        export_bytes = folder_bytes(work / "export")

        # trainer.staleness >= 1: the engine samples an older version meanwhile, so every update
        # exports (the rank) and hashes the folder into the weights cache (the update stage), the
        # engine loading it later. Before: the train state every step too, and save_pretrained
        # with the tokenizer saved again; now: the job's export (template + one safetensors write)
        def export_before():
            shutil.rmtree(work / "export_before", ignore_errors=True)
            update_engine.export_hf(job.actor.engine, work / "export_before", 0, tokenizer_from=model)
        def export_now():
            shutil.rmtree(work / "now", ignore_errors=True)
            job.export(work / "now")
        export_before_s, export_now_s = best(export_before, repeat), best(export_now, repeat)
        hash_s = best(lambda: folder_hashes(work / "now" / "actor_hf"), repeat)
        same_folder = folder_hashes(work / "now" / "actor_hf") == folder_hashes(work / "export_before")
    step_s = train_s + generate_s
    return {"parameters": sum(p.numel() for p in served.values()), "weights_bytes": weights_bytes,
            "train_s": round(train_s, 3), "generate_s": round(generate_s, 3), "step_s": round(step_s, 3),
            "floor_s": round(floor_s, 4), "handoff_s": round(handoff_s, 4),
            "handoff_vs_floor": round(handoff_s / floor_s, 3), "handoff_share_of_step": round(handoff_s / step_s, 4),
            "persist_s": round(persist_s, 3), "file_path_s": round(file_path_s, 3),
            "file_path_vs_handoff": round(file_path_s / handoff_s, 1), "train_state_s": round(state_s, 3),
            "critical_path_bytes_before": state_bytes + export_bytes,
            "critical_path_weight_and_state_bytes_now": 0, "critical_path_small_file_bytes_now": small_bytes,
            "durable_bytes_per_step_now": weights_bytes + small_bytes,
            "train_state_bytes_every_save_freq": state_bytes,
            "staleness_1": {"export_before_s": round(export_before_s, 3), "export_now_s": round(export_now_s, 3),
                            "hash_s": round(hash_s, 3), "train_state_s_before_every_step": round(state_s, 3),
                            "critical_path_before_s": round(state_s + export_before_s + hash_s, 3),
                            "critical_path_now_s": round(export_now_s + hash_s, 3),
                            "same_folder_checksum": same_folder}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 4])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:  # a child process: one model
        print(json.dumps(case(args.model, args.work, args.rows, args.tokens, args.repeat)))
        return {}
    from stages.model.shapes import save_shaped_model

    results = {}
    for layers in args.layers:
        with tempfile.TemporaryDirectory(prefix="stagerl-bench-handoff-") as tmp:
            model = save_shaped_model("qwen2.5-0.5b", Path(tmp) / "model", "fp32", num_layers=layers)
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "STAGERL_ENGINE_THREADS": str(args.threads)}
            out = subprocess.run([sys.executable, __file__, "--case", "--model", str(model), "--work",
                                  str(Path(tmp) / "work"), "--rows", str(args.rows), "--tokens", str(args.tokens),
                                  "--repeat", str(args.repeat)], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{layers} layers failed:\n{out.stderr[-3000:]}")
            results[f"{layers}_layers"] = json.loads(out.stdout.strip().splitlines()[-1])
    result = {"model": "qwen2.5-0.5b shape, fp32, random weights, 1 rank ZeRO-2, hf engine in the process",
              "rows": args.rows, "tokens_per_row": args.tokens, "threads": args.threads,
              "repeat": args.repeat, "when": time.strftime("%Y-%m-%d %H:%M"), **results}
    path = REPO / "bench" / "results" / "handoff.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
