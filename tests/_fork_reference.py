"""The reference a fork is compared with (tests/test_fork.py), computed without any fork code:
run stages by hand, without Prefect, on a plain copy of a run.

    python tests/_fork_reference.py ROOT EXPERIMENT FIRST_STEP FIRST_STAGE LAST_STEP OVERRIDES_JSON

runs, in the experiment's folder of the store at ROOT (its earlier stages already there),
FIRST_STAGE of FIRST_STEP and every stage after it up to the update of LAST_STEP, each with the
config tiny-cpu + OVERRIDES and the `extra` the training flow gives a step (flows.train.step_extra).
No run session: the rollout engine and the update's engines are built afresh for each stage, as
for a resumed run."""
import json
import sys


def main(root, experiment, first_step, first_stage, last_step, overrides):
    from configs.loader import load_config
    from configs.suggest import make_plan
    from flows.step import stage_module
    from flows.train import load_dataset, step_extra, total_steps
    from stages.context import StageContext
    from storage.layout import STAGES
    from storage.store import Store

    cfg = load_config("tiny-cpu", overrides + [f"storage.root={root}",
                                              f"trainer.experiment_name={experiment}"])
    plan, store = make_plan(cfg), Store.from_config(cfg["storage"])
    dataset = load_dataset(cfg, store)
    total = total_steps(cfg, dataset.steps_per_epoch)
    for step in range(first_step, last_step + 1):
        for stage in STAGES[STAGES.index(first_stage) if step == first_step else 0:]:
            ctx = StageContext.create(cfg, plan, step, store=store)
            ctx.extra = step_extra(dataset, step, total)
            stage_module(stage).run(ctx)
            print(f"reference: step {step} {stage} done", flush=True)


if __name__ == "__main__":
    root, experiment, first_step, first_stage, last_step, overrides = sys.argv[1:7]
    main(root, experiment, int(first_step), first_stage, int(last_step), json.loads(overrides))
