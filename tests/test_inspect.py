"""inspect / show / query / export / plot / stats on a run written through storage
(tests/_inspect_run.py), numbers checked against the parquet files themselves; one store on S3."""
import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from flows.cli import main
from storage.store import Store
from tests._inspect_run import MAX_RESPONSE, build_run, run_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from stages.model.models import load_tokenizer
    from stages.model.tiny import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    return path, load_tokenizer(path)


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("store") / "runs"
    cfg = run_config(root, tiny[0])
    store = Store.from_config({"root": str(root)})
    build_run(store, cfg, tiny[1])
    return root


def cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def step_file(root, step, name):
    return pq.read_table(root / "stagerl" / "demo" / "steps" / f"{step:06d}" / name)


def flat(table, column):
    return [v for row in table.column(column).to_pylist() for v in row]


def test_inspect_step_numbers_match_parquet(run, capsys):
    code, out, _ = cli(capsys, "inspect", "demo", "--root", str(run), "--step", "1", "--json")
    assert code == 0
    s = json.loads(out)
    assert s["status"] == "complete"
    reward, rollout = step_file(run, 1, "reward.parquet"), step_file(run, 1, "rollout.parquet")
    logprob, mbs = step_file(run, 1, "logprob.parquet"), step_file(run, 1, "update/microbatches.parquet")
    scores = reward.column("score").to_pylist()
    st = s["stages"]
    assert st["reward"]["rows"] == 6 and st["reward"]["status"] == "complete"
    assert st["reward"]["score"] == {"mean": pytest.approx(sum(scores) / 6), "min": 0.0, "max": 1.0}
    assert st["reward"]["acc_mean"] == pytest.approx(0.5)
    lengths = rollout.column("response_length").to_pylist()
    assert st["rollout"]["response_length"]["mean"] == pytest.approx(sum(lengths) / 6)
    assert st["rollout"]["response_length"]["max"] == max(lengths)
    assert st["rollout"]["response_length"]["clip_ratio"] == pytest.approx(
        sum(n == MAX_RESPONSE for n in lengths) / 6)
    assert st["rollout"]["timings"]["generate_s"] == 1.5
    assert s["time_s"]["generate"] == 1.5 and s["time_s"]["update_train"] is None  # not recorded here
    ent = flat(logprob, "entropy")
    assert st["logprob"]["metrics"]["entropy/token_mean"] == pytest.approx(sum(ent) / len(ent))
    assert st["logprob"]["metrics"]["kl_old_ref_k1/token_mean"] == pytest.approx(0.05, abs=1e-6)
    assert st["logprob"]["loads"] == {"loads": {"actor": [{"rank": 0, "rows": 3}, {"rank": 1, "rows": 3}]}}
    assert st["update"]["loads"] == {"actor/rank_0": {"rows": 3}, "actor/rank_1": {"rows": 3}}
    assert not any(k.startswith("update/micro_batch_loads") for k in st["update"]["metrics"])
    up = st["update"]
    assert up["rows"] == 6 and up["timings"]["update_s"] == 4.0
    assert up["metrics"]["actor/pg_loss"] == pytest.approx(0.1)
    assert up["metrics"]["actor/grad_norm"] == pytest.approx(1.5)  # list averaged
    assert up["losses"] == {"actor/pg_loss": pytest.approx(0.1), "actor/kl_loss": pytest.approx(0.02)}
    actor0 = [m for m in mbs.to_pylist() if m["role"] == "actor" and m["epoch"] == 0]
    real = {r: sum(m["real_tokens"] for m in actor0 if m["rank"] == r) for r in (0, 1)}
    ranks = up["balance"]["ranks"]
    assert [(r["rank"], r["rows"], r["micro_batches"], r["real_tokens"]) for r in ranks] == \
        [(0, 3, 2, real[0]), (1, 3, 1, real[1])]
    assert up["balance"]["tokens_max_over_mean"] == pytest.approx(max(real.values()) / (sum(real.values()) / 2))
    assert st["advantage"]["data_metrics"]["critic/score/mean"] == pytest.approx(0.5)
    # best: score 1 with the highest advantage (uid p0 sample 0: 1 - 1/3); worst: score 0, lowest adv
    best, worst = s["samples"]["best"][0], s["samples"]["worst"][0]
    assert (best["uid"], best["sample_index"], best["score"]) == ("p0", 0, 1.0)
    assert best["advantage"] == pytest.approx(2 / 3)
    assert (worst["uid"], worst["sample_index"], worst["advantage"]) == ("p1", 2, pytest.approx(-2 / 3))
    assert best["response"] == rollout.column("response").to_pylist()[0]


def test_time_split_by_hand():
    from flows.step_report import time_split

    metrics = {"timing_s/rollout": 0.50, "timing/generate_s": 0.45, "timing_s/logprob": 0.01,
               "timing_s/reward": 0.03, "timing_s/advantage": 0.02, "timing_s/update": 0.70,
               "timing/update_compute_s": 0.66, "timing_s/step": 1.30}
    assert time_split(metrics) == pytest.approx({
        "generate": 0.45, "update_train": 0.66, "rollout_other": 0.05, "logprob": 0.01, "reward": 0.03,
        "advantage": 0.02, "update_other": 0.04, "orchestration": 0.04, "outside_generate_and_train": 0.19,
        "step": 1.30})
    # logprob and reward side by side: their seconds overlap, the orchestration part goes negative
    assert time_split({**metrics, "timing_s/step": 1.25})["orchestration"] == pytest.approx(-0.01)
    assert time_split({"timing/generate_s": 0.45})["rollout_other"] is None


def test_inspect_text_and_overview(run, capsys):
    code, out, _ = cli(capsys, "inspect", "demo", "--root", str(run))
    assert code == 0
    assert "3 step(s), 2 complete" in out
    assert "step 3: no manifest yet for logprob, reward, advantage, update" in out
    code, out, _ = cli(capsys, "inspect", "demo", "--root", str(run), "--step", "2")
    assert code == 0 and "rank 1: 3 rows, 1 micro-batches" in out and "best " in out
    assert "    load actor rank 1: rank=1  rows=3" in out and "{'" not in out  # no raw dicts
    code, out, _ = cli(capsys, "inspect", "demo", "--root", str(run), "--step", "3",
                       "--stage", "rollout", "--json")
    assert code == 0 and list(json.loads(out)["stages"]) == ["rollout"]


def test_missing_experiment_and_incomplete_step_exit_2(run, capsys):
    code, _, err = cli(capsys, "inspect", "nope", "--root", str(run))
    assert code == 2
    assert "experiment 'nope' does not exist in project 'stagerl'" in err and "demo" in err
    code, _, err = cli(capsys, "inspect", "demo", "--root", str(run), "--step", "3")
    assert code == 2
    assert "step 3 of stagerl/demo is not complete: no manifest yet for logprob, reward" in err
    code, _, err = cli(capsys, "inspect", "demo", "--root", str(run), "--step", "9")
    assert code == 2 and "step 9 of stagerl/demo does not exist (steps present: 1-3)" in err
    code, _, err = cli(capsys, "show", "demo", "--root", str(run), "--step", "1", "--uid", "zz")
    assert code == 2 and "no uid 'zz'" in err and "p0, p1" in err
    code, _, err = cli(capsys, "query", "SELECT 1", "--experiment", "nope", "--root", str(run))
    assert code == 2 and "does not exist" in err
    escapes = {f"COPY (SELECT 1) TO '{run}/x.csv'": "COPY refused",  # the reliability probe's four
               "SELECT * FROM read_text('/etc/hostname')": 'Cannot access file "/etc/hostname"',
               "SELECT * FROM glob('/etc/*')": 'Cannot access file "/etc/*"',
               f"ATTACH '{run}/x.db' AS x": "ATTACH refused",
               "CREATE TABLE t AS SELECT 1": "CREATE refused",
               "SELECT count(*) FROM read_parquet('/etc/*.parquet')": "file system operations are disabled",
               "SET enable_external_access = true": "SET refused"}
    for sql, needle in escapes.items():
        code, out, err = cli(capsys, "query", sql, "--experiment", "demo", "--root", str(run))
        assert code == 2 and needle in err, (sql, err)
    assert not (run / "x.csv").exists() and not (run / "x.db").exists()
    code, _, err = cli(capsys, "export", "demo", "--root", str(run), "--step", "3", "--out", "-")
    assert code == 2 and "no manifest yet for reward" in err


def test_query_mean_reward_by_step_equals_inspect(run, capsys):
    code, out, _ = cli(capsys, "query", "SELECT step, avg(score) AS mean_score FROM reward "
                                        "GROUP BY step ORDER BY step", "--experiment", "demo",
                       "--root", str(run), "--json")
    assert code == 0
    by_sql = {r["step"]: r["mean_score"] for r in json.loads(out)}
    _, out, _ = cli(capsys, "inspect", "demo", "--root", str(run), "--json")
    by_inspect = {r["step"]: r["score/mean"] for r in json.loads(out)["steps"] if "score/mean" in r}
    assert by_sql == pytest.approx(by_inspect) and set(by_sql) == {1, 2}
    assert by_sql[2] == pytest.approx(5 / 6)
    # joins on (step, row); only committed stages: step 3 has a rollout but no reward
    code, out, _ = cli(capsys, "query", "SELECT (SELECT count(*) FROM rollout) AS r, count(*) AS j "
                                        "FROM rollout JOIN reward USING (step, row)",
                       "--experiment", "demo", "--root", str(run), "--json")
    assert json.loads(out) == [{"r": 18, "j": 12}]
    code, out, _ = cli(capsys, "query", "SELECT step, sum(real_tokens) AS t FROM microbatches "
                                        "WHERE rank = 1 AND role = 'actor' AND epoch = 0 "
                                        "GROUP BY step ORDER BY step",
                       "--experiment", "demo", "--root", str(run))
    assert code == 0 and "(2 rows)" in out
    code, out, _ = cli(capsys, "query", "SELECT value FROM metrics WHERE name='actor/pg_loss' "
                                        "AND step=2", "--experiment", "demo", "--root", str(run),
                       "--json")
    assert json.loads(out)[0]["value"] == pytest.approx(0.2)
    code, _, err = cli(capsys, "query", "SELECT nope FROM reward", "--experiment", "demo",
                       "--root", str(run))
    assert code == 2 and "query failed" in err and "nope" in err


def test_show_joins_one_sample_across_stages(run, tiny, capsys):
    code, out, _ = cli(capsys, "show", "demo", "--root", str(run), "--step", "1", "--uid", "p1",
                       "--sample", "1", "--json")
    assert code == 0
    s = json.loads(out)
    row = 4
    assert s["row"] == row and all(v == "complete" for v in s["status"].values())
    rollout, logprob = step_file(run, 1, "rollout.parquet"), step_file(run, 1, "logprob.parquet")
    ids = rollout.column("response_ids").to_pylist()[row]
    assert [t["token_id"] for t in s["tokens"]] == ids
    assert [t["token"] for t in s["tokens"]] == [tiny[1].decode([i]) for i in ids]
    assert [t["old_log_prob"] for t in s["tokens"]] == pytest.approx(
        logprob.column("old_log_probs").to_pylist()[row])
    assert [t["ref_log_prob"] for t in s["tokens"]] == pytest.approx(
        logprob.column("ref_log_probs").to_pylist()[row])
    assert all(t["advantage"] == pytest.approx(1 - 2 / 3) for t in s["tokens"])
    assert s["reward"]["score"] == 1.0
    assert [(u["role"], u["epoch"], u["rank"], u["micro_batch"]) for u in s["update"]] == [
        ("actor", 0, 1, 0), ("actor", 1, 1, 0), ("critic", 0, 1, 0)]
    code, out, _ = cli(capsys, "show", "demo", "--root", str(run), "--step", "1", "--uid", "p1",
                       "--sample", "1", "--ids")
    assert code == 0 and "old_log_prob" in out and "token_id" in out and "advantage" in out


def test_export_writes_verl_rollout_dump(run, tmp_path, capsys):
    out_dir = tmp_path / "dump"
    code, _, err = cli(capsys, "export", "demo", "--root", str(run), "--format", "jsonl",
                       "--out", str(out_dir))
    assert code == 0 and "skipped incomplete steps: 3" in err
    assert sorted(p.name for p in out_dir.iterdir()) == ["1.jsonl", "2.jsonl"]
    lines = [json.loads(x) for x in (out_dir / "2.jsonl").read_text().splitlines()]
    rollout, reward = step_file(run, 2, "rollout.parquet"), step_file(run, 2, "reward.parquet")
    assert [x["input"] for x in lines] == rollout.column("prompt").to_pylist()
    assert [x["output"] for x in lines] == rollout.column("response").to_pylist()
    assert [x["score"] for x in lines] == reward.column("score").to_pylist()
    assert [x["gts"] for x in lines] == rollout.column("ground_truth").to_pylist()
    assert {x["step"] for x in lines} == {2} and lines[0]["acc"] == 1.0


def test_plot_writes_pngs_with_labelled_axes(run, capsys):
    import matplotlib.image as mpimg

    code, out, _ = cli(capsys, "plot", "demo", "--root", str(run), "--json")
    assert code == 0  # by default: the overview and the last step with a rollout
    assert {w["name"] for w in json.loads(out)} == {"metrics.png", "response_length_step000003.png"}
    code, out, _ = cli(capsys, "plot", "demo", "--root", str(run), "--json", "--all")
    assert code == 0
    written = {w["name"]: w for w in json.loads(out)}
    assert set(written) == {"metrics.png", "response_length_step000001.png",
                            "response_length_step000002.png", "response_length_step000003.png",
                            "rank_load_step000001.png", "rank_load_step000002.png",
                            "microbatch_tokens_step000001.png", "microbatch_tokens_step000002.png"}
    for name, w in written.items():
        path = run / "stagerl" / "demo" / "plots" / name
        image = mpimg.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, name
        assert w["axes"] and all(a["xlabel"] and a["ylabel"] for a in w["axes"]), name
    ylabels = [a["ylabel"] for a in written["metrics.png"]["axes"]]
    assert ylabels == ["reward (score mean)", "acc (mean)", "KL(old || ref), k1 token mean",
                       "entropy (token mean)", "response length (tokens)"]
    mb = written["microbatch_tokens_step000001.png"]["axes"][0]
    assert (mb["xlabel"], mb["ylabel"]) == ("micro-batch (rank.index)", "tokens")


def test_plot_labels_refused_when_missing(run):
    from flows.read.plots import _pyplot, save
    from storage.run_view import RunView

    view = RunView.open(Store.from_config({"root": str(run)}), "stagerl", "demo")
    fig, ax = _pyplot().subplots()
    ax.plot([1, 2])
    with pytest.raises(ValueError, match="no x or y label"):
        save(view, fig, "bad.png")


def test_stats_lengths_and_recommendations(run, tiny, tmp_path, capsys):
    from stages.data.tools import write_arith_dataset

    data = write_arith_dataset(tmp_path / "arith.parquet", n=40, seed=3)
    code, out, _ = cli(capsys, "stats", str(data), f"actor_rollout_ref.model.path={tiny[0]}",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                       "--run", "demo", "--root", str(run), "--json")
    assert code == 0
    r = json.loads(out)
    rows = pq.read_table(data).to_pylist()
    texts = [tiny[1].apply_chat_template(x["prompt"], add_generation_prompt=True, tokenize=False)
             for x in rows]
    plen = np.array([len(tiny[1](t, add_special_tokens=False)["input_ids"]) for t in texts])
    assert r["prompt"]["count"] == 40 and r["prompt"]["max"] == plen.max()
    assert r["prompt"]["p95"] == int(np.percentile(plen, 95, method="higher"))
    resp = [n for s in (1, 2, 3) for n in step_file(run, s, "rollout.parquet")
            .column("response_length").to_pylist()]
    assert r["response"]["count"] == 18 and r["response"]["max"] == max(resp)
    assert r["run"]["clip_ratio"] == pytest.approx(sum(n >= MAX_RESPONSE for n in resp) / 18)
    rec = r["recommend"]
    assert rec["data.max_prompt_length"]["value"] == math.ceil(plen.max() / 64) * 64
    clipped = r["run"]["clip_ratio"] > 0.05
    assert rec["data.max_response_length"]["value"] == (2 * MAX_RESPONSE if clipped else 64)
    typical = r["prompt"]["p50"] + r["response"]["p50"]
    longest = rec["data.max_prompt_length"]["value"] + rec["data.max_response_length"]["value"]
    assert rec["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]["value"] == max(
        math.ceil(8 * typical / 64) * 64, math.ceil(longest / 64) * 64)
    assert "N=8 rows" in rec["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]["why"]
    code, out, _ = cli(capsys, "stats", str(data), f"actor_rollout_ref.model.path={tiny[0]}")
    assert code == 0 and "p95=" in out and "data.max_prompt_length=" in out


def test_format_step_line_and_progress(capfd, monkeypatch):
    from stages.progress import format_step_line, progress

    line = format_step_line(3, {"critic/score/mean": 0.5, "actor/pg_loss": np.float32(0.25),
                                "response_length/max": 7, "note": "text"})
    assert line == "step:3 - critic/score/mean:0.5 - actor/pg_loss:0.25 - response_length/max:7"
    monkeypatch.setenv("STAGERL_PROGRESS", "1")
    with progress("generate", total=4, unit="seq") as bar:
        bar.update(4)
    assert "generate" in capfd.readouterr().err
    monkeypatch.setenv("STAGERL_PROGRESS", "0")
    with progress("update", total=2) as bar:
        bar.update(2)
    assert capfd.readouterr().err == ""


def test_commands_on_s3_store(tiny, run, tmp_path, capsys, monkeypatch):
    from storage.weights import save_weights
    from tests._s3_server import MotoServer

    with MotoServer() as srv:
        srv.make_bucket("rl-runs")
        for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                     ("AWS_ENDPOINT_URL", srv.endpoint_url)):
            monkeypatch.setenv(k, v)
        root = "s3://rl-runs/runs"
        store = Store.from_config({"root": root})
        # the model path is not readable here: show must take the tokenizer from weights/step_1
        layout = build_run(store, run_config(root, tmp_path / "gone"), tiny[1])
        save_weights(store, layout, 1, tiny[0])
        code, out, _ = cli(capsys, "inspect", "demo", "--root", root, "--step", "2", "--json")
        assert code == 0
        assert json.loads(out)["stages"]["reward"]["score"]["mean"] == pytest.approx(5 / 6)
        code, out, _ = cli(capsys, "query", "SELECT step, avg(score) AS m FROM reward GROUP BY "
                                            "step ORDER BY step", "--experiment", "demo",
                           "--root", root, "--json")
        assert [r["m"] for r in json.loads(out)] == pytest.approx([0.5, 5 / 6])
        code, out, _ = cli(capsys, "show", "demo", "--root", root, "--step", "2", "--uid", "p0",
                           "--json")
        ids = json.loads(out)["tokens"]
        assert code == 0 and [t["token"] for t in ids] == [tiny[1].decode([t["token_id"]]) for t in ids]
        code, out, _ = cli(capsys, "plot", "demo", "--root", root, "--step", "2")
        assert code == 0
        assert store.exists("stagerl/demo/plots/microbatch_tokens_step000002.png")
        assert store.read_bytes("stagerl/demo/plots/metrics.png")[:8] == b"\x89PNG\r\n\x1a\n"
        code, _, err = cli(capsys, "inspect", "other", "--root", root)
        assert code == 2 and "does not exist" in err


def test_logprob_section_before_the_update_stored_old_log_probs(tmp_path):
    """On-policy with a KL loss the logprob stage stores only reference log-probs; the old ones come
    with the update (update/log_probs.parquet). Until then inspect shows no old-vs-ref KL, and
    does not fail."""
    from flows.read.inspect_lib import logprob_metrics
    from storage.artifacts import write_table
    from storage.layout import RunLayout
    from storage.run_view import RunView
    from storage.schemas import make_table

    store, layout = Store.from_config({"root": str(tmp_path)}), RunLayout("p", "e")
    write_table(store, layout, 1, "logprob", make_table("logprob", {"ref_log_probs": [[-1.0, -2.0]]}), fingerprint="l")
    metrics = logprob_metrics(RunView(store, layout), 1)["metrics"]
    assert metrics["old_log_prob/token_mean"] is None and "kl_old_ref_k1/token_mean" not in metrics


EXIT_PROBE = """
import atexit, ctypes, sys
libc = ctypes.CDLL(None)
libc.on_exit(ctypes.cast(libc.abort, ctypes.c_void_p), None)  # a C-level exit handler that aborts,
atexit.register(lambda: print("python atexit ran", flush=True))  # as a native pool's teardown can
from flows.cli import entry, main
root, how = sys.argv[1:]
sys.argv = ["stagerl", "inspect", "demo", "--root", root]
entry() if how == "entry" else sys.exit(main(sys.argv[1:]))
"""


def test_the_stagerl_command_exits_before_the_native_teardown(run, tmp_path):
    """A finished command exits with its own code even when C-level teardown would abort (Arrow's
    parquet thread pools did, intermittently: exit 134 after `stagerl inspect` printed its table):
    flows.cli.entry joins Python threads, runs atexit handlers, flushes, and skips the C exit."""
    import importlib.metadata
    import subprocess
    import sys

    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["stagerl"] == "flows.cli:entry"
    probe = tmp_path / "probe.py"
    probe.write_text(EXIT_PROBE)
    done = subprocess.run([sys.executable, str(probe), str(run), "entry"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "complete" in done.stdout and done.stdout.rstrip().endswith("python atexit ran"), done.stdout
    plain = subprocess.run([sys.executable, str(probe), str(run), "plain"], capture_output=True, text=True, timeout=120)
    assert plain.returncode == -6 and "complete" in plain.stdout   # the probe bites a plain sys.exit
