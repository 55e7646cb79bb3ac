"""Run by tests/test_task_events.py in its own process against a real Prefect server
(PREFECT_API_URL): task runs inside flows.task_events.paced_task_events, and what the server
records of them while their events are held, after a release, after the hold's time and after
the context ends. Prints one JSON line of what it saw."""
import json
import sys
import time

sys.path.insert(0, sys.argv[1])  # the repository

from prefect import flow, get_client, task  # noqa: E402

from flows.task_events import paced_task_events  # noqa: E402


@task(task_run_name="{name}")
def stage(name: str) -> str:
    return name


def recorded(names: list[str]) -> dict:
    """{task run name: its state type} of the named task runs the server has recorded."""
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=names)))
    return {r.name: r.state.type.value for r in runs if r.state is not None}


def wait_recorded(names: list[str], timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        seen = recorded(names)
        if (len(seen) == len(names) and set(seen.values()) == {"COMPLETED"}) or time.time() > deadline:
            return seen
        time.sleep(0.2)


def held_task_run_events(pacer) -> int:
    """Held events of task runs (Prefect may emit others meanwhile, of the flow run)."""
    return sum(1 for _, event in pacer.held if event.event.startswith("prefect.task-run."))


@flow
def paced() -> dict:
    out = {}
    with paced_task_events({"orchestration": {"task_events_hold_s": 600}}) as pacer:
        stage("a"), stage("b")
        time.sleep(3)  # the server records a task run within ~1 s of its events
        out["held"], out["sent"], out["recorded_while_held"] = held_task_run_events(pacer), pacer.sent, recorded(["a", "b"])
        out["held_all"] = len(pacer.held)
        pacer.release()
        out["recorded_after_release"] = wait_recorded(["a", "b"])
        out["sent_after_release"] = pacer.sent
        stage("c")
        time.sleep(1)
        out["held_at_exit"] = held_task_run_events(pacer)
    out["recorded_after_exit"] = wait_recorded(["c"])
    with paced_task_events({"orchestration": {"task_events_hold_s": 0.5}}) as pacer:
        stage("d")
        out["recorded_after_hold_s"] = wait_recorded(["d"])  # no release: the hold's time ran out
        out["sent_after_hold_s"] = pacer.sent - len(pacer.held)
    with paced_task_events({"orchestration": {"task_events_hold_s": 0}}) as pacer:
        out["pacer_when_off"] = pacer
    return out


if __name__ == "__main__":
    print(json.dumps(paced()), flush=True)
