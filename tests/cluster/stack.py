"""What runs on the test hosts of tests/cluster/hosts.py, as a user would set up real machines:

- ctl: `prefect server start` (SQLite), moto's S3 server (the store; MinIO speaks the same API),
  a process worker on pool `cpu` (the rl-train flow: the driver);
- inf: a process worker on pool `inference` (rl-stage/rollout);
- trn1, trn2: sshd (key login for DeepSpeed's pdsh launcher) and a process worker each on pool
  `training` (rl-stage/update, which also runs logprob: the N-rank stages).
Every host gets the same environment (PREFECT_API_URL, AWS_*), its own HOME and TMPDIR (its
private tmpfs), and `ssh` on its PATH reading this cluster's ssh config (keys, known hosts,
ServerAlive: a peer whose link is down is dropped after SSH_ALIVE_S)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
PREFECT = str(VENV_BIN / "prefect")
S3_PORT, API_PORT = 9000, 4200  # what the hosts reach on ctl: the S3 proxy, the Prefect API
MOTO_PORT = 9100  # moto's server, on ctl's loopback only: every client goes through the proxy
OUTAGE_S = 15.0
BUCKET = "runs"
SSH_ALIVE_S = (2, 4)  # ServerAliveInterval, ServerAliveCountMax: a silent peer is dropped after 8 s
POOLS = {"ctl": "cpu", "inf": "inference", "trn1": "training", "trn2": "training"}
TRAINING = ("trn1", "trn2")
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def host_env(cluster, **extra) -> dict:
    base = cluster.base
    env = {"PATH": f"{base}/bin:{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": str(base / "host" / "home"), "TMPDIR": str(base / "host" / "tmp"),
           "PREFECT_HOME": str(base / "host" / "prefect"), "PREFECT_API_URL": f"http://ctl:{API_PORT}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "1",
           "PREFECT_WORKER_PREFETCH_SECONDS": "1", "PREFECT_CLI_PROMPT": "false", "PREFECT_CLI_COLORS": "false",
           "PREFECT_SERVER_UI_ENABLED": "false", "AWS_ENDPOINT_URL": f"http://ctl:{S3_PORT}", **CREDS,
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or str(REPO / ".cache" / "torch_extensions"),
           "LANG": "C.UTF-8"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


# ---- ssh ----------------------------------------------------------------------------------------
def setup_ssh(cluster) -> None:
    """Keys and configs: one client key (authorized on the training hosts), a host key per
    training host (in known_hosts: strict checking), an `ssh` wrapper on every host's PATH."""
    ssh, bin_dir = cluster.base / "ssh", cluster.base / "bin"
    ssh.mkdir(mode=0o700)
    bin_dir.mkdir()
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
    subprocess.run([*keygen, "-f", ssh / "id", "-C", "stagerl-cluster"], check=True)
    (ssh / "authorized_keys").write_text((ssh / "id.pub").read_text())
    known = []
    for name in TRAINING:
        subprocess.run([*keygen, "-f", ssh / f"host_{name}"], check=True)
        known.append(f"{name},{cluster[name].addr} {(ssh / f'host_{name}.pub').read_text().split(' ')[0]} "
                     f"{(ssh / f'host_{name}.pub').read_text().split(' ')[1]}")
        (ssh / f"sshd_{name}").write_text(
            f"ListenAddress 0.0.0.0\nPort 22\nHostKey {ssh}/host_{name}\n"
            f"AuthorizedKeysFile {ssh}/authorized_keys\nPermitRootLogin prohibit-password\n"
            f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"UseDNS no\nPidFile none\nLogLevel ERROR\nMaxStartups 64\nMaxSessions 64\n"
            f"ClientAliveInterval {SSH_ALIVE_S[0]}\nClientAliveCountMax {SSH_ALIVE_S[1]}\n"
            f"SetEnv HOME={cluster.base}/host/home TMPDIR={cluster.base}/host/tmp LANG=C.UTF-8\n")
    (ssh / "known_hosts").write_text("\n".join(known) + "\n")
    (ssh / "config").write_text(
        f"Host *\n  IdentityFile {ssh}/id\n  IdentitiesOnly yes\n  UserKnownHostsFile {ssh}/known_hosts\n"
        f"  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n  BatchMode yes\n"
        f"  ConnectTimeout 5\n  ServerAliveInterval {SSH_ALIVE_S[0]}\n  ServerAliveCountMax {SSH_ALIVE_S[1]}\n"
        f"  LogLevel ERROR\n")
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {ssh}/config \"$@\"\n")
    wrapper.chmod(0o755)


def write_deepspeed_env(cluster, name: str) -> None:
    """~/.deepspeed_env of a training host: what pdsh does not pass to the other hosts' ranks."""
    keep = ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
            "TORCH_EXTENSIONS_DIR", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    env = host_env(cluster)
    cluster[name].path("home/.deepspeed_env").write_text("".join(f"{k}={env[k]}\n" for k in keep))


def start_sshd(cluster, name: str):
    return cluster[name].spawn(["/usr/sbin/sshd", "-D", "-e", "-f", cluster.base / "ssh" / f"sshd_{name}"],
                               env=host_env(cluster), log="sshd")


# ---- services -----------------------------------------------------------------------------------
def wait_http(host, url: str, timeout: float = 180.0, proc=None) -> None:
    """Wait until `url` answers from `host` (a client inside the host's network)."""
    deadline = time.time() + timeout
    probe = ["python3", "-c", f"import urllib.request; urllib.request.urlopen({url!r}, timeout=2).read()"]
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{host.name}: {proc.args[-6:]} exited: {proc.log.read_text()[-2000:]}")
        if host.run(probe, env={"PATH": "/usr/bin:/bin"}, check=False, timeout=30).returncode == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{host.name}: {url} did not answer within {timeout:.0f} s")


def start_ctl(cluster) -> None:
    """The S3 endpoint (moto behind tests/cluster/s3_proxy.py, with the bucket) and the Prefect
    server on ctl."""
    ctl, env = cluster["ctl"], host_env(cluster)
    moto = ctl.spawn([VENV_BIN / "moto_server", "-H", "127.0.0.1", "-p", MOTO_PORT],
                     env={k: v for k, v in env.items() if not k.startswith("AWS_")}, log="s3")
    ctl.spawn([sys.executable, Path(__file__).with_name("s3_proxy.py"), S3_PORT, MOTO_PORT, OUTAGE_S,
               outage_control(cluster)], env=env, log="s3-proxy")
    server = ctl.spawn([PREFECT, "server", "start", "--host", "0.0.0.0", "--port", API_PORT],
                       env=env, log="prefect-server")
    wait_http(ctl, f"http://ctl:{S3_PORT}/moto-api/", proc=moto)
    ctl.run(["python", "-c", f"import s3fs; s3fs.S3FileSystem().mkdir({BUCKET!r})"], env=env)
    wait_http(ctl, f"http://ctl:{API_PORT}/api/health", proc=server)


def outage_control(cluster) -> Path:
    """The file that starts an S3 outage (tests/cluster/s3_proxy.py)."""
    return cluster.base / "run" / "s3-outage"


def prefect(cluster, *args, host: str = "ctl", timeout: float = 300, check: bool = True):
    return cluster[host].run([PREFECT, *args], env=host_env(cluster), cwd=REPO, timeout=timeout, check=check)


def deploy(cluster) -> None:
    for pool in sorted(set(POOLS.values())):
        prefect(cluster, "work-pool", "create", pool, "--type", "process", "--overwrite")
    prefect(cluster, "deploy", "--name", "tiny-cpu", "--name", "rollout", "--name", "update")


def start_worker(cluster, name: str):
    return cluster[name].spawn([PREFECT, "worker", "start", "--pool", POOLS[name], "--type", "process",
                                "--name", f"{name}-worker"], env=host_env(cluster), log="worker", cwd=REPO)


def wait_workers(cluster, names, timeout: float = 120.0) -> None:
    """Until the server lists each host's worker as online."""
    deadline = time.time() + timeout
    want = {f"{n}-worker" for n in names}
    online: set = set()
    while time.time() < deadline:
        got = cluster["ctl"].run(["python", "-c", WORKERS_ONLINE], env=host_env(cluster), check=False)
        online = set(json.loads(got.stdout or "[]")) & want if got.returncode == 0 else set()
        if online == want:
            return
        time.sleep(1)
    raise RuntimeError(f"workers not online within {timeout:.0f} s: {sorted(want - online)}")


WORKERS_ONLINE = """
import json
from prefect import get_client
names = []
with get_client(sync_client=True) as c:
    for pool in ("cpu", "inference", "training"):
        names += [w.name for w in c.read_workers_for_work_pool(pool) if str(w.status).endswith("ONLINE")]
print(json.dumps(names))
"""


def check_ssh(cluster) -> None:
    """pdsh over ssh from trn1 to both training hosts, as DeepSpeed's launcher will run it."""
    env = host_env(cluster, PDSH_RCMD_TYPE="ssh")
    out = cluster["trn1"].run(["pdsh", "-S", "-w", ",".join(TRAINING), "hostname; echo $TMPDIR"], env=env,
                              timeout=60)
    lines = sorted(out.stdout.split("\n"))
    for name in TRAINING:
        assert f"{name}: {name}" in lines, out.stdout + out.stderr
