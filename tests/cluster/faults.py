"""The fault cases of `make cluster-test`, in one experiment (`faults`, one step) run as the clean one:

1. the inf host crashes mid-rollout (every process of it SIGKILLed: its worker and the rollout's
   flow run): the training flow run fails within orchestration.stage_heartbeat_timeout_s naming
   inf and the rollout; inf boots again with its worker, `prefect flow-run retry` resumes;
2. during the retried run's rollout an S3 outage of 15 s (the proxy in front of the store resets
   and refuses every connection): survived by the stages' storage retries;
3. trn2's rank is SIGKILLed mid-update and trn2's link goes down: the run fails naming trn2 and the
   update (ssh's ServerAlive or the stage heartbeat, whichever notices first); the link comes
   back, `prefect flow-run retry` completes the step.
Then the step's weights must equal the clean cluster run's (which equal the single-host run's)."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from stack import OUTAGE_S, REPO, host_env, outage_control, prefect, start_worker

HERE = Path(__file__).resolve().parent


def probe(cluster, *args, timeout: float = 300) -> dict | None:
    out = cluster["ctl"].run(["python", HERE / "probe.py", *map(str, args)], env=host_env(cluster), cwd=REPO,
                             timeout=timeout + 60, check=False)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else None


def start_run(cluster, params: dict) -> str:
    out = prefect(cluster, "deployment", "run", "rl-train/tiny-cpu", "--params", json.dumps(params))
    found = re.search(r"UUID:\s*([0-9a-f-]{36})", out.stdout)
    if not found:
        raise RuntimeError(f"no flow run id in:\n{out.stdout}")
    return found.group(1)


def host_processes(host, pattern: str) -> list[int]:
    """PIDs (as seen from outside) of the host's processes whose command line matches `pattern`."""
    own = os.readlink(f"/proc/{host.pid1}/ns/pid")
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "pid") != own:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if re.search(pattern, " ".join(a.decode(errors="replace") for a in argv)):
            pids.append(int(entry.name))
    return pids


def wait_for(what: str, check, timeout: float, every: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def expect_failure(cluster, run_id: str, since: float, names: tuple, limit_s: float, say) -> dict:
    end = probe(cluster, "flow-run", run_id, limit_s + 120, timeout=limit_s + 120)
    if end is None:
        raise RuntimeError(f"flow run {run_id} did not end")
    took = end["at"] - since
    say(f"flow run ended {end['state']} {took:.1f} s after the fault: {end['message'][:600]}")
    problems = []
    if end["type"] not in ("FAILED", "CRASHED"):
        problems.append(f"flow run ended {end['state']}, expected a failure")
    if took > limit_s:
        problems.append(f"the failure took {took:.0f} s (limit {limit_s:.0f} s)")
    for name in names:
        if name not in end["message"]:
            problems.append(f"the failure message does not name {name!r}: {end['message'][:400]}")
    return {"took_s": round(took, 1), "problems": problems}


def run_faults(cluster, params: dict, root: str, heartbeat_s: float, say) -> dict:
    """The three faults above on one experiment; returns {"problems": [...], "timings": {...}}."""
    base = f"stagerl/{params['experiment_name']}"  # keys relative to the store root
    problems, timings = [], {}
    run_id = start_run(cluster, params)
    say(f"faults: flow run {run_id} started; waiting for step 1's rollout on inf")
    beat = probe(cluster, "object", root, f"{base}/_live/000001/rollout.json", 240, timeout=240)
    if beat is None:
        raise RuntimeError("the rollout of step 1 never sent a heartbeat")
    time.sleep(1.0)
    cluster["inf"].crash()
    t_crash = time.time()
    say("faults: inf crashed mid-rollout (SIGKILL to every process of the host)")
    got = expect_failure(cluster, run_id, t_crash, ("inf", "rollout"), heartbeat_s + 20, say)
    problems += got["problems"]
    timings["inf_crash_to_failure_s"] = got["took_s"]
    cluster["inf"].boot()
    start_worker(cluster, "inf")
    if probe(cluster, "worker", "inf-worker", 120, timeout=120) is None:
        raise RuntimeError("the rebooted inf's worker did not come back")
    say("faults: inf is back with its worker; prefect flow-run retry")
    prefect(cluster, "flow-run", "retry", run_id)
    if probe(cluster, "object", root, f"{base}/_live/000001/rollout.json", 240, beat["flow_run_id"],
             timeout=240) is None:
        raise RuntimeError("the retried rollout of step 1 never sent a heartbeat")
    outage_control(cluster).write_text("")
    t_outage = time.time()
    say(f"faults: S3 outage of {OUTAGE_S:.0f} s started during the retried rollout of step 1")
    trn2 = cluster["trn2"]
    # a rank: `python -u -m stages.ranks.entry stages.training.worker ...` (its launcher has --module instead)
    rank = wait_for("trn2's update rank", lambda: host_processes(trn2, r" -u -m stages\.ranks\.entry stages\.training\.worker"),
                    300)
    timings["outage_to_update_s"] = round(time.time() - t_outage, 1)
    time.sleep(1.0)
    for pid in rank:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            problems.append("trn2's rank ended before it could be killed (the update was faster than 1 s)")
    trn2.link(False)
    t_kill = time.time()
    say(f"faults: trn2's update rank (pid {rank}) SIGKILLed, trn2's link down")
    got = expect_failure(cluster, run_id, t_kill, ("trn2", "update"), heartbeat_s + 30, say)
    problems += got["problems"]
    timings["trn2_kill_to_failure_s"] = got["took_s"]
    trn2.link(True)
    say("faults: trn2's link is up again; prefect flow-run retry")
    prefect(cluster, "flow-run", "retry", run_id)
    end = probe(cluster, "flow-run", run_id, 400, timeout=400)
    if not end or end["type"] != "COMPLETED":
        problems.append(f"the retried run did not complete: {end}")
    outages = [line for line in (cluster.base / "logs" / "ctl-s3-proxy.log").read_text().splitlines()
               if line.startswith("outage")]
    retried = [line.strip() for line in (cluster.base / "logs" / "inf-worker.log").read_text(errors="replace")
               .splitlines() if "Retry " in line and "will start" in line]  # Prefect's task retry
    say(f"faults: the S3 proxy's log: {'; '.join(outages)}; inf's worker: {retried[:1]}")
    if not retried:  # not a failure: botocore's own retries can ride out what is left of the outage
        # when the rollout's first request meets its end (seen once in CI, 2026-12-02); the run
        # still had to survive it, and its weights are compared below
        say("faults: no Prefect task retry on inf: its S3 requests did not fail past botocore's retries")
    return {"problems": problems, "timings": timings, "run_id": run_id}
