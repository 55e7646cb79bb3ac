"""The update's weights to the rollout engine in memory, stored in the background, and resume by
replaying updates (stages.training.handoff, stages.training.state, stages.training.worker): real
DeepSpeed updates of the tiny model on hand-made inputs (tests/_update_inputs.py), a real hf engine
in this process, hashes of what it serves against what the store holds."""
import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from _update_inputs import make_ctx, write_inputs

STEPS = 3
COMMON = [f"trainer.total_training_steps={STEPS}", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from stages.model.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def start_engine(session, ctx):
    """The run's resident hf engine in this process, started on the initial model (as the first
    rollout starts it)."""
    from stages.engines import EngineOptions, Sampling

    options = EngineOptions(model_dir=ctx.reference_weights(initial=True), rollout={"dtype": "float32"})
    session.engines().generate("hf", [[11, 12, 13]], [0], Sampling(n=1, max_new_tokens=2), options)
    return session.engines()


def run(root, model_dir, overrides=(), session=None, steps=STEPS, inputs=True):
    """update.run for steps 1..steps (inputs written by hand first); with `session` as a training
    run has it (the engine in this process, background commits)."""
    from stages import update

    out = []
    for step in range(1, steps + 1):
        ctx = make_ctx(root, model_dir, step, [*COMMON, *overrides])
        ctx.session = session
        if inputs:
            write_inputs(ctx, seed=5)
        if session is not None and step == 1 and session.engines().local is None:
            start_engine(session, ctx)
        manifest = update.run(ctx)
        if session is not None:
            session.wait_commits()
        out.append((ctx, manifest))
    return out


def stored_weights(ctx, step) -> bytes:
    return ctx.store.read_bytes(f"{ctx.layout.weights(step)}/model.safetensors")


def test_memory_handoff_serves_the_stored_version_and_stores_state_per_save_freq(tmp_path, model_dir):
    from stages.session import RunSession
    from stages.training.handoff import serialize
    from storage.artifacts import read_file, read_manifest
    from storage.weights import folder_manifest

    with RunSession() as session:
        steps = run(tmp_path / "a", model_dir, ["trainer.save_freq=2"], session=session)
        engines = session.engines()
        ctx = steps[-1][0]
        # the engine holds version 3, and what it serves is the stored file byte for byte
        assert engines.local_version == ctx.weights_version(3)
        served = serialize(engines.local[1].named_weights())
        assert sha(served) == folder_manifest(ctx.store, ctx.layout.weights(3))["files"]["model.safetensors"]["sha256"]
        assert served == stored_weights(ctx, 3)
    metrics = read_file(ctx.store, ctx.layout, 3, "update", "update/metrics.json")
    assert metrics["timing/handoff_s"] > 0 and metrics["timing/persist_s"] > 0
    # train state: every save_freq (2) steps and at the last (3); none at step 1
    stored = [k for k in (1, 2, 3) if ctx.store.exists(f"{ctx.layout.train_state}/step_{k:06d}/actor/_manifest.json")]
    assert stored == [2, 3]
    assert [read_manifest(ctx.store, ctx.layout, k, "update")["extra"]["handoff"] for k in (1, 2, 3)] == ["memory"] * 3


def test_resume_replays_updates_and_equals_the_uninterrupted_run(tmp_path, model_dir):
    """Reference: no session (a state stored and restored at every step). A session run (states
    only at the last step) loses its update of step 3 and its newest train state: the rerun
    restores what is stored (nothing: the initial weights) and replays steps 1-2 from their
    stored rows; the weights equal the reference's bit for bit. With step 1's state kept, it
    replays step 2 only: the same bytes again."""
    from stages import update
    from stages.session import RunSession
    from stages.training.state import state_key
    from storage.artifacts import read_file
    from storage.weights import folder_manifest

    reference = run(tmp_path / "ref", model_dir)
    ref_bytes = stored_weights(reference[-1][0], 3)
    init = (model_dir / "model.safetensors").read_bytes()
    assert ref_bytes != init
    # the export (its small files from a template, one safetensors write) stores the bytes
    # save_pretrained and the tokenizer's own save write for those weights
    from transformers import AutoModelForCausalLM

    from stages.training.engine import write_model_files

    ref_ctx = reference[-1][0]
    stored = Path(ref_ctx.store.path(ref_ctx.layout.weights(3)))
    model = AutoModelForCausalLM.from_pretrained(stored, dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved", state_dict={k: v.detach() for k, v in model.named_parameters()})
    write_model_files(tmp_path / "saved", "float32", model_dir)
    saved = {f.name: f.read_bytes() for f in (tmp_path / "saved").iterdir()}
    assert {f.name: f.read_bytes() for f in stored.iterdir() if not f.name.startswith("_")} == saved, sorted(saved)

    with RunSession() as session:
        steps = run(tmp_path / "run", model_dir, ["trainer.save_freq=1"], session=session)
    ctx = steps[-1][0]
    assert stored_weights(ctx, 3) == ref_bytes  # the handoff path trains the same weights
    checksum = lambda c: folder_manifest(c.store, c.layout.weights(3))["checksum"]
    assert checksum(ctx) == checksum(reference[-1][0])  # and stores the same folder (config, tokenizer)
    store, layout = ctx.store, ctx.layout
    for keep, replayed in ((1, [2]), (None, [1, 2])):
        for k in (1, 2, 3):
            if k != keep:
                shutil.rmtree(store.path(state_key(layout, k)), ignore_errors=True)
        store.delete(layout.manifest(3, "update"))
        store.delete(f"{layout.weights(3)}", recursive=True)
        again = make_ctx(tmp_path / "run", model_dir, 3, [*COMMON, "trainer.save_freq=1"])
        manifest = update.run(again)
        assert manifest["extra"]["replayed_steps"] == replayed
        assert read_file(store, layout, 3, "update", "update/metrics.json")["update/replayed_steps"] == len(replayed)
        assert stored_weights(again, 3) == ref_bytes


def test_a_rollout_never_samples_from_another_version(tmp_path, model_dir):
    """An engine holding version A is asked for version B whose weights exist only in memory (its
    folder has the small files only): refused before sampling, naming both. Asked for A it
    samples without loading anything."""
    from stages.engines import VERSION_FILE, EngineError, EngineOptions, Sampling
    from stages.session import RunSession
    from stages.training.handoff import rollout_tensors  # noqa: F401 (the module the engine takes from)

    ctx = make_ctx(tmp_path, model_dir, 1, COMMON)
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "config.json").write_text((model_dir / "config.json").read_text())
    (stub / VERSION_FILE).write_text('{"version": "B"}')
    with RunSession() as session:
        engines = start_engine(session, ctx)
        params = engines.local[1].named_weights()
        engines.take_tensors(((k, v.detach() + 0.0) for k, v in params.items()), "A", stub)
        assert engines.local_version == "A"
        options = EngineOptions(model_dir=stub, rollout={"dtype": "float32"}, weights_version="B")
        with pytest.raises(EngineError, match="weights version B .* but the engine holds A"):
            engines.generate("hf", [[11, 12]], [0], Sampling(n=1, max_new_tokens=2), options)
        options = EngineOptions(model_dir=stub, rollout={"dtype": "float32"}, weights_version="A")
        engines.generate("hf", [[11, 12]], [0], Sampling(n=1, max_new_tokens=2), options)
        assert options.timings["load_weights_s"] == 0.0
        with pytest.raises(ValueError, match="miss"):
            engines.take_tensors(iter([next(iter(params.items()))]), "C", stub)
        assert engines.local_version is None  # a half-copied version is no version


def test_fast_path_tensors_equal_the_gathered_fp32_masters(tmp_path, model_dir):
    """ZeRO-2 fp32 on one rank: the module's parameters the handoff gives without a copy are the
    fp32 masters DeepSpeed holds, value for value, after a real update."""
    from dataclasses import replace

    from stages.ranks.launch import init_distributed
    from stages.training.engine import full_fp32_state_dict
    from stages.training.handoff import rollout_tensors
    from stages.training.worker import UpdateJob

    ctx = make_ctx(tmp_path, model_dir, 1, [*COMMON, "actor_rollout_ref.actor.deepspeed.zero_stage=2"])
    write_inputs(ctx, seed=2)
    init_distributed("cpu")
    job = UpdateJob(ctx, 0, 1)
    job.train_step(replace(ctx, step=1))
    fast = dict(rollout_tensors(job.actor.engine, torch.float32, 0))
    masters = full_fp32_state_dict(job.actor.engine)
    assert fast.keys() == masters.keys()
    assert all(torch.equal(fast[k], masters[k]) for k in fast)


def test_a_run_that_stops_stores_the_state_its_ranks_kept(tmp_path, model_dir):
    """Two of five steps trained (save_freq not due, not the last step): nothing stored; at the
    run's end the engines kept in the ranks store step 2's state, and step 3's update (without the
    kept engines) restores it and replays nothing."""
    from stages import update
    from stages.session import RunSession
    from stages.training.state import stored_states

    five = ["trainer.total_training_steps=5"]
    with RunSession() as session:
        ctx = run(tmp_path, model_dir, five, session=session, steps=2)[-1][0]
        assert stored_states(ctx) == []
        assert update.store_kept_state(ctx) is True
        assert stored_states(ctx) == [2]
        assert update.store_kept_state(ctx) is False  # already stored
    again = make_ctx(tmp_path, model_dir, 3, [*COMMON, *five])
    write_inputs(again, seed=5)
    assert update.run(again)["extra"]["replayed_steps"] == []


def test_a_damaged_train_state_is_dropped_not_its_update(tmp_path, model_dir):
    """verify finds a flipped byte in the newest train state; repair removes that state's manifest
    only (the update stays committed: a later update replays from an older state instead)."""
    from stages.session import RunSession
    from stages.training.state import newest_state, state_key
    from storage.artifacts import read_manifest
    from storage.verify import repair, verify_run

    with RunSession() as session:
        ctx = run(tmp_path, model_dir, ["trainer.save_freq=2"], session=session)[-1][0]
    folder = ctx.store.path(f"{state_key(ctx.layout, 3)}/actor")
    biggest = max((p for p in Path(folder).rglob("*") if p.is_file() and p.name != "_manifest.json"),
                  key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    biggest.write_bytes(bytes(data))
    report = verify_run(ctx.store, ctx.layout)
    assert [d.folder for d in report.damaged] == [f"{state_key(ctx.layout, 3)}/actor"]
    assert repair(ctx.store, ctx.layout, report) == [f"{state_key(ctx.layout, 3)}/actor"]
    assert read_manifest(ctx.store, ctx.layout, 3, "update") is not None
    ctx4 = make_ctx(tmp_path, model_dir, 4, COMMON)
    assert newest_state(ctx4, ["actor"]) == 2
