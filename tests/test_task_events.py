"""flows/task_events.py against a real Prefect server: a stage task run's events are held (the
server has not recorded the task run), a release sends them in order and the server records
each task run as Completed; what is held when the context ends is sent then, and an event is
never held longer than orchestration.task_events_hold_s."""
import json
import subprocess
import sys
from pathlib import Path

from _prefect_server import PrefectServer

REPO = Path(__file__).resolve().parents[1]


def test_held_task_run_events_reach_the_server_on_release_at_exit_and_after_the_hold(tmp_path):
    with PrefectServer(tmp_path / "prefect") as server:
        out = subprocess.run([sys.executable, str(REPO / "tests" / "_paced_events.py"), str(REPO)],
                             env=server.env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # two task runs: Pending, Running and Completed each, all held and none recorded after 3 s
    assert seen["held"] == 6 and seen["sent"] == 0, seen
    assert seen["recorded_while_held"] == {}, seen
    assert seen["recorded_after_release"] == {"a": "COMPLETED", "b": "COMPLETED"}, seen
    assert seen["sent_after_release"] == seen["held_all"] >= 6, seen  # every held event
    assert seen["held_at_exit"] == 3 and seen["recorded_after_exit"] == {"c": "COMPLETED"}, seen
    assert seen["recorded_after_hold_s"] == {"d": "COMPLETED"} and seen["sent_after_hold_s"] >= 3, seen
    assert seen["pacer_when_off"] is None, seen
