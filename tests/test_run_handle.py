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
