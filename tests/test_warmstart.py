"""The supervised warm start: a stage under step 0 that writes weights/step_000000."""
import torch

from configs.loader import load_config
from configs.suggest import make_plan
from stages.model import warmstart
from stages.context import StageContext
from stages.data.tools import make_arith_dataset, write_rows
from stages.model.models import load_policy
from stages.model.tiny import save_tiny_model
from storage.artifacts import read_manifest


def test_warmstart_writes_step0_weights_that_step1_samples_from(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny", seed=3)
    data = write_rows(make_arith_dataset(40, seed=1, difficulty=1, split="train"), tmp_path / "train.parquet")
    cfg = load_config("tiny-cpu", [f"storage.root={tmp_path / 'store'}", f"actor_rollout_ref.model.path={model_dir}",
                             f"data.train_files={data}", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "warmstart.enable=true",
                             "warmstart.steps=30", "warmstart.batch_size=8", "warmstart.lr=3e-3"])
    ctx = StageContext.create(cfg, make_plan(cfg), step=0)
    manifest = warmstart.run(ctx)
    metrics = manifest["extra"]["metrics"]
    assert metrics["warmstart/examples"] == 40 and metrics["warmstart/steps"] == 30
    assert metrics["warmstart/loss_last"] < 0.5 * metrics["warmstart/loss_first"]
    assert read_manifest(ctx.store, ctx.layout, 0, "warmstart")["fingerprint"] == warmstart.stage_fingerprint(ctx)

    step1 = StageContext.create(cfg, ctx.plan, step=1)
    warm, initial = load_policy(step1.actor_weights()), load_policy(model_dir)
    assert step1.reference_weights() == step1.actor_weights()  # the reference is the warm-started model
    changed = [name for (name, p), (_, q) in zip(warm.named_parameters(), initial.named_parameters())
               if not torch.equal(p, q)]
    assert len(changed) == len(list(initial.parameters()))

    again = StageContext.create(cfg, ctx.plan, step=0)  # same config, same seed: same weights
    assert warmstart.run(again)["fingerprint"] == manifest["fingerprint"]
