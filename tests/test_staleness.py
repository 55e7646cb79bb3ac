"""trainer.staleness (bounded-staleness asynchronous RL): step k samples from the weights after
update max(0, k-1-s), a function of k, never of timing. Real runs (`stagerl train` subprocesses
against a real Prefect server, the tiny model, 1 rank, the hf engine in its own process): the
policy_version column, two runs with one seed equal, a SIGKILL while two steps overlap then a
resume equal to the uninterrupted run, and verl's timing-dependent keys refused by name."""
import json
import re
import signal

import pytest

from test_flows import PROJECT, assets, server, stagerl, tiny_overrides  # noqa: F401, F811 (fixtures)
from flows.cli import main
from configs.loader import load_config
from configs.plan import PlanError, compute_plan
from storage.artifacts import read_file, read_manifest
from storage.layout import STAGES, RunLayout
from storage.store import Store
from storage.weights import folder_manifest


def staleness_overrides(base, root, steps=3, s=1):
    return tiny_overrides(base, root, steps=steps) + [f"trainer.staleness={s}", "trainer.save_freq=2"]


def test_the_plan_says_what_staleness_does_and_refuses_timing_keys_by_name():
    cfg = load_config("configs/tiny-cpu.yaml", ["trainer.staleness=1"])
    plan = compute_plan(cfg)
    assert plan["async"]["staleness"] == 1 and plan["async"]["old_log_probs"].startswith("recomputed by the logprob")
    on_policy = compute_plan(load_config("configs/tiny-cpu.yaml", [
        "trainer.staleness=1", "actor_rollout_ref.actor.ppo_mini_batch_size=60", "actor_rollout_ref.actor.use_kl_loss=false"]))
    assert on_policy["rollout"]["old_log_prob_pass"] is False  # the update's first forward is the current policy
    assert "the update's own first forward" in on_policy["async"]["old_log_probs"]
    assert "max(0, k-1-1)" in plan["async"]["rollout_samples"] and "none" in plan["async"]["correction"]
    with_is = compute_plan(load_config("configs/tiny-cpu.yaml", [
        "trainer.staleness=2", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "algorithm.rollout_correction.rollout_is=token"]))
    assert with_is["async"]["correction"].startswith("token-level truncated importance sampling")
    sync = compute_plan(load_config("configs/tiny-cpu.yaml", []))
    assert "async" not in sync  # staleness 0: the plan (in every fingerprint) as before
    for key, value in (("async_training.staleness_threshold", "0.5"),
                       ("async_training.trigger_parameter_sync_step", "4"),
                       ("async_training.partial_rollout", "true")):
        with pytest.raises(PlanError) as err:
            compute_plan(load_config("configs/tiny-cpu.yaml", [f"{key}={value}"]))
        assert str(err.value).startswith(f"{key}={value.lower() if value == 'true' else value}: not supported")
        assert "trainer.staleness" in str(err.value) and key in err.value.keys


def weights(store, experiment, step):
    return folder_manifest(store, RunLayout(PROJECT, experiment).weights(step))["checksum"]


def test_the_engine_and_the_training_share_the_cores_when_they_overlap():
    """At staleness > 0 the engine samples while the update trains: unpinned, each takes half the
    cores (never more busy threads than cores), the engine in its own process and the one-rank
    update in its forked rank (flows.train.training_threads; in the flow's without a fork server); pinned (rollout.cpu_affinity), the engine takes its cores and this
    process is left alone; at staleness 0 the engine has every core."""
    import torch

    from flows.train import training_threads_beside_engine
    from stages.engines import EngineOptions, available_cores, in_own_process, make_spec, split_cores

    assert [split_cores(c) for c in (1, 2, 3, 8)] == [(1, 1), (1, 1), (1, 2), (4, 4)]
    cores = available_cores()
    spec = lambda **kw: make_spec(EngineOptions(model_dir="m", rollout={}, **kw), "hf", 0, 1)
    assert spec(own_process=in_own_process(1, None)).threads == split_cores(cores)[0]
    assert spec(own_process=in_own_process(1, [0]), cpus=(0,)).threads == 1
    assert spec(own_process=in_own_process(0, None)).threads == cores
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        cfg = load_config("tiny-cpu", ["trainer.staleness=1"])
        restore = training_threads_beside_engine(cfg, {"n_gpus": 1})
        assert torch.get_num_threads() == min(8, split_cores(cores)[1])
        restore()
        assert torch.get_num_threads() == 8
        pinned = load_config("tiny-cpu", ["trainer.staleness=1", "actor_rollout_ref.rollout.cpu_affinity=[0]"])
        training_threads_beside_engine(pinned, {"n_gpus": 1})
        training_threads_beside_engine(cfg, {"n_gpus": 2})   # the ranks are processes of their own
        assert torch.get_num_threads() == 8
    finally:
        torch.set_num_threads(before)


def test_staleness_one_runs_pipelined_deterministic_and_resumes_bit_for_bit(server, assets, tmp_path, capsys):  # noqa: F811
    """A 3-step run at s=1: rollout rows sampled by versions 0, 0, 1, old log-probs from the current
    policy (the update's first forward), the overlap reported; two more runs with the same seed, one
    SIGKILLed in step 2's update (step 3's rollout running or done beside it), the other in step 3's
    rollout (step 2's training beside it), each resumed, end with the first run's weights bit for bit."""
    root = tmp_path / "runs"
    store = Store.from_config({"root": str(root)})
    run = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", "a", *staleness_overrides(assets, root),
                           "orchestration.step_report_interval_s=3600"])
    assert run.returncode == 0, run.stdout[-4000:]
    layout = RunLayout(PROJECT, "a")
    versions = [sorted(set(read_file(store, layout, k, "rollout").column("policy_version").to_pylist()))
                for k in (1, 2, 3)]
    assert versions == [[0], [0], [1]]
    rollout = read_file(store, layout, 3, "rollout")
    assert "rollout_log_probs" in rollout.column_names  # the behaviour policy's log-probs, stored
    assert read_manifest(store, layout, 3, "rollout")["extra"]["staleness"] == 1
    # one mini-batch, one epoch: the old log-probs (the current policy's) are the update's first forward
    assert "old_log_probs" in read_file(store, layout, 2, "update", "update/log_probs.parquet").column_names
    # one rank, the engine in its own process: the update trains in a one-rank pool forked from
    # the run's fork server, whose prepare job built the first DeepSpeed set-up beside the first
    # rollout (flows.train.start_rank_pool), so step 1 reused it
    assert read_file(store, layout, 1, "update", "update/metrics.json")["update/engine_reused"] is True
    assert "timing_s/overlap:" in run.stdout, run.stdout[-3000:]  # step 2+: its rollout beside the previous update
    # the step report (a Prefect artifact per step) states the overlap achieved
    reports = json.loads(server.cli("artifact", "inspect", "stagerl-a-step", "-o", "json").stdout)
    # orchestration.step_report_interval_s=3600: the first step's report and the last's, not step 2's
    assert sorted(re.search(r"stagerl/a: step (\d+)\n", a["data"]).group(1) for a in reports) == ["1", "3"]
    step3 = [a["data"] for a in reports if "stagerl/a: step 3" in a["data"]]
    # tiny-cpu's KL loss: the logprob stage runs the reference pass, in the trainer chain
    assert len(step3) == 1 and "overlap: this step's rollout, reward ran " in step3[0]
    assert "beside step 2's logprob, advantage, update (" in step3[0]
    assert "sampled the weights after update 1 (staleness 1)" in step3[0]
    # inspect: per step the version sampled, the staleness, engine vs trainer and the IS weights
    code = main(["inspect", "a", "--root", str(root), "--step", "3", "--json"])
    policy = json.loads(capsys.readouterr().out)["policy"]
    assert code == 0 and policy["policy_version"] == 1 and policy["staleness"] == 1
    engine = [x for r in rollout.column("rollout_log_probs").to_pylist() for x in r]
    trainer = [x for r in read_file(store, layout, 3, "update", "update/log_probs.parquet").column("old_log_probs").to_pylist()
               for x in r]
    by_hand = sum(e - t for e, t in zip(engine, trainer)) / len(engine)
    assert policy["engine_vs_trainer"]["tokens"] == len(engine)
    assert policy["engine_vs_trainer"]["kl_k1"] == pytest.approx(by_hand, rel=1e-4, abs=1e-6)
    w = policy["is_weights"]
    assert w["p05"] <= w["p50"] <= w["p95"] <= w["max"] and 0 <= w["share_above_2"] <= 1
    assert main(["inspect", "a", "--root", str(root)]) == 0
    table = capsys.readouterr().out
    assert "version" in table and "staleness" in table and "is_weight/mean" in table
    assert main(["query", "select step, min(policy_version) v, max(policy_version) w from rollout group by step order by step",
                 "--experiment", "a", "--root", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["v"], r["w"]) for r in rows] == [(1, 0, 0), (2, 0, 0), (3, 1, 1)]
    assert main(["plot", "a", "--root", str(root), "--json"]) == 0
    plotted = json.loads(capsys.readouterr().out)
    panels = [a["ylabel"] for p in plotted for a in p["axes"] if p["name"] == "metrics.png"]
    assert "staleness (updates)" in panels and "IS weight pi_old/pi_rollout (mean)" in panels
    # save_freq 2 keeps the weights after updates 2 and 3; a fork at step 3's rollout at staleness 1
    # samples the weights after update 1, no longer kept: refused before it starts
    refused = stagerl(server, ["fork", "a", "a2", "--at", "3:rollout", "--root", str(root), "trainer.staleness=1"])
    assert refused.returncode == 2 and "step_000001 is no longer kept, and the rollout of step 3 " \
        "(trainer.staleness=1) needs it" in refused.stdout, refused.stdout[-2000:]
    # a fork at the same step into the other schedule: a0 redoes step 3 at staleness 0 (sampling
    # the weights after update 2, kept) and the two branches' curves plot side by side
    forked = stagerl(server, ["fork", "a", "a0", "--at", "3:rollout", "--root", str(root), "trainer.staleness=0",
                              "actor_rollout_ref.rollout.calculate_log_probs=true"])
    assert forked.returncode == 0, forked.stdout[-3000:]
    branch = read_file(store, RunLayout(PROJECT, "a0"), 3, "rollout")
    assert set(branch.column("policy_version").to_pylist()) == {2}
    assert branch.column("rollout_log_probs").to_pylist() != rollout.column("rollout_log_probs").to_pylist()  # other weights
    assert main(["plot", "a", "a0", "--root", str(root), "--json"]) == 0
    assert "branches_a_a0.png" in {p["name"] for p in json.loads(capsys.readouterr().out)}
    # killed in step 2's update after it trained (its commit not written), step 3's rollout beside it
    for name, fault in (("c", "update:after_train@2"), ("d", "rollout:before_manifest@3")):
        killed = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", name,
                                  *staleness_overrides(assets, root)], fault=fault)
        assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
        layout = RunLayout(PROJECT, name)
        stage, step = fault.split(":")[0], int(fault.split("@")[1])
        assert read_manifest(store, layout, step, stage) is None  # killed inside it
        resumed = stagerl(server, ["resume", name, "--root", str(root)])
        assert resumed.returncode == 0, resumed.stdout[-4000:]
        assert all(read_manifest(store, layout, k, s) for k in (1, 2, 3) for s in STAGES)
        assert weights(store, name, 3) == weights(store, "a", 3), fault


def test_the_overlap_counts_the_rollout_chains_time_beside_the_previous_training_once():
    """timing_s/overlap: the union of the rollout chain's stage spans within the previous step's
    trainer chain (logprob and reward run side by side: counted once), by hand."""
    from flows.train import chain_overlap, rollout_chain

    span = lambda a, d: {"started_at": a, "seconds": d}
    seq = chain_overlap({"rollout": span(0, 2), "reward": span(2, 0.5)}, (1, 10), 3, 1)
    assert seq["seconds"] == 1.5 and seq["share"] == pytest.approx(1.5 / 9) and seq["policy_version"] == 1
    chain = rollout_chain(False)
    assert chain == ("rollout", "logprob", "reward", "advantage") and rollout_chain(True) == ("rollout", "reward")
    side = chain_overlap({"rollout": span(0, 2), "logprob": span(2, 0.3), "reward": span(2, 0.5),
                          "advantage": span(2.5, 0.1)}, (1, 10), 3, 1, chain)
    assert side["seconds"] == pytest.approx(1.6) and side["chain"] == list(chain)  # 1 + 0.5 + 0.1, not 1.9
    assert chain_overlap({"rollout": span(0, 20)}, (1, 10), 3, 1)["seconds"] == 9.0
    assert chain_overlap({"rollout": span(0, 2)}, None, 1, 1) is None


def test_with_no_logprob_pass_the_rollout_chain_takes_the_logprob_and_advantage(server, assets, tmp_path):  # noqa: F811
    """No KL loss: the logprob stage runs no pass (the old log-probs are the update's first
    forward), so step k+1's logprob and advantage read nothing update k changes and run in the
    rollout chain beside it (flows.train.rollout_chain). A run failing (bad input) at update 1's
    start has step 2's whole rollout chain committed (the failure waits for it), none of its
    update; resumed, it ends with the weights of an uninterrupted run."""
    root = tmp_path / "runs"
    store = Store.from_config({"root": str(root)})
    overrides = [*staleness_overrides(assets, root, steps=2), "actor_rollout_ref.actor.use_kl_loss=false"]
    failed = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", "e", *overrides],
                     fault="update:start:value@1")
    assert failed.returncode == 1 and "injected bad input at update:start (step 1)" in failed.stdout, failed.stdout[-3000:]
    layout = RunLayout(PROJECT, "e")
    assert read_manifest(store, layout, 2, "logprob")["extra"]["passes"] == []
    assert [bool(read_manifest(store, layout, k, s)) for k in (1, 2) for s in STAGES] == \
        [True, True, True, True, False, True, True, True, True, False]
    resumed = stagerl(server, ["resume", "e", "--root", str(root)])
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    straight = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", "f", *overrides])
    assert straight.returncode == 0, straight.stdout[-4000:]
    assert "timing_s/overlap:" in straight.stdout
    assert weights(store, "e", 2) == weights(store, "f", 2)


# ---- the demo learns at s=1 (issue 35: "It still learns"), at a test's scale ------------------
DEMO_STEPS = 16


@pytest.fixture(scope="module")
def demo_assets(tmp_path_factory):
    """The demo's model (flows.demo.MODEL_OPTIONS) and training set (flows.demo: 1000 prompts of
    single-digit addition, seed 1), and 8 test prompts."""
    from flows.demo import DIFFICULTY, MODEL_OPTIONS, TRAIN_ROWS
    from stages.data.tools import make_arith_dataset, write_rows
    from stages.model.tiny import save_tiny_model

    base = tmp_path_factory.mktemp("demo")
    save_tiny_model(base / "model", **MODEL_OPTIONS)
    write_rows(make_arith_dataset(TRAIN_ROWS, seed=1, difficulty=DIFFICULTY), base / "train.parquet")
    write_rows(make_arith_dataset(8, seed=2, difficulty=DIFFICULTY, split="test"), base / "test.parquet")
    return base


def demo_overrides(base, root, s: int) -> list:
    """configs/tiny-cpu.yaml as the demo runs it (its 300-step warm start, temperature 2.0, lr,
    KL loss, 4 PPO mini-batches per step) scaled down: 24 prompts x 12 = 288 rows per step instead
    of 720, 1 rank, the hf engine, 16 steps, no validation."""
    return [f"actor_rollout_ref.model.path={base}/model", f"data.train_files={base}/train.parquet",
            f"data.val_files={base}/test.parquet", f"storage.root={root}", f"storage.cache_dir={root}-cache",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.name=hf", "reward.num_workers=1", "orchestration.retry_delay_s=0.5",
            "data.train_batch_size=24", "actor_rollout_ref.rollout.n=12", "data.max_response_length=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=6", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=72",
            "actor_rollout_ref.rollout.hf_generate_batch_size=24",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=144",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=144",
            f"trainer.total_training_steps={DEMO_STEPS}", f"trainer.staleness={s}"]


def test_the_demo_learns_at_staleness_one(server, demo_assets, tmp_path):  # noqa: F811
    """The demo's task at s=1: every rollout samples the weights one update older than s=0 would
    (policy_version max(0, k-2)), and the mean reward still rises from ~0.15 over steps 1-3 to
    ~0.45-0.55 over steps 14-16 (hand-checked over trainer.seed 1-5: +0.26 to +0.38)."""
    root = tmp_path / "runs"
    run = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", "demo-s1",
                           *demo_overrides(demo_assets, root, s=1)])
    assert run.returncode == 0, run.stdout[-4000:]
    store, layout = Store.from_config({"root": str(root)}), RunLayout(PROJECT, "demo-s1")
    steps = range(1, DEMO_STEPS + 1)
    versions = [set(read_file(store, layout, k, "rollout").column("policy_version").to_pylist()) for k in steps]
    assert versions == [{max(0, k - 2)} for k in steps]
    rewards = [read_manifest(store, layout, k, "reward")["extra"]["metrics"]["reward/score/mean"] for k in steps]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= first + 0.15 and last >= 1.8 * first, [round(r, 3) for r in rewards]
