"""Forks as a user makes them with Prefect, and how far back a fork reaches.

With real parts (tests/test_flow_retry.py's `deployed`: `prefect server start`, the `cpu` process
pool and its worker, `prefect deploy --name tiny-cpu` from this checkout): a 4-step source trained
by `prefect deployment run 'rl-train/tiny-cpu'` with trainer.save_freq=1 (every step's weights and
train state kept), then the fork the README's tour shows in its deployment form, run as the CLI:
`prefect deployment run 'rl-train/tiny-cpu' -p fork='{"source": "src", "at": "3:advantage"}'
-p experiment_name=src-rloo -p overrides='[...algorithm.adv_estimator=rloo...]'`. Tiny shapes as in
tests/test_fork.py (8 rows per step, 1 rank, the hf engine, no warm start); the fork stops at step
3 (trainer.total_training_steps=3), so it computes only step 3's advantage and update."""
import json
import re

import pytest

from test_flow_retry import deployed, run_deployment, wait_for_state  # noqa: F401 (a fixture)
from test_fork import PROJECT, REPO, cli, files, overrides
from test_flows import stagerl, write_run_assets
from stages.training.state import states_to_delete
from storage.artifacts import read_manifest, read_run_json, read_table
from storage.layout import STAGES, RunLayout
from storage.store import Store
from storage.verify import verify_run
from storage.weights import folder_manifest, list_weights


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return write_run_assets(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="module")
def src(deployed, assets, tmp_path_factory):
    """The store root holding `src`: 4 steps of GRPO by a deployment run, trainer.save_freq=1."""
    root = tmp_path_factory.mktemp("store") / "runs"
    params = {"overrides": overrides(assets, root, 4) + ["trainer.save_freq=1"], "experiment_name": "src"}
    wait_for_state(deployed, run_deployment(deployed, params), "COMPLETED")
    return root


def test_states_kept_per_save_freq_and_max_ckpt_to_keep():
    """verl's checkpoint retention for train states, besides the newest two a rerun needs."""
    assert states_to_delete([1, 2, 3, 4], 4, -1, None) == [1, 2]  # the default: newest two
    assert states_to_delete([3, 4, 5], 5, -1, None) == [3]
    assert states_to_delete([1, 2, 3, 4], 4, 1, None) == []  # save_freq=1: every step's
    assert states_to_delete([1, 2, 3, 4, 5, 6, 7], 7, 2, None) == [1, 3, 5]
    assert states_to_delete([2, 4, 6, 7], 7, 2, 3) == [2]  # at most 3 in all: 4, 6, 7 (and 6 = newest two)
    assert states_to_delete([1, 2, 3, 4], 4, 1, 1) == [1, 2]  # never fewer than the newest two
    assert states_to_delete([1, 2], 2, -1, None) == []


def test_fork_as_a_deployment_run(deployed, src, capsys):
    """`prefect deployment run 'rl-train/tiny-cpu' -p fork=... -p experiment_name=src-rloo -p
    overrides=...` completes; src-rloo's run.json records the lineage; its manifests of steps 1-2
    and of step 3's rollout, logprob and reward list src's objects (it wrote none of them); its
    step 3 advantage is RLOO's on src's scores; `stagerl runs` shows FORKED FROM."""
    before = files(src, "src")
    fork_overrides = [f"storage.root={src}", "algorithm.adv_estimator=rloo", "trainer.total_training_steps=3"]
    run = deployed.cli("deployment", "run", "rl-train/tiny-cpu",
                       "-p", 'fork={"source": "src", "at": "3:advantage"}', "-p", "experiment_name=src-rloo",
                       "-p", f"overrides={json.dumps(fork_overrides)}", "--watch", "--watch-interval", "2",
                       "--watch-timeout", "480", cwd=REPO, timeout=540, check=False)
    full_log = "\n".join(w.log.read_text(errors="replace") for w in deployed.workers)
    worker_log = "\n".join(w.log.read_text(errors="replace")[-6000:] for w in deployed.workers)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:] + worker_log
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", run.stdout).group(1)
    assert wait_for_state(deployed, flow_run_id, "COMPLETED", timeout=30)["state"]["type"] == "COMPLETED"
    assert "fork stagerl/src-rloo of stagerl/src at 3:advantage: 13 stage(s)" in full_log

    store, new, old = Store.from_config({"root": str(src)}), RunLayout(PROJECT, "src-rloo"), RunLayout(PROJECT, "src")
    doc = read_run_json(store, new)
    lineage = doc["lineage"]
    assert (lineage["source"], lineage["at"], lineage["created"]) == ("stagerl/src", "3:advantage", True)
    assert "algorithm.adv_estimator=rloo" in lineage["overrides"]
    assert doc["config"]["algorithm"]["adv_estimator"] == "rloo" and doc["config"]["trainer"]["save_freq"] == 1

    written = sorted(files(src, "src-rloo"))
    reused = [k for k in written if k.startswith(("steps/000001/", "steps/000002/"))]
    assert len(reused) == 10 and all("/_manifests/" in k for k in reused)
    step3 = [k for k in written if k.startswith("steps/000003/") and "/_manifests/" not in k]
    assert "steps/000003/advantage.parquet" in step3
    assert not [k for k in step3 if k.split("/")[-1] in ("rollout.parquet", "logprob.parquet", "reward.parquet")]
    for step, stage in [(s, st) for s in (1, 2) for st in STAGES] + [(3, st) for st in STAGES[:3]]:
        mine, theirs = read_manifest(store, new, step, stage), read_manifest(store, old, step, stage)
        assert {n: (e["path"], e["sha256"]) for n, e in mine["files"].items()} == \
            {n: (e["path"], e["sha256"]) for n, e in theirs["files"].items()}, (step, stage)
        assert mine["forked_from"]["experiment"] == "stagerl/src"
    after = files(src, "src")
    assert {k: v for k, v in after.items() if not k.startswith("forks/")} == before
    assert set(after) - set(before) == {"forks/src-rloo.json"}

    advantage = read_manifest(store, new, 3, "advantage")
    assert "forked_from" not in advantage
    assert advantage["files"]["advantage.parquet"]["path"] == "stagerl/src-rloo/steps/000003/advantage.parquet"
    reward = read_table(store, new, 3, "reward")
    scores = dict(enumerate(reward.column("score").to_pylist()))
    groups: dict = {}
    for row, uid in enumerate(read_table(store, new, 3, "rollout").column("uid").to_pylist()):
        groups.setdefault(uid, []).append(row)
    advantages = read_table(store, new, 3, "advantage").column("advantages").to_pylist()
    assert any(len({scores[r] for r in rows}) > 1 for rows in groups.values())  # RLOO has something to do
    for rows in groups.values():
        for r in rows:  # RLOO: the row's score minus the mean of the other answers to its prompt
            expected = scores[r] - sum(scores[o] for o in rows if o != r) / (len(rows) - 1)
            assert advantages[r] == pytest.approx([expected] * len(advantages[r]), abs=1e-5), (r, rows)
    assert advantages != read_table(store, old, 3, "advantage").column("advantages").to_pylist()
    assert read_manifest(store, new, 3, "update") and list_weights(store, new)[-1] == 3
    assert verify_run(store, new).ok

    code, out, _ = cli(capsys, "runs", "--root", src)
    assert code == 0 and "FORKED FROM" in out
    line = next((x for x in out.splitlines() if "src-rloo" in x.split()), out)
    assert "src @ 3:advantage (" in line and "algorithm.adv_estimator=rloo" in line, out


def test_a_source_that_keeps_every_state_forks_at_any_step(deployed, src):
    """src kept every train state and weights (trainer.save_freq=1): a fork at 1:update is
    accepted, and one at 2:rollout (which needs step 1's train state and weights) recomputes
    step 2 bit for bit as src did. A source with the default keeps only its latest weights: a fork
    at rollout or logprob of an earlier step is refused naming trainer.save_freq (tests/test_fork.py)."""
    from configs.loader import load_config
    from configs.suggest import make_plan
    from flows.fork import check_fork, fork_arguments

    store, old = Store.from_config({"root": str(src)}), RunLayout(PROJECT, "src")
    assert store.list(old.train_state) == [f"step_{k:06d}" for k in (1, 2, 3, 4)]
    assert list_weights(store, old) == [1, 2, 3, 4]
    fork = {"source": "src", "at": "1:update"}
    config, merged = fork_arguments("tiny-cpu", [f"storage.root={src}"], fork)
    cfg = load_config(config, merged + ["trainer.experiment_name=at1"])
    assert check_fork(store, cfg, make_plan(cfg), fork)["reuse"][-1] == (1, "advantage")

    run = stagerl(deployed, ["fork", "src", "at2", "--at", "2:rollout", "--root", str(src),
                             "trainer.total_training_steps=2"])
    assert run.returncode == 0, run.stdout[-4000:]
    new = RunLayout(PROJECT, "at2")
    for stage in STAGES:
        mine, theirs = read_manifest(store, new, 2, stage), read_manifest(store, old, 2, stage)
        assert "forked_from" not in mine and mine["files"], stage  # computed by the fork
        assert {n: e["sha256"] for n, e in mine["files"].items() if not n.endswith("metrics.json")} == \
            {n: e["sha256"] for n, e in theirs["files"].items() if not n.endswith("metrics.json")}, stage
    assert folder_manifest(store, new.weights(2))["checksum"] == folder_manifest(store, old.weights(2))["checksum"]
