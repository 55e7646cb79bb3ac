"""TRL's side of the peer benchmark: one GRPOTrainer run of the work bench/peer_trl.py defines.

Runs in its own virtual environment (`.venv-peer`, made by `make bench-peer`: torch and trl only;
TRL is never a dependency of stagerl), started as a fresh process per run:

    .venv-peer/bin/python bench/peer/trl_grpo.py --model M --data train.parquet --out run.json [...]

Reads the same parquet (verl's RL schema) and the same reward rule (bench/peer/reward.py) as the
stagerl side, and writes one JSON: wall-clock times (time.time()) of every training step's begin
and end (a TrainerCallback's on_step_begin / on_step_end: the first step begins before its
generation, which GRPOTrainer does inside the step), the seconds spent per step in generation,
reward and the whole generate-and-score phase (timers wrapped around GRPOTrainer's own methods),
TRL's logged metrics per step, and the versions and thread settings. `--t0` is the time the
parent started this process, so start-up is measured from the same instant as for stagerl.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

T_MAIN = time.time()


def load_reward(path: str):
    spec = importlib.util.spec_from_file_location("peer_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_dataset(path: str):
    """The stagerl parquet as TRL's conversational dataset: prompt (messages) + the columns the
    reward reads."""
    import datasets
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    return datasets.Dataset.from_list([
        {"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"],
         "data_source": row["data_source"]} for row in rows])


def prompt_lengths(tokenizer, dataset) -> list[int]:
    """Templated prompt lengths in tokens, as TRL tokenises them (add_generation_prompt)."""
    return [len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]) for row in dataset]


def add_phase_timers(trainer_cls, phases: dict, state_of) -> None:
    """Wrap GRPOTrainer's generation, reward and generate-and-score methods with timers; seconds
    are added to phases[name][step] (step = the optimizer step being prepared, 1-based)."""
    for name, method in (("generate", "_generate_single_turn"), ("reward", "_calculate_rewards"),
                         ("generate_and_score", "_generate_and_score_completions")):
        original = getattr(trainer_cls, method)

        def timed(self, *args, _original=original, _name=name, **kwargs):
            t = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                step = state_of(self) + 1
                table = phases.setdefault(_name, {})
                table[step] = table.get(step, 0.0) + time.perf_counter() - t
        setattr(trainer_cls, method, timed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reward", default=str(Path(__file__).with_name("reward.py")))
    parser.add_argument("--work-dir", required=True, help="TRL output_dir (nothing is saved there)")
    parser.add_argument("--t0", type=float, default=T_MAIN, help="time.time() when the parent started us")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--n", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=120)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    rows_per_step = args.prompts * args.n
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun: one process per rank (gloo on CPU)
    if rows_per_step % (args.micro_batch * world):
        raise SystemExit(f"--micro-batch {args.micro_batch} x {world} ranks must divide the {rows_per_step} rows of a step")
    accumulation = rows_per_step // (args.micro_batch * world)
    import torch

    torch.set_num_threads(args.threads)
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    t_imported = time.time()

    reward = load_reward(args.reward)
    dataset = read_dataset(args.data)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lengths = prompt_lengths(tokenizer, dataset)
    steps: dict = {"begin": [], "end": []}
    logged: list = []
    phases: dict = {}

    class StepClock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            steps["begin"].append(time.time())

        def on_step_end(self, a, state, control, **kw):
            steps["end"].append(time.time())

        def on_log(self, a, state, control, logs=None, **kw):
            logged.append({"step": state.global_step,
                           **{k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}})

    add_phase_timers(GRPOTrainer, phases, lambda trainer: trainer.state.global_step)
    config = GRPOConfig(
        output_dir=args.work_dir, max_steps=args.steps, seed=args.seed, use_cpu=True,
        bf16=False, fp16=False, gradient_checkpointing=False,  # GRPOConfig defaults both to True
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=args.n, num_iterations=1,
        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", epsilon=0.2, scale_rewards="group", mask_truncated_completions=False,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=args.betas[0], adam_beta2=args.betas[1], weight_decay=args.weight_decay,
        max_grad_norm=args.grad_clip, logging_steps=1, report_to="none", save_strategy="no",
        eval_strategy="no", dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
        model_init_kwargs={"dtype": torch.float32})
    trainer = GRPOTrainer(model=args.model, reward_funcs=[reward.trl_reward], args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[StepClock()])
    t_ready = time.time()
    trainer.train()
    t_done = time.time()
    n_steps = len(steps["end"])
    out = {
        "side": "trl", "t0": args.t0, "t_main": T_MAIN, "t_imported": t_imported,
        "t_trainer_ready": t_ready, "t_train_done": t_done,
        "step_begin": steps["begin"], "step_end": steps["end"],
        "phases_s": {name: [round(table.get(k, 0.0), 4) for k in range(1, n_steps + 1)]
                     for name, table in phases.items()},
        "logs": logged,
        "prompt_tokens": {"min": min(lengths), "max": max(lengths)},
        "world_size": world,
        "threads": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                    "torch.get_num_threads": torch.get_num_threads()},
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "trl": trl.__version__},
        "config": {"loss_type": config.loss_type, "beta": config.beta,
                   "per_device_train_batch_size": config.per_device_train_batch_size,
                   "gradient_accumulation_steps": config.gradient_accumulation_steps,
                   "steps_per_generation": config.steps_per_generation,
                   "generation_batch_size": config.generation_batch_size,
                   "num_generations": config.num_generations, "optim": str(config.optim),
                   "gradient_checkpointing": config.gradient_checkpointing,
                   "scale_rewards": config.scale_rewards, "top_k": config.top_k},
    }
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as `stagerl train` ends (flows.cli.finish_process): the measured steps are over,
    #                 and the interpreter's teardown of torch & co. only lengthens the sweep
