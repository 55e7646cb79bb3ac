"""stagerl fork, rescore and delete, and query / plot / runs over branches, on real runs of the
tiny CPU model (tests/test_flows.py's tiny overrides: 8 rows per step, 1 rank, a reward that
depends on the sampled text so that groups have advantages). One 3-step source run `src` is
shared by the module; `rloo` is its fork at 3:advantage; one fork (rescore --as) on moto S3."""
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from _prefect_server import PrefectServer
from _s3_server import MotoServer
from test_flows import stagerl, tiny_overrides, write_run_assets
from flows.cli import main
from storage.artifacts import read_file, read_manifest, read_table, write_stage
from storage.layout import STAGES, RunLayout
from storage.store import Store
from storage.verify import verify_run
from storage.weights import folder_manifest, load_folder, save_folder

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
PROJECT = "stagerl"
REWARDS = TESTS / "_fork_rewards.py"
S3_CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def overrides(assets, root, steps) -> list:
    return tiny_overrides(assets, root, steps) + [f"custom_reward_function.path={REWARDS}"]


def files(root: Path, experiment: str) -> dict:
    """{key under the run folder: (size, mtime_ns)} of every stored file of the run."""
    base = root / PROJECT / experiment
    return {p.relative_to(base).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in base.rglob("*") if p.is_file()}


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with PrefectServer(tmp_path_factory.mktemp("prefect-home")) as srv:
        yield srv


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return write_run_assets(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="module")
def src(server, assets, tmp_path_factory):
    """The store root holding `src`: 3 steps of GRPO (train states of steps 2 and 3 kept, weights
    of step 3 only)."""
    root = tmp_path_factory.mktemp("store") / "runs"
    run = stagerl(server, ["train", "--config", "tiny-cpu", "--experiment", "src", *overrides(assets, root, 3)])
    assert run.returncode == 0, run.stdout[-4000:]
    return root


@pytest.fixture(scope="module")
def forked(server, src):
    """`stagerl fork src rloo --at 3:advantage algorithm.adv_estimator=rloo` (4 steps), SIGKILLed
    inside its first update (step 3, files written, manifest not), then `stagerl resume rloo`."""
    before = files(src, "src")
    args = ["fork", "src", "rloo", "--at", "3:advantage", "--root", str(src), "algorithm.adv_estimator=rloo",
            "trainer.total_training_steps=4"]
    killed = stagerl(server, args, fault="update:before_manifest@3")
    resumed = stagerl(server, ["resume", "rloo", "--root", str(src)])
    return {"before": before, "killed": killed, "resumed": resumed}


def test_fork_reuses_the_source_objects_resumes_and_equals_a_run_on_the_same_rollouts(
        src, forked, assets, tmp_path):
    """The fork writes no object for what it reuses (steps 1-2, step 3's rollout, logprob and
    reward: its manifests list src's objects and checksums), src is untouched but for its record of
    the fork, the killed fork resumes like any run, and the override took effect (step 3's
    advantages are RLOO's, not src's GRPO ones).

    The run it must equal is built without any fork code: a plain copy of src's folder as
    experiment `ref` (its manifests pointed at ref's own copies), with step 3's advantage and update
    and their outputs (train state and weights of step 3) removed, then those stages and all of
    step 4 run by hand with the rloo config (tests/_fork_reference.py: stage modules, no Prefect, no
    run session). That is by definition "a run that used the same rollouts": steps 1-2 and step 3's
    rollout/logprob/reward are src's bytes, everything after is computed. Step 3's advantage table,
    all of step 4's tables and the final weights must be byte-identical."""
    killed, resumed = forked["killed"], forked["resumed"]
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    assert "SIGKILL at update:before_manifest (step 3)" in killed.stdout
    assert "fork stagerl/rloo of stagerl/src at 3:advantage: 13 stage(s)" in killed.stdout
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    for stage in ("rollout", "logprob", "reward", "advantage"):  # complete before the kill
        assert f"Task run '{stage}-step-3' - Finished in state Cached" in resumed.stdout, stage
    store, new, old = Store.from_config({"root": str(src)}), RunLayout(PROJECT, "rloo"), RunLayout(PROJECT, "src")

    written = sorted(files(src, "rloo"))
    reused = [k for k in written if k.startswith(("steps/000001/", "steps/000002/"))]
    assert len(reused) == 10 and all("/_manifests/" in k for k in reused)
    step3 = [k for k in written if k.startswith("steps/000003/") and "/_manifests/" not in k]
    assert "steps/000003/advantage.parquet" in step3
    assert not [k for k in step3 if k.split("/")[-1] in ("rollout.parquet", "logprob.parquet", "reward.parquet")]
    for step in (1, 2, 3):
        for stage in STAGES if step < 3 else STAGES[:3]:
            mine, theirs = read_manifest(store, new, step, stage), read_manifest(store, old, step, stage)
            assert {n: (e["path"], e["sha256"]) for n, e in mine["files"].items()} == \
                {n: (e["path"], e["sha256"]) for n, e in theirs["files"].items()}, (step, stage)
            assert all(e["path"].startswith("stagerl/src/") for e in mine["files"].values())
            assert mine["forked_from"] == {"experiment": "stagerl/src", "fingerprint": theirs["fingerprint"],
                                           "written_at": theirs["written_at"]}
    after = files(src, "src")
    assert {k: v for k, v in after.items() if not k.startswith("forks/")} == forked["before"]
    assert set(after) - set(forked["before"]) == {"forks/rloo.json"}
    assert verify_run(store, new).ok
    adv = {r: read_table(store, RunLayout(PROJECT, r), 3, "advantage").column("advantages").to_pylist()
           for r in ("src", "rloo")}
    assert adv["src"] != adv["rloo"]

    ref_root = tmp_path / "runs"
    ref = ref_root / PROJECT / "ref"
    shutil.copytree(src / PROJECT / "src", ref, ignore=shutil.ignore_patterns("forks", "plots", "_lock.json"))
    for m in ref.glob("steps/*/_manifests/*.json"):
        doc = json.loads(m.read_text())
        for entry in doc["files"].values():
            entry["path"] = entry["path"].replace("stagerl/src/", "stagerl/ref/", 1)
        m.write_text(json.dumps(doc))
    for gone in ("steps/000003/_manifests/advantage.json", "steps/000003/_manifests/update.json",
                 "steps/000003/advantage.parquet", "steps/000003/update", "train_state/step_000003",
                 "weights/step_000003"):
        shutil.rmtree(ref / gone) if (ref / gone).is_dir() else (ref / gone).unlink()
    cmd = [sys.executable, str(TESTS / "_fork_reference.py"), str(ref_root), "ref", "3", "advantage", "4",
           json.dumps(overrides(assets, ref_root, 4) + ["algorithm.adv_estimator=rloo"])]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ref_store, ref_layout = Store.from_config({"root": str(ref_root)}), RunLayout(PROJECT, "ref")
    for step, stage in [(3, "advantage")] + [(4, s) for s in ("rollout", "logprob", "reward", "advantage")]:
        mine = read_manifest(store, new, step, stage)["files"]
        theirs = read_manifest(ref_store, ref_layout, step, stage)["files"]
        assert {n: e["sha256"] for n, e in mine.items()} == {n: e["sha256"] for n, e in theirs.items()}, (step, stage)
    assert folder_manifest(store, new.weights(4))["checksum"] == \
        folder_manifest(ref_store, ref_layout.weights(4))["checksum"]


def test_an_override_that_changes_a_reused_stage_is_refused(server, src):
    """Refused before anything starts, naming each key and the stage it would change; nothing is
    written. A fork also needs the train state (and, at rollout or logprob, the weights) of the
    step before, which src may no longer keep."""
    from configs.loader import load_config
    from configs.suggest import make_plan
    from flows.fork import ForkRefused, check_fork, fork_arguments

    hot = stagerl(server, ["fork", "src", "hot", "--at", "3:advantage", "--root", str(src),
                           "actor_rollout_ref.rollout.temperature=1.0"])
    assert hot.returncode == 2, hot.stdout[-3000:]
    assert ("error: fork of stagerl/src at 3:advantage refused: actor_rollout_ref.rollout.temperature "
            "would change rollout of step 3, logprob of step 3, which the fork reuses from src") in hot.stdout
    assert not (src / PROJECT / "hot").exists() and "Prefect" not in hot.stdout
    store = Store.from_config({"root": str(src)})

    def check(at, *items):
        fork = {"source": "src", "at": at}
        config, merged = fork_arguments("tiny-cpu", [f"storage.root={src}", *items], fork)
        cfg = load_config(config, merged + ["trainer.experiment_name=other"])
        return check_fork(store, cfg, make_plan(cfg), fork)

    with pytest.raises(ForkRefused, match=r"actor_rollout_ref.actor.ppo_mini_batch_size would change rollout "
                                          r"of step 3; data.train_batch_size would change rollout of step 3"):
        check("3:logprob", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2")
    with pytest.raises(ForkRefused, match="algorithm.adv_estimator would change advantage of step 3"):
        check("3:update", "algorithm.adv_estimator=rloo")
    # no train state before step 2 is stored (src stored step 3's only, its last): the fork's
    # update of step 2 replays step 1's from the initial weights, so the fork is accepted
    assert check("2:advantage")["reuse"]
    with pytest.raises(ForkRefused, match="weights/step_000002 is no longer kept.*trainer.save_freq"):
        check("3:rollout")  # save_freq=-1: only the latest weights
    assert check("3:reward", f"custom_reward_function.path={REWARDS}", "custom_reward_function.name=parity")["reuse"]
    from flows.train import train
    from prefect.utilities.callables import parameter_schema

    assert "fork" in parameter_schema(train.fn).properties  # a parameter of the rl-train deployment


def test_pruning_or_rewriting_the_source_copies_what_a_fork_references(tmp_path):
    """Copy on demand: when the source prunes a weights folder or writes a stage again, the
    fork first gets its own copy (same checksums) and its manifests point at it; a folder the
    fork no longer references is not copied back."""
    from flows.train import prune_weights
    from storage.lineage import record_fork, reference_folder, reference_stage

    store = Store.from_config({"root": str(tmp_path / "runs")})
    src, new = RunLayout("p", "src"), RunLayout("p", "new")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.bin").write_bytes(b"weights of step 1")
    for k in (1, 2):
        save_folder(store, tmp_path / "w", src.weights(k))
    store.write_json(src.manifest(2, "update"), {"stage": "update"})
    m = write_stage(store, src, 0, "warmstart", {"warmstart/metrics.json": {"loss": 1.0}}, fingerprint="a")
    objects = reference_stage(store, m, new, 0, "warmstart", fingerprint="b", inputs={}, source=src.base)
    objects.update(reference_folder(store, src.weights(1), new.weights(1)))
    objects.update(reference_folder(store, src.weights(2), new.weights(2)))
    record_fork(store, src.base, new, objects, {"source": src.base, "at": "1:rollout"})
    assert store.find(new.base) == sorted([new.manifest(0, "warmstart"), f"{new.weights(1)}/_manifest.json",
                                          f"{new.weights(2)}/_manifest.json"])  # references only
    assert read_file(store, new, 0, "warmstart") == {"loss": 1.0}
    store.delete(new.weights(2), recursive=True)  # the fork pruned its own reference

    assert prune_weights(store, src, 2, {"trainer": {"save_freq": -1, "max_actor_ckpt_to_keep": None}}) == [1]
    assert not store.exists(src.weights(1))
    assert "base" not in folder_manifest(store, new.weights(1))
    assert (load_folder(store, new.weights(1), tmp_path / "cache") / "model.bin").read_bytes() == b"weights of step 1"
    write_stage(store, src, 0, "warmstart", {"warmstart/metrics.json": {"loss": 2.0}}, fingerprint="c")
    assert read_file(store, src, 0, "warmstart") == {"loss": 2.0}
    assert read_file(store, new, 0, "warmstart") == {"loss": 1.0}
    assert read_manifest(store, new, 0, "warmstart")["files"]["warmstart/metrics.json"]["path"] == \
        "p/new/steps/000000/warmstart/metrics.json"
    save_folder(store, tmp_path / "w", src.weights(2))  # written again: nothing references it now
    assert not store.exists(new.weights(2)) and not store.list(src.forks_dir)  # record emptied
    assert verify_run(store, new).ok


def test_rescore_counts_the_rows_whose_score_changed(src, capsys):
    """src's steps 1-2 scored with `parity` instead of the reward they trained with: the changed
    rows counted here from the stored parquet files themselves."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fork_rewards", REWARDS)
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    changed = raised = 0
    for step in (1, 2):
        folder = src / PROJECT / "src" / "steps" / f"{step:06d}"
        responses = pq.read_table(folder / "rollout.parquet").column("response").to_pylist()
        old = pq.read_table(folder / "reward.parquet").column("score").to_pylist()
        new = [rewards.parity("stagerl/arith", r, None) for r in responses]
        changed += sum(abs(a - b) > 1e-9 for a, b in zip(old, new))
        raised += sum(b > a + 1e-9 for a, b in zip(old, new))
    assert 0 < changed < 16
    code, out, _ = cli(capsys, "rescore", "src", "--steps", "1..2", "--reward", f"{REWARDS}:parity",
                       "--root", src, "--json")
    assert code == 0
    result = json.loads(out)
    assert result["all"]["rows"] == 16 and result["all"]["changed"] == changed
    assert result["all"]["raised"] == raised and result["by_source"]["stagerl/arith"]["changed"] == changed
    assert all(r["kind"] == "raised" and r["new"] > r["old"] for r in result["examples"]["raised"])
    code, out, _ = cli(capsys, "rescore", "src", "--steps", "1..2", "--reward", f"{REWARDS}:parity", "--root", src)
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("(all)"))
    assert line.split()[1:2] == ["16"] and line.split()[4] == str(changed), out
    assert "raised    step" in out and "unchanged step" in out
    code, _, err = cli(capsys, "rescore", "src", "--steps", "3..1", "--reward", str(REWARDS), "--root", src)
    assert code == 2 and "need 1 <= A <= B" in err


def test_rescore_with_a_failing_reward_ends_bounded_and_non_zero(src, tmp_path, capsys):
    """The reliability probe's rescore findings: a reward function that hangs, raises, returns NaN
    or a string used to run for minutes or exit 0 with every row errored. Now: progress on stderr,
    --timeout per row, and exit 1 naming the error kinds and counts."""
    import time

    bad = tmp_path / "bad_rewards.py"
    bad.write_text("import time\n"
                   "def hang(data_source, solution_str, ground_truth, extra_info=None):\n    time.sleep(60)\n"
                   "def boom(data_source, solution_str, ground_truth, extra_info=None):\n    raise ValueError('no')\n"
                   "def nan(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n"
                   "def text(data_source, solution_str, ground_truth, extra_info=None):\n    return 'x'\n")
    for fn, kind in (("boom", "raised 8"), ("nan", "bad return value 8"), ("text", "bad return value 8")):
        code, out, err = cli(capsys, "rescore", "src", "--steps", "1..1", "--reward", f"{bad}:{fn}", "--root", src)
        assert code == 1, (fn, err)
        assert f"8 of the 8 rows scored so far errored ({kind})" in err and "rescore: step 1, 8/8 rows" in err
    t0 = time.monotonic()
    code, out, err = cli(capsys, "rescore", "src", "--steps", "1..2", "--reward", f"{bad}:hang", "--root", src,
                         "--timeout", "0.5")
    assert code == 1 and "errored (timeout 8)" in err, err
    assert time.monotonic() - t0 < 60  # 8 rows, 2 workers, 0.5 s each: bounded, not 60 s a row


def test_query_plot_and_runs_over_branches(src, forked, capsys):
    """One SQL statement over src and its fork (the experiment column), the curves of both in one
    PNG, and the lineage in `stagerl runs`."""
    sql = "SELECT experiment, step, avg(score) AS m, count(*) AS n FROM reward GROUP BY ALL ORDER BY ALL"
    code, out, _ = cli(capsys, "query", sql, "--experiment", "src", "--experiment", "rloo", "--root", src, "--json")
    assert code == 0
    means = {(r["experiment"], r["step"]): r["m"] for r in json.loads(out)}
    assert set(means) == {("src", 1), ("src", 2), ("src", 3), ("rloo", 1), ("rloo", 2), ("rloo", 3), ("rloo", 4)}
    assert all(means[("src", s)] == means[("rloo", s)] for s in (1, 2, 3))  # the same rows
    sql = ("SELECT step, count(*) AS differ FROM advantage a JOIN advantage b USING (step, row) "
           "WHERE a.experiment = 'src' AND b.experiment = 'rloo' AND a.advantages <> b.advantages "
           "GROUP BY step ORDER BY step")
    code, out, _ = cli(capsys, "query", sql, "--experiment", "src", "--experiment", "rloo", "--root", src, "--json")
    assert code == 0 and [r["step"] for r in json.loads(out)] == [3]  # steps 1-2 are src's own

    code, out, _ = cli(capsys, "plot", "src", "rloo", "--root", src, "--json")
    assert code == 0
    [written] = json.loads(out)
    assert written["name"] == "branches_src_rloo.png"
    assert (src / PROJECT / "src" / "plots" / "branches_src_rloo.png").read_bytes()[:4] == b"\x89PNG"
    assert all(a["lines"] == ["src", "rloo"] and a["xlabel"] == "step" and a["ylabel"] for a in written["axes"])

    code, out, _ = cli(capsys, "runs", "--root", src, "--json")
    rows = {r["experiment"]: r for r in json.loads(out)}
    assert rows["rloo"]["forked_from"]["source"] == "stagerl/src" and rows["rloo"]["forked_from"]["at"] == "3:advantage"
    assert rows["src"]["forks"] == 1 and rows["src"]["forked_from"] is None and rows["rloo"]["steps_done"] == 4
    code, out, _ = cli(capsys, "runs", "--root", src)
    assert "src @ 3:advantage (algorithm.adv_estimator=rloo trainer.total_training_steps=4)" in out


def test_deleting_the_source_is_refused_until_the_fork_is_detached(src, forked, tmp_path, capsys):
    """`stagerl delete src` is refused while rloo references its objects; --detach-forks copies
    them into rloo first, which then verifies and reads the same without src."""
    root = tmp_path / "runs"
    shutil.copytree(src, root)
    code, out, _ = cli(capsys, "delete", "src", "--root", root)
    assert code == 1 and "forks reference its objects: rloo (" in out and "--detach-forks" in out
    assert (root / PROJECT / "src").exists()
    sql = "SELECT step, avg(score) AS m FROM reward GROUP BY step ORDER BY step"
    _, before, _ = cli(capsys, "query", sql, "--experiment", "rloo", "--root", root, "--json")
    code, out, _ = cli(capsys, "delete", "src", "--root", root, "--detach-forks")
    assert code == 0 and "object(s) copied into 1 fork(s) first" in out, out
    assert not (root / PROJECT / "src").exists()
    store = Store.from_config({"root": str(root)})
    assert verify_run(store, RunLayout(PROJECT, "rloo")).ok
    assert all(e["path"].startswith("stagerl/rloo/") for m in (root / PROJECT / "rloo").glob("steps/*/_manifests/*.json")
               for e in json.loads(m.read_text())["files"].values())
    _, after, _ = cli(capsys, "query", sql, "--experiment", "rloo", "--root", root, "--json")
    assert json.loads(after) == json.loads(before) and len(json.loads(after)) == 4
    code, out, _ = cli(capsys, "delete", "rloo", "--root", root)  # a fork: its records go with it
    assert code == 0 and not (root / PROJECT / "rloo").exists()


def test_rescore_as_a_fork_on_s3(server, assets, tmp_path, monkeypatch):
    """On a moto S3 store: a 2-step run, then `stagerl rescore s2 --steps 2..2 --reward
    parity --as s2p`, a fork at 2:reward that trains with the new reward: it writes no object for
    steps 1 and step 2's rollout and logprob, and step 2's stored scores are parity's."""
    with MotoServer() as s3:
        s3.make_bucket("runs")
        creds = {**S3_CREDS, "AWS_ENDPOINT_URL": s3.endpoint_url}
        for k, v in creds.items():
            monkeypatch.setenv(k, v)
        root = "s3://runs/fork"
        args = ["train", "--config", "tiny-cpu", "--experiment", "s2", *overrides(assets, root, 2),
                f"storage.cache_dir={tmp_path}/cache"]
        run = stagerl(server, args, **creds)
        assert run.returncode == 0, run.stdout[-4000:]
        fork = stagerl(server, ["rescore", "s2", "--steps", "2..2", "--reward", f"{REWARDS}:parity",
                                "--as", "s2p", "--root", root], **creds)
        assert fork.returncode == 0, fork.stdout[-4000:]
        assert "(all)" in fork.stdout and "fork stagerl/s2p of stagerl/s2 at 2:reward" in fork.stdout
        store, new = Store.from_config({"root": root}), RunLayout(PROJECT, "s2p")
        objects = [k[len(new.base) + 1:] for k in store.find(new.base)]
        assert not [k for k in objects if k.startswith("steps/000001/") and "/_manifests/" not in k]
        assert not [k for k in objects if k.split("/")[-1] in ("rollout.parquet", "logprob.parquet")]
        responses = read_table(store, new, 2, "rollout").column("response").to_pylist()
        assert read_table(store, new, 2, "reward").column("score").to_pylist() == \
            [float(sum(map(ord, r)) % 2) for r in responses]
        assert read_manifest(store, new, 2, "rollout")["files"]["rollout.parquet"]["path"].startswith("stagerl/s2/")
        assert verify_run(store, new).ok
