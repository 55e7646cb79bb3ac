"""`make cluster-test`: stagerl's multi-host deployment end to end on network-namespace hosts.

    sudo .venv/bin/python tests/cluster/run_cluster.py [--faults]

Four hosts (tests/cluster/hosts.py: own network stack, hostname, PIDs, HOME and TMPDIR; the
checkout and venv shared like an image; the only data path between them the S3 endpoint):
ctl (Prefect server, S3, the `cpu` worker that runs rl-train), inf (pool `inference`), trn1 and
trn2 (sshd, pool `training`). A 2-step tiny-CPU run in orchestration.mode=deployments is started
with `prefect deployment run`: rollout on inf, the update one DeepSpeed job over trn1+trn2
(trainer.launcher=deepspeed, a hostfile, gloo) whose first forward also gives the old log-probs
(GRPO on-policy without KL, verl's path: the logprob stage runs no pass, so it stays in the
driver; with a pass it runs as a DeepSpeed job on the training pool too, as bench/launch.py
--hostfile shows across these hosts). The script prints the placement every
manifest records (the stage's host, each rank's host) and checks the final weights against a
single-host run of the same config on ctl (2 ranks in its rank pool): bit-identical (with 2
ranks an all-reduce is one addition, a + b == b + a exactly, whatever the order of the hosts).
Then the same at trainer.staleness=1 over 3 steps (async_case): step k+1's rollout on inf while
step k's update trains on trn1+trn2, checked from the manifests, and the final weights again
bit-identical to a single-host run's.
Exit code 0 when everything holds; without root or the tools it prints SKIPPED and why."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from hosts import Cluster  # noqa: E402
from stack import (BUCKET, REPO, TRAINING, check_ssh, deploy, host_env, prefect, setup_ssh,  # noqa: E402
                   start_ctl, start_sshd, start_worker, wait_workers, write_deepspeed_env)

HOSTS = ["ctl", "inf", "trn1", "trn2"]
ROOT = f"s3://{BUCKET}/cluster-test"
HEARTBEAT_S = 15.0  # orchestration.stage_heartbeat_timeout_s of these runs
TOOLS = {"ip": "iproute2", "unshare": "util-linux", "nsenter": "util-linux", "/usr/sbin/sshd": "openssh-server",
         "ssh": "openssh-client", "ssh-keygen": "openssh-client", "pdsh": "pdsh"}
T0 = time.time()


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def missing_tools() -> list[str]:
    return sorted({pkg for tool, pkg in TOOLS.items() if not (os.path.exists(tool) or shutil.which(tool))})


def ensure_tools() -> str | None:
    """Install what is missing (apt-get, as root); returns why the test cannot run, or None."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (run as root, as CI does)"
    missing = missing_tools()
    if missing and shutil.which("apt-get"):
        say(f"installing {' '.join(missing)}")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        policy = Path("/usr/sbin/policy-rc.d")  # openssh-server's install must not start sshd here
        own_policy = not policy.exists()
        if own_policy:
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
        try:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
            subprocess.run(["apt-get", "install", "-y", "-qq", *missing], env=env, capture_output=True)
        finally:
            if own_policy:
                policy.unlink(missing_ok=True)
        missing = missing_tools()
    if missing:
        return f"missing packages {' '.join(missing)} and they could not be installed"
    return None


def write_image(cluster) -> Path:
    """What every host may read, like a machine image: the tiny model, the data, the hostfile."""
    from stages.data.tools import write_arith_dataset
    from stages.model.tiny import save_tiny_model

    image = cluster.base / "image"
    save_tiny_model(image / "model")
    write_arith_dataset(image / "train.parquet", n=40)
    write_arith_dataset(image / "test.parquet", n=8, split="test")
    (image / "hostfile").write_text("".join(f"{name} slots=1\n" for name in TRAINING))
    return image


def overrides(image: Path, steps: int = 2) -> list[str]:
    """A small on-policy GRPO run without KL: one mini-batch, so the update's own forward gives the
    old log-probs and logprob and update are one DeepSpeed job. Storage retries after 1, 2, 4, 8,
    16 s ride out a 15 s outage; a stage flow silent for 15 s is lost."""
    return ["warmstart.enable=false", "actor_rollout_ref.rollout.name=hf", "trainer.val_before_train=false",
            "trainer.test_freq=-1", f"data.train_files={image}/train.parquet", f"data.val_files={image}/test.parquet",
            f"actor_rollout_ref.model.path={image}/model", f"storage.root={ROOT}",
            "data.train_batch_size=4", "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.hf_generate_batch_size=8", f"trainer.total_training_steps={steps}",
            "reward.num_workers=1", "trainer.save_freq=1",  # every step's weights kept: compared
            "orchestration.retry_delay_s=1", f"orchestration.stage_heartbeat_timeout_s={HEARTBEAT_S:g}"]


def cluster_overrides(image: Path) -> list[str]:
    return ["orchestration.mode=deployments", "trainer.launcher=deepspeed", f"trainer.hostfile={image}/hostfile",
            "trainer.nnodes=2", "trainer.n_gpus_per_node=1"]


def report(cluster, *experiments) -> dict:
    out = cluster["ctl"].run(["python", HERE / "report.py", ROOT, *experiments], env=host_env(cluster), cwd=REPO)
    return json.loads(out.stdout)


def placement_table(doc: dict) -> str:
    lines = [f"{'step':>4}  {'stage':<9}  {'host':<5}  ranks"]
    for step, stages in doc["steps"].items():
        for stage, m in stages.items():
            ranks = ",".join(m["rank_hosts"]) if m and m.get("rank_hosts") else "-"
            lines.append(f"{step:>4}  {stage:<9}  {(m or {}).get('host') or 'MISSING':<5}  {ranks}")
    return "\n".join(lines)


def check_placement(doc: dict) -> list[str]:
    """Rollout on inf, the update's ranks on trn1+trn2, the rest on ctl. The logprob stage would run
    on the training hosts with a pass (a KL loss's reference, a critic); this test's config, GRPO
    without KL in one mini-batch, runs none at any trainer.staleness: the old log-probs are the
    update's own first forward, with the weights such a pass would use."""
    problems = []
    for step, stages in doc["steps"].items():
        for stage, m in stages.items():
            if m is None:
                problems.append(f"step {step} {stage}: no manifest")
                continue
            want = {"rollout": {"inf"}, "update": set(TRAINING)}.get(stage, {"ctl"})
            if m["host"] not in want:
                problems.append(f"step {step} {stage} ran on {m['host']}, expected one of {sorted(want)}")
            if stage == "update" and sorted(m.get("rank_hosts") or []) != sorted(TRAINING):
                problems.append(f"step {step} {stage}: ranks on {m.get('rank_hosts')}, expected {list(TRAINING)}")
    return problems


def run_params(image: Path, experiment: str, steps: int = 2, extra: tuple = ()) -> dict:
    return {"overrides": overrides(image, steps) + cluster_overrides(image) + list(extra), "experiment_name": experiment}


def run_deployment(cluster, image: Path, experiment: str, timeout: float = 600, steps: int = 2, extra: tuple = ()):
    params = json.dumps(run_params(image, experiment, steps, extra))
    return prefect(cluster, "deployment", "run", "rl-train/tiny-cpu", "--params", params, "--watch",
                   "--watch-interval", "2", "--watch-timeout", str(int(timeout)), timeout=timeout + 60, check=False)


def bring_up(cluster) -> Path:
    say(f"hosts up: {', '.join(f'{h.name}={h.addr}' for h in cluster.hosts.values())} (folder {cluster.base})")
    written = threading.Thread(target=write_image, args=(cluster,), name="image")  # beside the services' start
    written.start()
    setup_ssh(cluster)
    for name in TRAINING:
        write_deepspeed_env(cluster, name)
        start_sshd(cluster, name)
    start_ctl(cluster)
    written.join()
    image = cluster.base / "image"
    if not (image / "hostfile").exists():
        raise RuntimeError("the image (model, data, hostfile) was not written")
    say("ctl: S3 endpoint and Prefect server answer")
    deploy(cluster)
    for name in HOSTS:
        start_worker(cluster, name)
    check_ssh(cluster)
    wait_workers(cluster, HOSTS)
    say("deployments created, a worker online on every host, pdsh over ssh trn1 -> trn1,trn2 works")
    return image


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep-logs", help="copy the hosts' logs into this folder before the hosts go")
    parser.add_argument("--no-faults", action="store_true", help="only the clean run and its comparison")
    parser.add_argument("--bench-launch", action="store_true", help="instead of the runs: bench/launch.py on "
                        "trn1 over trn1+trn2 (per-call DeepSpeed launches vs a multi-node rank pool)")
    args = parser.parse_args(argv)
    reason = ensure_tools()
    if reason:
        print(f"cluster-test SKIPPED: {reason}", flush=True)
        return 0
    failures: list[str] = []
    with Cluster(HOSTS) as cluster:
        try:
            image = bring_up(cluster)
            if args.bench_launch:
                bench = cluster["trn1"].run([sys.executable, REPO / "bench" / "launch.py", "--hostfile",
                                             image / "hostfile", "--store", f"s3://{BUCKET}/bench-launch",
                                             "--model", image / "model", "--steps", "3"],
                                            env=host_env(cluster), cwd=REPO, timeout=1200, check=False)
                say(f"bench/launch.py across trn1+trn2 (exit code {bench.returncode}):\n{bench.stdout[-3000:]}")
                if bench.returncode != 0 or '"final_weights_identical": true' not in bench.stdout:
                    failures.append(f"the multi-node launch bench failed:\n{bench.stderr[-3000:]}")
                return finish(failures)
            say("single-host reference on ctl (stagerl train, 2 ranks in its rank pool), beside the cluster "
                "run: prefect deployment run 'rl-train/tiny-cpu' --watch")
            ref = cluster["ctl"].spawn([sys.executable, "-m", "flows.cli", "train", "--config", "tiny-cpu",
                                        "--experiment", "reference", *overrides(image), "trainer.n_gpus_per_node=2"],
                                       env=host_env(cluster), log="reference", cwd=REPO)
            run = run_deployment(cluster, image, "cluster")
            if run.returncode != 0:
                raise RuntimeError(f"cluster run failed:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}")
            say("cluster run completed")
            if ref.wait(timeout=600) != 0:
                raise RuntimeError(f"reference run failed:\n{ref.log.read_text()[-4000:]}")
            doc = report(cluster, "reference", "cluster")
            say("placement the cluster run's manifests record:\n" + placement_table(doc["cluster"]))
            failures += check_placement(doc["cluster"])
            ref_w, got_w = doc["reference"]["weights"], doc["cluster"]["weights"]
            same = ref_w.get("2") is not None and ref_w.get("2") == got_w.get("2")
            say(f"final weights (step 2) sha256: single host {ref_w.get('2')}  cluster {got_w.get('2')}  "
                f"{'bit-identical' if same else 'DIFFERENT'}")
            if not same:
                failures.append("final weights differ from the single-host run's")
            if not args.no_faults:
                failures += fault_cases(cluster, image, got_w)
            failures += async_case(cluster, image)
            say("flow runs (Prefect):\n" + flow_run_table(cluster))
        except Exception as exc:  # noqa: BLE001 - reported with the hosts' logs
            failures.append(f"{type(exc).__name__}: {exc}")
            dump_logs(cluster)
        finally:
            if args.keep_logs:
                shutil.copytree(cluster.base / "logs", args.keep_logs, dirs_exist_ok=True)
    return finish(failures)


def finish(failures: list) -> int:
    for f in failures:
        print(f"FAILED: {f}", flush=True)
    print(f"cluster-test: {'passed' if not failures else 'failed'} in {time.time() - T0:.0f} s", flush=True)
    return 1 if failures else 0


def fault_cases(cluster, image: Path, clean_weights: dict) -> list[str]:
    from faults import run_faults

    result = run_faults(cluster, run_params(image, "faults", steps=1), ROOT, HEARTBEAT_S, say)
    doc = report(cluster, "faults")["faults"]
    say("placement the faulted run's manifests record (after its retries):\n" + placement_table(doc))
    same = doc["weights"].get("1") is not None and doc["weights"].get("1") == clean_weights.get("1")
    say(f"step 1 weights sha256: faulted run {doc['weights'].get('1')}  uninterrupted cluster run "
        f"{clean_weights.get('1')}  {'bit-identical' if same else 'DIFFERENT'}; timings {result['timings']}")
    return result["problems"] + check_placement(doc) + ([] if same else ["the faulted run's weights differ"])


ASYNC = ("trainer.staleness=1",)  # verl's one-step-off policy: step k+1 samples while step k trains


def async_case(cluster, image: Path, steps: int = 3) -> list[str]:
    """A 3-step run at trainer.staleness=1 through the deployments (rollout on inf while the update
    trains on trn1+trn2; the logprob stage, which runs no pass in this config, and the advantage on
    ctl in the rollout chain: flows/train.py::rollout_chain), beside a single-host run of the same
    config on ctl: placement, the rollout of step k+1 committed before the update of step k (the
    two pools busy at once), and bit-identical final weights."""
    say(f"trainer.staleness=1: a {steps}-step deployment run beside a single-host run of the same config")
    ref = cluster["ctl"].spawn([sys.executable, "-m", "flows.cli", "train", "--config", "tiny-cpu",
                                "--experiment", "reference-async", *overrides(image, steps), *ASYNC,
                                "trainer.n_gpus_per_node=2"], env=host_env(cluster), log="reference-async", cwd=REPO)
    run = run_deployment(cluster, image, "cluster-async", steps=steps, extra=ASYNC)
    if run.returncode != 0:
        return [f"the staleness-1 cluster run failed:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"]
    if ref.wait(timeout=600) != 0:
        return [f"the staleness-1 single-host run failed:\n{ref.log.read_text()[-4000:]}"]
    doc = report(cluster, "reference-async", "cluster-async")
    got = doc["cluster-async"]
    say("placement the staleness-1 run's manifests record:\n" + placement_table(got))
    problems = check_placement(got)
    ahead = [k for k in range(1, steps) if got["steps"][str(k + 1)]["rollout"]["written_at"]
             < got["steps"][str(k)]["update"]["written_at"]]
    say(f"rollouts committed before the previous step's update (the pools overlapping): steps {[k + 1 for k in ahead]}")
    if not ahead:
        problems.append("no rollout of the staleness-1 run was committed before the previous step's update")
    ref_w, got_w = doc["reference-async"]["weights"], got["weights"]
    same = ref_w.get(str(steps)) is not None and ref_w.get(str(steps)) == got_w.get(str(steps))
    say(f"staleness-1 final weights (step {steps}) sha256: single host {ref_w.get(str(steps))}  cluster "
        f"{got_w.get(str(steps))}  {'bit-identical' if same else 'DIFFERENT'}")
    return problems + ([] if same else ["the staleness-1 cluster run's weights differ from the single-host run's"])


FLOW_RUNS = """
from prefect import get_client
with get_client(sync_client=True) as c:
    runs = sorted(c.read_flow_runs(limit=200), key=lambda r: r.start_time or r.expected_start_time)
    t0 = runs[0].start_time
    for r in runs:
        start = (r.start_time - t0).total_seconds() if r.start_time and t0 else float("nan")
        print(f"{r.name:<22} {r.state_name:<10} start +{start:6.1f}s  ran {r.total_run_time.total_seconds():6.1f}s")
"""


def flow_run_table(cluster) -> str:
    return cluster["ctl"].run(["python", "-c", FLOW_RUNS], env=host_env(cluster), check=False).stdout


def dump_logs(cluster, tail: int = 3000) -> None:
    for log in sorted((cluster.base / "logs").glob("*.log")):
        text = log.read_text(errors="replace")
        if text.strip():
            print(f"----- {log.name} (last {tail} chars) -----\n{text[-tail:]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
