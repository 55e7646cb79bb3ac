"""trainer.logger sinks: what console, tensorboard and wandb (offline) got, read back from their files."""
import pytest

from _sink_logs import tensorboard_scalars, wandb_run
from configs.loader import load_config
from configs.schema import ConfigError
from flows.metric_sinks import MetricSinks, check_sinks
from storage import sinks

STEPS = {1: {"actor/pg_loss": 0.25, "critic/vf_loss": 1.5, "score/mean": 3, "flag": True, "note": "x"},
         2: {"actor/pg_loss": -0.125, "critic/vf_loss": 0.75, "score/mean": 4}}


def test_every_sink_gets_each_steps_numbers(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # tensorboard_log/ and wandb/ land in the working directory
    for name in ("TENSORBOARD_DIR", "WANDB_DIR", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    secret = "s3cr3t-Value-9f8e"
    monkeypatch.setattr("sys.argv", ["stagerl", "train", f"storage.secret={secret}"])  # wandb's metadata has argv
    cfg = load_config("tiny-cpu", ["trainer.logger=[console,tensorboard,wandb]", "trainer.experiment_name=sinks",
                                   f"storage.secret={secret}"])
    sinks = MetricSinks(cfg, [secret])
    for step, metrics in STEPS.items():
        sinks.log(step, metrics)
    sinks.close()
    out = capsys.readouterr().out
    assert "step:1 - " in out and "actor/pg_loss:0.250" in out and "step:2 - " in out
    scalars = tensorboard_scalars(tmp_path / "tensorboard_log" / "stagerl" / "sinks")
    assert scalars == {k: {s: pytest.approx(float(m[k])) for s, m in STEPS.items() if k in m}
                       for k in ("actor/pg_loss", "critic/vf_loss", "score/mean")}  # numbers only
    run = wandb_run(tmp_path / "wandb")
    assert run["project"] == "stagerl" and run["name"] == "sinks"
    assert {s: {k: v for k, v in row.items() if not k.startswith("_")} for s, row in run["history"].items()} == {
        s: {k: v for k, v in m.items() if k not in ("flag", "note")} for s, m in STEPS.items()}
    assert run["config"]["data"]["train_batch_size"] == cfg["data"]["train_batch_size"]
    assert run["config"]["storage"]["secret"] == "***" and secret.encode() not in run["file"].read_bytes()
    assert f"wandb: offline run in {run['file'].parent}; upload it with `wandb sync {run['file'].parent}`" in out


def test_a_sink_that_is_unknown_or_not_installed_is_refused(monkeypatch):
    cfg = load_config("tiny-cpu", ["trainer.logger=[console,wandb]"])
    check_sinks(cfg)  # installed
    monkeypatch.setattr(sinks.WandbSink, "package", "wandb_not_installed_here")
    with pytest.raises(ConfigError, match=r"trainer.logger has wandb but the wandb_not_installed_here package "
                                          r"is not installed: `pip install wandb_not_installed_here`"):
        MetricSinks(cfg)
    cfg["trainer"]["logger"] = ["console", "mlflow"]
    with pytest.raises(ConfigError, match=r"trainer.logger: 'mlflow' is not one of \['console', 'tensorboard', 'wandb'\]"):
        check_sinks(cfg)
    with pytest.raises(ConfigError, match="trainer.logger: 'mlflow' is not one of"):
        load_config("tiny-cpu", ["trainer.logger=[console,mlflow]"])


def test_the_console_line_is_short_and_the_full_set_is_logged_at_debug(capsys, caplog):
    """The console sink prints CONSOLE_KEYS only (score, reward, response length, the KL terms
    the run has, losses, grad norm, step seconds; validation scores always); MetricSinks logs the
    whole set at debug level; a set without any of those keys is printed whole."""
    import logging

    from storage.sinks import log_line, short_line

    full = {"actor/lr": 1e-6, "actor/entropy": 0.61, "actor/pg_loss": -0.0123, "actor/kl_loss": 0.0004,
            "actor/grad_norm": 1.5, "actor/ppo_kl": 0.001, "critic/score/mean": 0.5, "critic/score/max": 1.0,
            "critic/rewards/mean": 0.5, "response_length/mean": 12.25, "response_length/max": 16,
            "prompt_length/mean": 30.0, "timing_s/rollout": 1.2, "timing_s/step": 3.456,
            "val/test_score/arith": 0.75}
    sinks = MetricSinks(load_config("tiny-cpu", ["trainer.logger=[console]"]))
    with caplog.at_level(logging.DEBUG, logger="stagerl"):
        sinks.log(3, full)
        sinks.log(4, {"loss": 2.0})
    sinks.close()
    assert capsys.readouterr().out.splitlines() == [
        "step:3 - critic/score/mean:0.500 - critic/rewards/mean:0.500 - response_length/mean:12.250 - "
        "actor/kl_loss:4.000e-04 - actor/pg_loss:-0.012 - actor/grad_norm:1.500 - timing_s/step:3.456 - "
        "val/test_score/arith:0.750",
        "step:4 - loss:2.000"]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG] == [
        log_line(3, full), log_line(4, {"loss": 2.0})]
    assert short_line(5, {"critic/vf_loss": 0.25, "actor/reward_kl_penalty": 0.01}) == \
        "step:5 - actor/reward_kl_penalty:0.010 - critic/vf_loss:0.250"


def test_a_steps_metrics_keep_the_update_committed_while_they_are_read(tmp_path, monkeypatch):
    """The update commits in the background: its manifest and metrics.json may land between
    step_metrics' reads. The update's numbers reach the step's metrics either way: from the
    task's summary before the commit, from the store after, and when the commit lands after
    metrics.json was found missing but before the summaries are read (a CI run once printed a
    console line without actor/pg_loss that way)."""
    from types import SimpleNamespace

    from flows import step_report
    from storage.artifacts import write_stage
    from storage.layout import RunLayout
    from storage.store import Store

    store, layout = Store.from_config({"root": str(tmp_path)}), RunLayout("p", "e")
    ctx = SimpleNamespace(store=store, layout=layout, step=1)
    summary = {"update": {"seconds": 1.5, "metrics": {"actor/pg_loss": 0.25, "actor/grad_norm": 2.0}}}

    def commit():
        write_stage(store, layout, 1, "update", {"update/metrics.json": {"actor/pg_loss": 0.25, "actor/grad_norm": 2.0,
                                                                         "timing/upload_s": 0.5},
                                               "update/microbatches.parquet": b""},
                    fingerprint="f", extra={"metrics": {"actor/pg_loss": 0.25}})

    before = step_report.step_metrics(ctx, summary)  # not committed yet: the summary's numbers
    assert before == {"actor/pg_loss": 0.25, "actor/grad_norm": 2.0, "timing_s/update": 1.5}
    read_file = step_report.read_file

    def read_then_commit(*args):  # metrics.json is not there yet; the commit lands right after
        try:
            return read_file(*args)
        finally:
            commit()
    monkeypatch.setattr(step_report, "read_file", read_then_commit)
    assert step_report.step_metrics(ctx, summary) == before  # the summary's numbers still
    monkeypatch.setattr(step_report, "read_file", read_file)
    assert step_report.step_metrics(ctx, summary) == {**before, "timing/upload_s": 0.5}  # committed: the store's


def test_a_committed_stage_summary_gives_its_metrics_without_a_manifest_read(tmp_path):
    """A stage task's summary of a committed manifest (flows.step.summarize) carries that
    manifest's metrics: step_metrics takes them from it on the step's critical path; a stage
    without one (or still committing) is read from the store."""
    from types import SimpleNamespace

    from flows import step_report
    from flows.step import summarize
    from storage.artifacts import write_table
    from storage.layout import RunLayout
    from storage.schemas import make_table
    from storage.store import Store

    store, layout = Store.from_config({"root": str(tmp_path)}), RunLayout("p", "e")
    ctx = SimpleNamespace(store=store, layout=layout, step=1)
    manifest = write_table(store, layout, 1, "logprob", make_table("logprob", {"rank": [0]}),
                           fingerprint="f", extra={"metrics": {"critic/score/mean": 1.0}})
    write_table(store, layout, 1, "reward", make_table("reward", {"score": [1.0], "acc": [1.0], "extras": ["{}"], "error": [None]}),
                fingerprint="g", extra={"metrics": {"reward/score/mean": 1.0}})
    summary = summarize(manifest, skipped=False, seconds=0.25)
    assert summary["committed"] is True and summary["metrics"] == {"critic/score/mean": 1.0}
    store.delete(layout.manifest(1, "logprob"))  # what step_metrics shows comes from the summary now
    assert step_report.step_metrics(ctx, {"logprob": summary}) == {
        "critic/score/mean": 1.0, "reward/score/mean": 1.0, "timing_s/logprob": 0.25}
    committing = summarize({**manifest, "extra": {"metrics": {"critic/score/mean": 2.0}, "committing": "in the background"}},
                           skipped=False)
    assert committing["committed"] is False  # not yet stored: the store is read (nothing there), then the summary
    assert step_report.step_metrics(ctx, {"logprob": committing}) == {"critic/score/mean": 2.0, "reward/score/mean": 1.0}
