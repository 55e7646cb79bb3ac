"""Multi-turn rollout bench (issue 36): sampled tokens/s of a multi-turn tool-calling rollout
against a single-turn rollout on the same number of generated tokens, side by side in one run
through the rollout stage. Prints JSON and writes bench/results/multiturn.json.

    python bench/multiturn.py [--engine hf|vllm] [--prompts 60] [--n 2] [--repeats 5]

The model: the tiny model (init_std 0.3) taught by tests/_multiturn_setup.py's short fine-tune to
call the calculator in verl's hermes format; 1 replica, temperature 1.0. `--engine hf` (the
default): the transformers engine in this process; `--engine vllm`: vLLM's CPU build
(enforce_eager) in its worker process. Either is resident in one RunSession across all runs, with
the calculator's tool workers (started in the first calibration run, as a training run's session
keeps them). Both
variants run through the multi-turn agent loop on the same 60 prompts (the four taught arithmetic
questions, cycled, verl's tool-agent schema):

- `multi`: agent_name tool_agent: turns of sampled tokens, calculator calls in the ToolSet's
  worker processes, tool responses appended as masked tokens, up to a 320-token response.
- `single`: agent_name single_turn_agent (one assistant turn, no tools; equal to the plain
  single-turn rollout, tests/test_multiturn.py). Its prompt count is scaled (after a calibration
  run of both on the same prompts) so that it samples about as many tokens as `multi` does.
- `plain`: the `single` rows with multi_turn.enable=false: the plain single-turn rollout (no agent
  loop, one engine call), the baseline a user compares with.

Tokens counted: sampled (LLM) tokens only (the multi-turn rollout's tool-response tokens are
not generated). Timed: the whole stage (wall_s: dataset, engine, loop, tools, parquet writes) and
the loop's generate_s. Variants are interleaved, `--repeats` times each; medians reported. The
load average at start is recorded: this machine is shared, so wall times are noisy.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests"))  # tests/_multiturn_setup.py: the taught model, the tool dataset
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MT = "actor_rollout_ref.rollout.multi_turn"
ENGINES = {"hf": ["actor_rollout_ref.rollout.name=hf"],
           "vllm": ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true"]}
ENGINE = "hf"
SESSION = None  # one RunSession: the engine and the tool workers start once (in the calibration run)


def overrides(folder: Path, model: Path, train: Path, config: Path, name: str, n: int, seed: int, prompts: int,
              multi_turn: bool = True) -> list:
    return ["warmstart.enable=false", f"storage.root={folder / 'store'}", f"trainer.experiment_name={name}",
            f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={train}",
            f"trainer.seed={seed}", *ENGINES[ENGINE], "trainer.n_gpus_per_node=1",
            f"{MT}.enable={str(multi_turn).lower()}", f"{MT}.tool_config_path={config}", f"{MT}.max_parallel_calls=2",
            "data.max_prompt_length=64", "data.max_response_length=320", "data.shuffle=false",
            "actor_rollout_ref.rollout.temperature=1.0", f"actor_rollout_ref.rollout.n={n}",
            f"data.train_batch_size={prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]  # (the update does not run)


def run_variant(folder, model, train, config, name, n, seed, prompts, multi_turn: bool = True) -> dict:
    from configs.loader import load_config
    from configs.suggest import make_plan
    from stages import rollout
    from stages.context import StageContext

    cfg = load_config("tiny-cpu", overrides(folder, model, train, config, name, n, seed, prompts, multi_turn))
    ctx = StageContext.create(cfg, make_plan(cfg), 1)
    if SESSION is not None:
        ctx.session = SESSION
    t0 = time.perf_counter()
    manifest = rollout.run(ctx)
    wall = time.perf_counter() - t0
    timings = manifest["timings"]
    if multi_turn:
        mt = manifest["extra"]["multi_turn"]
    else:  # the plain single-turn rollout: no agent loop, one engine call
        from storage.artifacts import read_table

        lengths = read_table(ctx.store, ctx.layout, 1, "rollout").column("response_length").to_pylist()
        mt = {"llm_tokens": sum(lengths), "tool_tokens": 0, "tool_calls": 0, "num_turns_mean": 2.0}
    tokens = mt["llm_tokens"]
    return {"variant": name.split("-")[0], "prompts": prompts, "rows": manifest["row_count"], "n": n, "sampled_tokens": tokens,
            "tool_tokens": mt["tool_tokens"], "tool_calls": mt["tool_calls"], "num_turns_mean": mt["num_turns_mean"],
            "generate_s": round(timings["generate_s"], 3), "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1), "tokens_per_s_generate": round(tokens / timings["generate_s"], 1),
            "agent_loop": {k: mt.get(k) for k in ("engine_calls", "rounds", "tool_wait_s", "tool_s", "streamed")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--engine", choices=sorted(ENGINES), default="hf")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "multiturn.json"))
    args = ap.parse_args()
    global ENGINE, SESSION
    ENGINE = args.engine

    import contextlib

    from _multiturn_setup import teach_tool_calls, tool_row, trajectories, write_calc_config, write_tool_dataset
    from configs.loader import load_config
    from stages.data.dataset import RLDataset
    from stages.model.models import load_tokenizer
    from stages.model.tiny import save_tiny_model
    from stages.tools.toolset import ToolSet

    results = {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(), "prompts": args.prompts,
               "repeats": args.repeats, "engine": args.engine, "model": "tiny (init_std 0.3) taught to call the calculator "
               "(tests/_multiturn_setup.py teach_tool_calls, 100 steps)", "runs": []}
    with tempfile.TemporaryDirectory(prefix="stagerl-bench-multiturn-") as tmp, contextlib.ExitStack() as stack:
        from stages.session import RunSession

        SESSION = stack.enter_context(RunSession())  # as a training run: engine and tool workers kept
        folder = Path(tmp)
        base = save_tiny_model(folder / "tiny", init_std=0.3)
        config = Path(write_calc_config(folder / "calc.yaml"))
        traj = trajectories()

        def dataset(agent: str, prompts: int) -> Path:
            rows = [tool_row(traj[i % len(traj)][0], traj[i % len(traj)][1], i, agent=agent) for i in range(prompts)]
            return Path(write_tool_dataset(folder / f"{agent}-{prompts}.parquet", rows))

        multi_file = dataset("tool_agent", args.prompts)
        cfg = load_config("tiny-cpu", overrides(folder / "probe", base, multi_file, config, "probe", 1, 0, args.prompts))
        prompt_ids = {r.extra_info["question"]: r.prompt_ids for r in RLDataset(dict(cfg["data"]), load_tokenizer(base)).rows}
        with ToolSet.from_config(str(config), num_workers=1, instance_per="call") as tools:
            results["teach_loss"] = teach_tool_calls(base, folder / "taught", prompt_ids, tools, steps=100)
        model = folder / "taught"

        # calibration: the single-turn prompt count at which both sample about as many tokens
        multi = run_variant(folder / "cal-m", model, multi_file, config, "multi-cal", args.n, args.seed, args.prompts)
        single = run_variant(folder / "cal-s", model, dataset("single_turn_agent", args.prompts), config, "single-cal",
                             args.n, args.seed, args.prompts)
        p_single = max(1, round(args.prompts * multi["sampled_tokens"] / single["sampled_tokens"]))
        results["calibration"] = {"multi": multi, "single": single, "single_prompts": p_single}
        single_file = dataset("single_turn_agent", p_single)
        for r in range(args.repeats):
            for variant, file, prompts in (("multi", multi_file, args.prompts), ("single", single_file, p_single),
                                           ("plain", single_file, p_single)):
                row = run_variant(folder / f"{variant}-{r}", model, file, config, f"{variant}-{r}", args.n, args.seed, prompts,
                                  multi_turn=variant != "plain")
                row["repeat"] = r
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
    summary = {}
    for variant in ("multi", "single", "plain"):
        rows = [r for r in results["runs"] if r["variant"] == variant]
        summary[variant] = {k: statistics.median(r[k] for r in rows)
                            for k in ("sampled_tokens", "wall_s", "generate_s", "tokens_per_s", "tokens_per_s_generate")}
        summary[variant]["rows"] = rows[0]["rows"]
        summary[variant]["prompts"] = rows[0]["prompts"]
    summary["ratio_tokens_per_s"] = round(summary["multi"]["tokens_per_s"] / summary["single"]["tokens_per_s"], 3)
    summary["ratio_tokens_per_s_generate"] = round(
        summary["multi"]["tokens_per_s_generate"] / summary["single"]["tokens_per_s_generate"], 3)
    summary["ratio_tokens_per_s_vs_plain"] = round(summary["multi"]["tokens_per_s"] / summary["plain"]["tokens_per_s"], 3)
    results["summary"] = summary
    results["load_average_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
