"""A tiny model (init_std 0.3, so greedy output varies) and an arithmetic dataset for the rollout
and engine tests, plus a StageContext built on the tiny-cpu config with small shapes."""
from configs.loader import load_config
from configs.suggest import make_plan
from stages.context import StageContext
from stages.data.tools import write_arith_dataset, write_rows
from stages.model.tiny import save_tiny_model
from storage.layout import RunLayout

SMALL = ["actor_rollout_ref.rollout.name=hf", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "trainer.n_gpus_per_node=1",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
         "data.max_prompt_length=32", "data.max_response_length=12",
         "actor_rollout_ref.rollout.hf_generate_batch_size=2",
         # vLLM on CPU: no torch.compile (a minute per start here), small scheduler budgets
         "actor_rollout_ref.rollout.enforce_eager=true", "actor_rollout_ref.rollout.dtype=float32",
         "actor_rollout_ref.rollout.max_num_batched_tokens=512", "actor_rollout_ref.rollout.max_num_seqs=64"]


def make_assets(folder):
    """(model_dir, train_file, val_file) under `folder`."""
    model = save_tiny_model(folder / "tiny", init_std=0.3)
    train = write_arith_dataset(folder / "train.parquet", n=24, seed=0, difficulty=4)  # lengths vary
    val = write_arith_dataset(folder / "val.parquet", n=6, seed=0, split="test")
    return model, train, val


def write_dataset(path, rows):
    return write_rows(rows, path)


def make_ctx(root, assets, overrides=(), step=1, experiment="t"):
    model, train, val = assets
    cfg = load_config("tiny-cpu", ["warmstart.enable=false", f"storage.root={root}", f"trainer.experiment_name={experiment}",
                                   f"actor_rollout_ref.model.path={model}", f"data.train_files={train}",
                                   f"data.val_files={val}", *SMALL, *overrides])
    return StageContext.create(cfg, make_plan(cfg), step)


def rollout_bytes(ctx) -> bytes:
    """The committed rollout.parquet's bytes."""
    layout = RunLayout.from_config(ctx.cfg)
    return ctx.store.read_bytes(layout.stage_file(ctx.step, "rollout.parquet"))
