"""Resuming with `prefect flow-run retry`, and the local Prefect server of `stagerl train`, with
real parts: `prefect server start` (SQLite, scratch PREFECT_HOME, analytics off), a process work
pool and worker, `prefect deploy` from this checkout, the real stages at tiny shapes, a local store
under tmp_path.

The failure to recover from is one a user meets and fixes: the custom reward function asks a
verifier service (HTTP, started by the test) for each row's score with reward.strict=true, and the
verifier goes down after scoring step 1. Step 2's reward stage fails, so the flow run fails; the
user restarts the verifier and retries the flow run. Neither the reward file nor the config
changes, so step 1 and step 2's complete stages stay complete (a changed reward *file* would
change the reward stage's fingerprint and rightly re-run step 1's reward and everything after)."""
import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from _prefect_server import PrefectServer
from _s3_server import free_port
from storage.artifacts import read_manifest, read_table
from storage.layout import STAGES, RunLayout
from storage.store import Store
from storage.weights import folder_manifest, list_weights

REPO = Path(__file__).resolve().parent.parent
PROJECT = "stagerl"
ROWS_PER_STEP = 8  # data.train_batch_size=4 x rollout.n=2


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from test_flows import write_run_assets

    return write_run_assets(tmp_path_factory.mktemp("assets"))


def tiny_overrides(assets, root, steps=2) -> list:
    """8 rows per step, 1 rank, short responses, no warm start and no validation."""
    return ["warmstart.enable=false", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "actor_rollout_ref.rollout.name=hf",
            f"data.train_files={assets}/train.parquet", f"data.val_files={assets}/test.parquet",
            f"actor_rollout_ref.model.path={assets}/model", f"storage.root={root}",
            f"storage.cache_dir={root}-cache", "data.train_batch_size=4",
            "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.hf_generate_batch_size=8", "trainer.n_gpus_per_node=1",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=1", "reward.num_workers=1",
            "orchestration.retry_delay_s=0.5"]


def manifest_times(store, layout, steps=(1, 2)) -> dict:
    return {(step, stage): (read_manifest(store, layout, step, stage) or {}).get("written_at")
            for step in steps for stage in STAGES}


# ---- a verifier service the reward function calls ------------------------------------------
def verifier_score(solution_str: str) -> float:
    """What the verifier answers: a spread of scores in [0, 1] so that advantages are not 0."""
    return (sum(map(ord, solution_str)) % 7) / 6


class Verifier:
    """POST /score {"solution_str", "ground_truth"} -> {"score"} on 127.0.0.1:port. With
    `crash_after=N` it answers N requests, then stops listening (a crashed service)."""

    def __init__(self, port: int, crash_after: int | None = None):
        self.port, self.crash_after, self.served = port, crash_after, 0
        self.lock = threading.Lock()
        verifier = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with verifier.lock:
                    verifier.served += 1
                    down = verifier.crash_after is not None and \
                        verifier.served > verifier.crash_after
                    if verifier.crash_after is not None and verifier.served >= verifier.crash_after:
                        threading.Thread(target=verifier.stop, daemon=True).start()
                if down:  # a request that slipped in while it goes down
                    self.send_error(503, "verifier going down")
                    return
                data = json.dumps({"score": verifier_score(body["solution_str"])}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


REWARD_FILE = '''"""Scores come from the team's verifier service."""
import json
import urllib.request

VERIFIER = "http://127.0.0.1:{port}/score"


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    body = json.dumps({{"solution_str": solution_str, "ground_truth": ground_truth}}).encode()
    request = urllib.request.Request(VERIFIER, body, {{"Content-Type": "application/json"}})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["score"]
'''


# ---- the server, the work pool, the worker -------------------------------------------------
@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A Prefect server, the `cpu` process pool with a worker, rl-train/tiny-cpu deployed."""
    with PrefectServer(tmp_path_factory.mktemp("prefect-home")) as server:
        server.cli("work-pool", "create", "cpu", "--type", "process", "--overwrite")
        server.cli("deploy", "--name", "tiny-cpu", cwd=REPO)
        env = server.env(PYTHONUNBUFFERED="1")
        env.pop("STAGERL_FAULT", None)
        server.start_worker("cpu", REPO, env)
        yield server


def api(server, path: str, body=None):
    request = urllib.request.Request(
        f"{server.api_url}{path}", data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def wait_for_state(server, flow_run_id: str, wanted: str, after: str = "",
                   timeout: float = 600.0) -> dict:
    """Poll the flow run until its state type is `wanted`; another final state set later than
    `after` (a timestamp) fails at once with the worker's log."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        run = api(server, f"/flow_runs/{flow_run_id}")
        state = run.get("state") or {}
        later = bool(state) and (not after or when(state["timestamp"]) > when(after))
        if state.get("type") == wanted and later:
            return run
        if state.get("type") in FINAL and later:
            raise AssertionError(f"flow run {flow_run_id} ended {state['type']}: "
                                 f"{state.get('message')}\n{worker_logs(server)}")
        time.sleep(1.0)
    raise AssertionError(f"flow run {flow_run_id} not {wanted} after {timeout}s\n"
                         f"{worker_logs(server)}")


FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def when(timestamp: str) -> datetime:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00"))


def worker_logs(server) -> str:
    return "\n".join(w.log.read_text(errors="replace")[-6000:] for w in server.workers)


def run_deployment(server, params: dict) -> str:
    """`prefect deployment run 'rl-train/tiny-cpu'` (no wait); returns the flow run id."""
    out = server.cli("deployment", "run", "rl-train/tiny-cpu", "--params", json.dumps(params),
                     cwd=REPO)
    match = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout)
    assert match, out.stdout
    return match.group(1)


def state_types(server, flow_run_id: str) -> list[str]:
    states = api(server, f"/flow_run_states/?flow_run_id={flow_run_id}")
    return [s["type"] for s in sorted(states, key=lambda s: when(s["timestamp"]))]


def task_states(server) -> dict:
    """{task run name: [state names, oldest first]} of every task run on the server."""
    runs = api(server, "/task_runs/filter", {"sort": "EXPECTED_START_TIME_ASC", "limit": 200})
    out: dict = {}
    for run in sorted(runs, key=lambda r: when(r["created"])):
        out.setdefault(run["name"], []).append(run["state"]["name"])
    return out


def test_flow_run_retry_resumes_at_the_failed_stage(deployed, assets, tmp_path):
    """Step 2's reward fails (the verifier is down); after the verifier is restarted,
    `prefect flow-run retry` reruns the same flow run: step 1 and step 2's rollout and logprob are
    not re-run (manifest times unchanged, the verifier sees only step 2's rows), step 2 completes,
    and the final weights equal an uninterrupted run's."""
    server = deployed
    port = free_port()
    reward_file = tmp_path / "verifier_reward.py"
    reward_file.write_text(REWARD_FILE.format(port=port))
    reward = [f"custom_reward_function.path={reward_file}",
              "custom_reward_function.name=compute_score", "reward.strict=true"]
    root = tmp_path / "runs"
    params = {"overrides": tiny_overrides(assets, root) + reward, "experiment_name": "retry"}

    verifier = Verifier(port, crash_after=ROWS_PER_STEP)  # scores step 1, then goes down
    try:
        flow_run_id = run_deployment(server, params)
        failed = wait_for_state(server, flow_run_id, "FAILED")
    finally:
        verifier.stop()
    assert verifier.served in (ROWS_PER_STEP, ROWS_PER_STEP + 1)  # + a row refused with 503
    assert "reward scoring failed on row" in failed["state"]["message"], failed["state"]
    store, layout = Store.from_config({"root": str(root)}), RunLayout(PROJECT, "retry")
    before = manifest_times(store, layout)
    assert all(before[(1, stage)] for stage in STAGES) and list_weights(store, layout) == [1]
    responses = read_table(store, layout, 1, "rollout").column("response").to_pylist()
    scores = read_table(store, layout, 1, "reward").column("score").to_pylist()
    assert scores == pytest.approx([verifier_score(r) for r in responses], abs=1e-6)  # float32
    assert len(set(scores)) > 1
    assert [bool(before[(2, stage)]) for stage in STAGES] == [True, True, False, False, False]

    restarted = Verifier(port)  # the user restarts the verifier ...
    try:
        retry = server.cli("flow-run", "retry", flow_run_id, cwd=REPO)  # ... and retries the run
        assert "scheduled for retry" in retry.stdout, retry.stdout
        done = wait_for_state(server, flow_run_id, "COMPLETED", after=failed["state"]["timestamp"])
        assert done["id"] == flow_run_id and done["run_count"] == 2
        kinds = state_types(server, flow_run_id)
        failed_at = kinds.index("FAILED")
        assert "RUNNING" in kinds[:failed_at] and kinds[-1] == "COMPLETED", kinds
        assert kinds[failed_at + 1] == "SCHEDULED" and "RUNNING" in kinds[failed_at + 1:], kinds
        assert restarted.served == ROWS_PER_STEP  # only step 2's rows were scored again
        tasks = task_states(server)  # step 1 is not entered again; step 2 resumes at reward
        assert all(tasks[f"{stage}-step-1"] == ["Completed"] for stage in STAGES), tasks
        assert [tasks[f"{stage}-step-2"] for stage in STAGES] == [
            ["Completed", "Cached"], ["Completed", "Cached"], ["Failed", "Completed"],
            ["Completed"], ["Completed"]], tasks

        after = manifest_times(store, layout)
        assert all(after[k] == v for k, v in before.items() if v), (before, after)
        assert all(after.values()) and list_weights(store, layout) == [1, 2]

        # the same experiment uninterrupted (another store), the verifier up throughout
        ref_root = tmp_path / "reference"
        ref_id = run_deployment(server, {"overrides": tiny_overrides(assets, ref_root) + reward,
                                         "experiment_name": "retry"})
        wait_for_state(server, ref_id, "COMPLETED")
    finally:
        restarted.stop()
    assert restarted.served == 3 * ROWS_PER_STEP
    ref_store = Store.from_config({"root": str(ref_root)})
    checksum = {k: folder_manifest(store, layout.weights(k))["checksum"] for k in (1, 2)}
    assert checksum[1] != checksum[2]  # the scores moved the weights
    assert folder_manifest(ref_store, layout.weights(2))["checksum"] == checksum[2]


# ---- `stagerl train` without PREFECT_API_URL: its own server dies with it ------------------
def alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it is dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def prefect_servers(home: Path) -> list[int]:
    """Live `prefect server start` processes whose PREFECT_HOME is `home`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"prefect" in cmd and b"server" in cmd and b"start" in cmd and \
                f"PREFECT_HOME={home}".encode() in env and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def wait_until(predicate, timeout: float, what: str, proc=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode}")
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout}s")


def test_sigkilled_stagerl_train_takes_its_prefect_server_with_it(assets, tmp_path):
    """`stagerl train` without PREFECT_API_URL runs the flow against its own `prefect server
    start` child; SIGKILLed mid-run, it leaves no server behind. A normal run (here: resuming the
    killed experiment) stops its server and removes its record, and the killed run's record too."""
    root = (tmp_path / "runs").resolve()
    home = root / ".cache" / "prefect"  # flows.cli.train.prefect_env: the store's scratch home
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PYTHONUNBUFFERED="1")
    log = tmp_path / "train.log"
    cli = [sys.executable, "-m", "flows.cli"]
    proc = subprocess.Popen([*cli, "train", "--config", "tiny-cpu", "--experiment", "k", *tiny_overrides(assets, root, 1)],
                            cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    server_pid = None
    try:
        store, layout = Store.from_config({"root": str(root)}), RunLayout(PROJECT, "k")
        wait_until(lambda: read_manifest(store, layout, 1, "rollout"), 300,  # killed mid-step
                   "step 1's rollout did not finish", proc)
        record = json.loads((home / f"stagerl-server-{proc.pid}.json").read_text())
        server_pid = record["pid"]
        assert server_pid in children(proc.pid) and prefect_servers(home) == [server_pid]
        assert f"View at http://127.0.0.1:{record['port']}/runs/flow-run/" in log.read_text()
        urllib.request.urlopen(f"{record['api_url']}/health", timeout=10).read()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        wait_until(lambda: not alive(server_pid), 30, f"server {server_pid} outlived stagerl")
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{record['api_url']}/health", timeout=5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what else the killed run left (its own session)
        except ProcessLookupError:
            pass
        if server_pid and alive(server_pid):  # only when the test failed
            os.kill(server_pid, signal.SIGKILL)
    # the resumed run's server writes task runs' states only in batches, here never on its own
    # clock (a flush every 600 s): what the stop writes is all the API will ever have
    resumed = subprocess.run([*cli, "resume", "k", "--root", str(root)], cwd=REPO,
                             env={**env, "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "600"},
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "Error logging to API" not in resumed.stdout + resumed.stderr
    assert prefect_servers(home) == []
    assert not list(home.glob("stagerl-server-*"))  # records and logs of both runs removed
    assert list_weights(store, layout) == [1]
    with contextlib.closing(sqlite3.connect(home / "prefect.db")) as db:
        states = db.execute("SELECT task_run.name, task_run.state_name FROM task_run JOIN flow_run ON "
                            "task_run.flow_run_id = flow_run.id WHERE flow_run.state_name = 'Completed'").fetchall()
    assert sorted(name for name, _ in states) == sorted(f"{s}-step-1" for s in STAGES), states
    assert dict(states)["rollout-step-1"] == "Cached"  # complete before the SIGKILL
    assert {state for _, state in states} <= {"Cached", "Completed"}, states
