"""The run handle the training flow passes to the rl-step flow and its stage tasks
(flows/run_handle.py): the same object reaches them, Prefect records only its URI, and a handle
that has only the URI (a stage deployment, a rebuilt run) reads the run from run.json."""
from prefect.cache_policies import NO_CACHE

from configs.loader import load_config
from flows.run_handle import RunHandle, split_run_uri
from flows.step import rl_step, stage_task
from storage.artifacts import write_run_json
from storage.layout import RunLayout
from storage.store import Store


def test_a_flow_parameter_keeps_the_object_and_records_only_the_uri(tmp_path):
    key, secret = "AKIAFAKEKEY7Q3Z9XW2M", "fakeSecret+9vQx/Zr7TtPpLmNnBbVvCcXx"
    cfg = load_config("tiny-cpu", [f"storage.root={tmp_path}", "trainer.experiment_name=h",
                                   f"storage.key={key}", f"storage.secret={secret}"])
    store = Store.from_config({"root": str(tmp_path)})
    session = object()
    run = RunHandle.of(cfg, {"rows_per_step": 8}, store, session)
    assert run.uri == store.url(RunLayout.from_config(cfg).base) and run.session is session
    assert split_run_uri(run.uri)[1:] == ("stagerl", "h")
    # what Prefect does with a flow's parameters: validate (pydantic), then serialise for the API
    validated = rl_step.validate_parameters({"run": run, "step": 2, "extra": {"epoch": 0}})
    assert validated["run"] is run
    recorded = rl_step.serialize_parameters(validated)
    assert recorded["run"] == {"uri": run.uri} and key not in repr(recorded) and secret not in repr(recorded)
    assert stage_task.cache_policy is NO_CACHE  # task parameters make no cache key
    ctx = run.context(3, {"epoch": 1})
    assert ctx.cfg is cfg and ctx.session is session and ctx.step == 3 and ctx.extra == {"epoch": 1}


def test_a_handle_with_only_the_uri_reads_run_json(tmp_path):
    cfg = load_config("tiny-cpu", [f"storage.root={tmp_path}", "trainer.experiment_name=h"])
    store = Store.from_config(cfg["storage"])
    write_run_json(store, RunLayout.from_config(cfg), dict(cfg), extra={"plan": {"rows_per_step": 8}})
    uri = RunHandle.of(cfg, {}, store).uri
    rebuilt = RunHandle.model_validate({"uri": uri})  # what a recorded rl-step parameter gives back
    got_cfg, plan, got_store = rebuilt.open()
    assert plan == {"rows_per_step": 8} and rebuilt.session is None
    assert got_cfg["trainer"]["experiment_name"] == "h" and got_cfg["storage"]["secret"] is None
    assert rebuilt.open()[0] is got_cfg  # read once
    assert rebuilt.context(1).session is None


def test_credential_overrides_reach_the_training_flow_as_a_token_only(caplog):
    """`stagerl train` holds credential overrides in its own process and gives the rl-train flow a
    token for them (storage.secrets.held_secret_overrides): Prefect records the token, the flow,
    in that process, gets the values; once the block ends the token stands for nothing."""
    from flows.train import run_arguments, train
    from storage.secrets import held_secret_overrides, split_secret_overrides

    key, secret = "AKIAFAKEKEY7Q3Z9XW2M", "fakeSecret+9vQx/Zr7TtPpLmNnBbVvCcXx"
    public, held = split_secret_overrides(["data.train_batch_size=8", f"storage.key={key}",
                                           f"storage.root=s3://{key}:{secret}@bucket/x"])
    assert public == ["data.train_batch_size=8"] and len(held) == 2
    with held_secret_overrides(held) as token:
        validated = train.validate_parameters({"config": "tiny-cpu", "overrides": public, "secret_overrides": token})
        recorded = train.serialize_parameters(validated)
        assert recorded["secret_overrides"] == token and key not in repr(recorded) and secret not in repr(recorded)
        assert run_arguments("tiny-cpu", public, None, token) == ("tiny-cpu", public + held, None)
    assert run_arguments("tiny-cpu", public, None, token) == ("tiny-cpu", public, None)  # e.g. a retry elsewhere
    assert "held by the process that started it" in caplog.text
    with held_secret_overrides([]) as none:
        assert none is None and run_arguments("tiny-cpu", public, None, none)[1] == public


def test_one_stage_task_per_retry_policy():
    """The stage task with a run's retry options is made once (Task.with_options copies and
    validates the task, which the step loop paid every step): the same policy gives the same
    task, with orchestration.storage_retries retries doubling from orchestration.retry_delay_s."""
    from flows.step import retrying_stage_task

    task = retrying_stage_task({"orchestration": {"storage_retries": 3, "retry_delay_s": 0.5}})
    assert task is retrying_stage_task({"orchestration": {"storage_retries": 3, "retry_delay_s": 0.5}})
    assert task.retries == 3 and task.retry_delay_seconds == [0.5, 1.0, 2.0]
    assert task.cache_policy is NO_CACHE and task.fn is stage_task.fn
    other = retrying_stage_task({"orchestration": {"storage_retries": 1, "retry_delay_s": 2.0}})
    assert other is not task and other.retries == 1 and other.retry_delay_seconds == [2.0]
