"""Extending a finished run (flows/rerun.py): `stagerl train` again with a larger
trainer.total_training_steps continues after the last complete step, leaves the finished steps as
they are, and ends with the weights of a run started with the larger total, bit for bit; a lower
total has nothing to run; a schedule that depends on the total (cosine, a warm-up ratio) is refused
naming its key. Real runs of the tiny model (tests/test_flows.py's tiny overrides: 1 rank, the hf
engine) against one Prefect server; the refusals are decided before any server starts."""
import pytest

from test_flows import manifest_times, server, stagerl, tiny_overrides, write_run_assets  # noqa: F401 (server: a fixture)
from configs.loader import load_config
from flows.rerun import RunConfigChanged, check_rerun
from storage.artifacts import read_run_json, write_run_json
from storage.layout import RunLayout
from storage.store import Store
from storage.weights import folder_manifest, load_weights

PROJECT = "stagerl"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return write_run_assets(tmp_path_factory.mktemp("assets"))


def train(server, assets, root, name, steps, *more):
    return stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", name,
                            *tiny_overrides(assets, root, steps), *more])


def test_a_finished_run_extended_equals_a_straight_run(server, assets, tmp_path):
    """2 steps, then the same with total_training_steps=3: steps 1-2 are not run again (their
    manifests untouched), step 3 runs, and its weights are byte for byte those of a 3-step run;
    run.json records the new total. Then total_training_steps=2: nothing to run, exit 0, nothing
    written."""
    root = tmp_path / "runs"
    store, layout = Store.from_config({"root": str(root)}), RunLayout(PROJECT, "ext")
    straight = train(server, assets, root, "straight", 3)
    assert straight.returncode == 0, straight.stdout[-4000:]
    first = train(server, assets, root, "ext", 2)
    assert first.returncode == 0, first.stdout[-4000:]
    assert read_run_json(store, layout)["total_training_steps"] == 2
    before = manifest_times(store, layout)

    more = train(server, assets, root, "ext", 3)
    assert more.returncode == 0, more.stdout[-4000:]
    assert "stagerl/ext: 2 -> 3 steps; it continues after its last complete step (2)" in more.stdout
    assert manifest_times(store, layout) == before  # steps 1-2: not run again
    assert all(manifest_times(store, layout, steps=(3,)).values())
    doc = read_run_json(store, layout)
    assert doc["total_training_steps"] == 3 and doc["config"]["trainer"]["total_training_steps"] == 3
    ours = folder_manifest(store, layout.weights(3))
    theirs = folder_manifest(store, RunLayout(PROJECT, "straight").weights(3))
    assert ours["checksum"] == theirs["checksum"]
    a = load_weights(store, layout, 3, cache_dir=tmp_path / "a") / "model.safetensors"
    b = load_weights(store, RunLayout(PROJECT, "straight"), 3, cache_dir=tmp_path / "b") / "model.safetensors"
    assert a.read_bytes() == b.read_bytes()

    written = doc["written_at"]
    lower = train(server, assets, root, "ext", 2)
    assert lower.returncode == 0, lower.stdout[-4000:]
    assert ("experiment stagerl/ext already has 3 steps (trainer.total_training_steps: 3 -> 2): "
            "nothing to run, nothing changed") in lower.stdout
    assert "Prefect" not in lower.stdout  # decided before a server starts
    assert read_run_json(store, layout)["written_at"] == written
    assert manifest_times(store, layout, steps=(1, 2, 3)) == {**before, **manifest_times(store, layout, steps=(3,))}


def test_extending_a_cosine_schedule_is_refused_naming_the_key(server, assets, tmp_path):
    """A finished 1-step run with a cosine learning rate, rerun with 2 steps: exit 2 before any
    server starts, naming the key and how to make the schedule independent of the total."""
    root = tmp_path / "runs"
    store, layout = Store.from_config({"root": str(root)}), RunLayout(PROJECT, "cos")
    cosine = "actor_rollout_ref.actor.optim.warmup_style=cosine"
    first = train(server, assets, root, "cos", 1, cosine)
    assert first.returncode == 0, first.stdout[-4000:]
    doc = read_run_json(store, layout)
    refused = train(server, assets, root, "cos", 2, cosine)
    assert refused.returncode == 2, refused.stdout[-4000:]
    assert ("error: experiment stagerl/cos cannot be extended (trainer.total_training_steps: 1 -> 2): "
            "its learning-rate schedule depends on the total steps "
            "(actor_rollout_ref.actor.optim.warmup_style='cosine')") in refused.stdout
    assert "actor_rollout_ref.actor.optim.warmup_style=constant" in refused.stdout
    assert "Prefect" not in refused.stdout and read_run_json(store, layout) == doc


def finished_run(tmp_path, *overrides, done=2, total=2):
    """A store whose experiment `e` has run.json for tiny-cpu + overrides and `done` committed updates
    (manifests only: check_rerun reads nothing else)."""
    store, layout = Store.from_config({"root": str(tmp_path)}), RunLayout(PROJECT, "e")
    cfg = load_config("tiny-cpu", [*overrides, "trainer.experiment_name=e", f"trainer.total_training_steps={total}"])
    write_run_json(store, layout, dict(cfg), extra={"total_training_steps": total, "steps_per_epoch": 16})
    for k in range(1, done + 1):
        store.write_json(layout.manifest(k, "update"), {"stage": "update", "step": k})
    return store, layout


def check(store, layout, *overrides, total=None):
    cfg = load_config("tiny-cpu", [*overrides, "trainer.experiment_name=e"])
    return check_rerun(store, layout, cfg, total)


def test_which_reruns_extend_and_which_are_refused(tmp_path):
    """check_rerun on stored run.json files: what extends, what has nothing to run, what is refused."""
    store, layout = finished_run(tmp_path / "a")
    assert check(store, layout, "trainer.total_training_steps=2") is None  # the same config: a resume
    assert check(store, layout, "trainer.total_training_steps=5") is None  # constant lr: extends
    assert check(store, layout, "trainer.total_training_steps=1") == (
        "experiment stagerl/e already has 2 steps (trainer.total_training_steps: 2 -> 1): nothing to run, "
        "nothing changed")
    # total_epochs x run.json's steps per epoch: 1 x 16 = 16 steps (the CLI's check, before any data is read)
    assert check(store, layout, "trainer.total_training_steps=null", "trainer.total_epochs=1") is None
    with pytest.raises(RunConfigChanged, match=r"actor_rollout_ref.actor.optim.lr: 0.001 -> 2e-05; trainer.total_training_steps: 2 -> 5"):
        check(store, layout, "trainer.total_training_steps=5", "actor_rollout_ref.actor.optim.lr=2e-5")

    ratio = "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5"
    store, layout = finished_run(tmp_path / "b", ratio, total=4)
    with pytest.raises(RunConfigChanged) as refused:
        check(store, layout, ratio, "trainer.total_training_steps=8")
    assert "(actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5)" in str(refused.value)
    assert ("actor_rollout_ref.actor.optim.lr_warmup_steps=2 (what the ratio gave over 4 steps) instead of "
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio") in str(refused.value)
    assert check(store, layout, ratio, "trainer.total_training_steps=2") is not None  # lower: nothing to run
    # a warm-up given in steps does not depend on the total
    steps = "actor_rollout_ref.actor.optim.lr_warmup_steps=3"
    store, layout = finished_run(tmp_path / "c", steps, ratio, total=4)
    assert check(store, layout, steps, ratio, "trainer.total_training_steps=8") is None
    # no update finished yet: nothing trained at the old total
    store, layout = finished_run(tmp_path / "d", ratio, done=0, total=4)
    store.write_json(layout.manifest(1, "rollout"), {"stage": "rollout", "step": 1})
    assert check(store, layout, ratio, "trainer.total_training_steps=8") is None
    # the critic's schedule counts where the run has a critic (GAE)
    gae = ["algorithm.adv_estimator=gae", "critic.optim.warmup_style=cosine",
           "critic.ppo_micro_batch_size_per_gpu=4"]
    store, layout = finished_run(tmp_path / "e", *gae)
    with pytest.raises(RunConfigChanged, match=r"\(critic.optim.warmup_style='cosine'\)"):
        check(store, layout, *gae, "trainer.total_training_steps=3")
