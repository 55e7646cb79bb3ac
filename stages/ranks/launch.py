"""Running a stage's `rank_main(ctx, rank, world)` on N ranks (logprob, update).

    results = run_ranks("stages.logprob", ctx, world=2)     # [rank 0's return value, rank 1's, ...]

- world == 1: called in this process (a launch costs 6-13 s on CPU; single-rank jobs skip it).
  `init_distributed` then makes a one-process group on a free port if a rank needs one. Unless
  the context's session has a one-rank pool (forked from the run's fork server where the rollout
  engine is a forked worker too: flows.train.start_rank_pool): the job is submitted there.
- world > 1 with a rank pool of that world and device in the context's session
  (`ctx.session.rank_pool`, stages.session), started as trainer.launcher says (torchrun: on this
  machine; deepspeed: over the same trainer.hostfile, its ranks on several machines): the job is
  submitted to the pool's long-lived ranks (no launch, no re-import, the update engine kept
  between steps).
- world > 1 otherwise, by trainer.launcher (read from the StageContext, or passed in):
  * torchrun (one machine):
        python -m torch.distributed.run --standalone --nproc_per_node=W \\
            -m stages.ranks.entry <module> <ctx.json> <device>
  * deepspeed (DeepSpeed's launcher over trainer.hostfile, `host slots=N` per line; without a
    hostfile a one-line `localhost slots=W` file is written):
        <venv>/bin/deepspeed --hostfile H --master_addr A --master_port P --no_local_rank \\
            --log_level warning [--no_ssh_check] [--num_gpus G] --module stages.ranks.entry <module> <ctx.json> <device>
    One host: DeepSpeed's local launcher (no ssh; --no_ssh_check, master 127.0.0.1). Several hosts:
    pdsh over ssh starts `deepspeed.launcher.launch` on each, in this checkout's path with this
    venv's python (both must exist at the same paths on every host); the master is the hostfile's
    first host (or $STAGERL_MASTER_ADDR), and this machine must be one of the hosts. A world
    smaller than the hostfile's slots uses world ÷ hosts slots per host (--num_gpus).
  A multi-host launch whose pdsh session to a host fails (its ranks failed or were killed there, or
  ssh lost the host: ServerAliveInterval x ServerAliveCountMax without an answer) is stopped at
  once and the error names the host.
  Both run with OMP_NUM_THREADS=1 and TORCH_EXTENSIONS_DIR passed on (DeepSpeed's prebuilt ops);
  with pdsh only PYTHON*, UCX*, MV2*, MLFLOW* (and NCCL* on GPU) variables reach other hosts
  (put others, e.g. OMP_NUM_THREADS, in ~/.deepspeed_env or ./.deepspeed_env, `KEY=value` lines).

The ranks (stages.ranks.entry) share ctx.json over the process group (ranks on other hosts need no
copy of it), and rank 0 (the lowest rank that has ctx.json) gathers every rank's return value and
writes results.json beside it. A failing rank writes error_<rank>.txt there when the folder is on
its machine and always prints its traceback to stderr (relayed by the launcher, by pdsh from other
hosts); the launcher then stops the other ranks and run_ranks raises RuntimeError with the
tracebacks and the tail of the launcher's stderr. The ranks' stdout is relayed to this process's.
`LAST_LAUNCH` records the last launch's launcher and command line.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stages.ranks.procs import REPO_ROOT, context_payload, dead_rank, free_port, job_error, kill_group
from stages.scratch import scratch_prefix

STDERR_TAIL = 4000
LAUNCHERS = ("torchrun", "deepspeed")
RESULTS_FILE = "results.json"  # every rank's return value, written by rank 0 (stages.ranks.entry)
IN_PROCESS_PREPARE = "one-rank update set-up"  # a RunSession background job run_ranks waits for at world 1
MASTER_ADDR_ENV = "STAGERL_MASTER_ADDR"  # overrides the hostfile's first host as the rendezvous address
LAST_LAUNCH: dict = {}  # {"launcher", "cmd", "world"} of the last launch in this process


def run_ranks(module: str, ctx, world: int, device: str = "cpu", timeout_s: float = 1800,
              launcher: str | None = None, hostfile: str | None = None) -> list:
    """Run `module.rank_main(ctx, rank, world)` on `world` ranks; their return values by rank.
    launcher / hostfile default to the context's trainer.launcher / trainer.hostfile."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    session = getattr(ctx, "session", None)
    pool = getattr(session, "rank_pool", None)
    if world == 1:
        if pool is not None and pool.world == 1 and pool.device == str(device):
            session.compute_starts()  # this process waits while the rank computes
            return pool.submit(module, ctx, timeout_s=timeout_s)
        if session is not None:  # the run's one-rank set-up ahead (flows.train prepare_update)
            session.join_background(IN_PROCESS_PREPARE)
        mod = importlib.import_module(module)
        return [mod.rank_main(ctx, 0, 1)]
    launcher = launcher or _ctx_value(ctx, "trainer.launcher") or "torchrun"
    hostfile = hostfile if hostfile is not None else _ctx_value(ctx, "trainer.hostfile")
    if launcher not in LAUNCHERS:
        raise ValueError(f"trainer.launcher={launcher!r} is not one of {list(LAUNCHERS)}")
    if launcher == "torchrun" and hostfile is not None:
        raise ValueError(f"trainer.hostfile={hostfile} is read by DeepSpeed's launcher only; "
                         f"set trainer.launcher=deepspeed")
    pool_hostfile = getattr(pool, "hostfile", None)
    if (pool is not None and pool.world == world and pool.device == str(device)
            and (pool_hostfile is None if launcher == "torchrun" else
                 pool_hostfile is not None and str(pool_hostfile) == str(hostfile))):
        session.compute_starts()  # this process waits while the ranks compute
        return pool.submit(module, ctx, timeout_s=timeout_s)
    if session is not None:
        session.compute_starts()  # this process waits while the launched ranks compute
    with tempfile.TemporaryDirectory(prefix=scratch_prefix("ranks")) as tmp_name:
        tmp = Path(tmp_name)
        ctx_file = tmp / "ctx.json"
        payload = context_payload(ctx)
        payload["device"] = device
        ctx_file.write_text(json.dumps(payload))
        entry = ["stages.ranks.entry", module, str(ctx_file), str(device)]
        env = _rank_env()
        if launcher == "deepspeed":
            cmd = deepspeed_command(entry, world, hostfile, tmp, free_port())
        else:
            env["MASTER_PORT"] = str(free_port())
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                   "-m"] + entry
        LAST_LAUNCH.clear()
        LAST_LAUNCH.update(launcher=launcher, cmd=list(cmd), world=world)
        out_f, err_f = tmp / "stdout.txt", tmp / "stderr.txt"
        with out_f.open("wb") as out, err_f.open("wb") as err:
            proc = subprocess.Popen(cmd, cwd=os.getcwd(), env=env, stdout=out, stderr=err,
                                    start_new_session=True)
            rc, lost = _wait_launch(proc, err_f, timeout_s, watch_hosts=launcher == "deepspeed")
            if rc is None:
                raise RuntimeError(f"{module} on {world} ranks ({launcher}) did not finish in {timeout_s} s; "
                                   f"stderr tail:\n{_tail(err_f)}") from None
            if lost:
                host, code = lost
                what = ("was lost: ssh to it ended with exit code 255 (no answer within ssh's "
                        "ServerAliveInterval x ServerAliveCountMax, or the connection failed)" if code == 255
                        else f"ended its launch with exit code {code} (a rank there failed or was killed)")
                message = (f"{module} on {world} ranks (deepspeed over {', '.join(_hosts(cmd))}): host {host} "
                           f"{what}; the launch was stopped on every host.\n--- stderr tail ---\n{_tail(err_f)}")
                if code == 255:
                    raise RuntimeError(message)
                # the ranks' tracebacks (relayed by pdsh): a storage error there stays retryable
                raise job_error(message, [e.read_text() for e in tmp.glob("error_*.txt")] + relayed_errors(err_f))
        sys.stdout.write(_rank_stdout(out_f))
        sys.stdout.flush()
        errors = sorted(tmp.glob("error_*.txt"), key=lambda e: e.stat().st_mtime)  # first failure first
        if rc != 0 or errors:
            detail = "".join(f"--- {e.stem.replace('_', ' ')} ---\n{e.read_text()[-STDERR_TAIL:]}\n"
                             for e in errors)
            died = dead_rank(err_f.read_text(errors="replace")) if err_f.exists() else None
            raise job_error(f"{module} failed on {world} ranks ({launcher}, exit code {rc})"
                            f"{': ' + died if died else ''}.\n{detail}"
                            f"--- stderr tail ---\n{_tail(err_f)}", [e.read_text() for e in errors])
        results_file = tmp / RESULTS_FILE
        if not results_file.exists():
            raise RuntimeError(f"{module}: the ranks exited without {RESULTS_FILE}; stderr tail:\n{_tail(err_f)}")
        results = json.loads(results_file.read_text())
        if len(results) != world:
            raise RuntimeError(f"{module}: {len(results)} results from {world} ranks")
        return results


PDSH_EXIT = re.compile(r"pdsh@[^:\s]+: ([^:\s]+): ssh exited with exit code (\d+)")


def _wait_launch(proc, err_path: Path, timeout_s: float, watch_hosts: bool):
    """(exit code or None on timeout, (host, ssh exit code) of the first host whose pdsh session
    ended in failure, or None). A multi-host DeepSpeed launch is stopped as soon as one host's
    session fails (pdsh says so on stderr): the ranks elsewhere would otherwise wait for it in a
    collective until the process group's timeout."""
    deadline, offset = time.monotonic() + timeout_s, 0
    while True:
        try:
            rc = proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            rc = None
        if watch_hosts and err_path.exists():
            with err_path.open("rb") as f:
                f.seek(offset)
                new = f.read()
            cut = new.rfind(b"\n") + 1
            offset += cut
            found = PDSH_EXIT.search(new[:cut].decode(errors="replace"))
            if found and int(found.group(2)) != 0:
                kill_group(proc)  # DeepSpeed's runner stops the launch on every host it reaches
                return proc.poll(), (found.group(1), int(found.group(2)))
        if rc is not None:
            return rc, None
        if time.monotonic() > deadline:
            kill_group(proc)
            return None, None


RANK_FAILED = re.compile(r"stagerl rank \d+ of \d+ \([^)]*\) failed:")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")


def relayed_errors(err_path: Path) -> list[str]:
    """The exception line of each rank traceback in a launch's stderr (other hosts' relayed by
    pdsh as `host: line`), for job_error's storage-or-not decision."""
    text = err_path.read_text(errors="replace") if err_path.exists() else ""
    lines = [re.sub(r"^[\w.-]+: ", "", line) for line in text.splitlines()]
    out, block = [], None
    for line in lines:
        if RANK_FAILED.search(line):
            if block:
                out.append(block)
            block = ""
        elif block is not None and EXCEPTION_LINE.match(line):
            block = line  # the last exception line of this rank's traceback
    if block:
        out.append(block)
    return out


def _hosts(cmd: list) -> list:
    from configs.plan import read_hostfile

    try:
        return list(read_hostfile(cmd[cmd.index("--hostfile") + 1]))
    except (ValueError, IndexError, OSError):
        return ["?"]


def _ctx_value(ctx, key: str):
    """A config value of a StageContext (None for a plain JSON context)."""
    from stages.context import StageContext

    return ctx.get(key) if isinstance(ctx, StageContext) else None


def _rank_env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def deepspeed_command(entry: list, world: int, hostfile, work_dir: Path, master_port: int) -> list:
    """DeepSpeed's launcher (deepspeed.launcher.runner, 0.19) starting `python -m <entry...>` on
    `world` ranks over `hostfile` (None: `localhost slots=world`, written into work_dir)."""
    from configs.plan import read_hostfile

    if hostfile is None:
        hostfile = Path(work_dir) / "hostfile"
        hostfile.write_text(f"localhost slots={world}\n")
    hosts = read_hostfile(str(hostfile))
    slots = sum(hosts.values())
    per_host = None
    if world != slots:
        per_host = world // len(hosts)
        if world % len(hosts) or per_host > min(hosts.values()):
            raise ValueError(f"{world} ranks do not fit trainer.hostfile={hostfile} ({slots} slots on "
                             f"{len(hosts)} host(s)) as an equal number of ranks per host")
    first = next(iter(hosts))
    if len(hosts) == 1:
        master = "127.0.0.1"  # one host: DeepSpeed's local launcher, every rank on this machine
    else:
        master = os.environ.get(MASTER_ADDR_ENV) or first
    cmd = [_deepspeed_bin(), "--hostfile", str(Path(os.path.expanduser(str(hostfile))).resolve()),
           "--master_addr", master, "--master_port", str(master_port), "--no_local_rank",
           "--log_level", "warning"]
    if len(hosts) == 1:
        cmd.append("--no_ssh_check")  # the runner would ssh into the host to check it otherwise
    if per_host is not None:
        cmd += ["--num_gpus", str(per_host)]
    return cmd + ["--module"] + list(entry)


def _deepspeed_bin() -> str:
    script = Path(sys.executable).parent / "deepspeed"
    return str(script) if script.exists() else shutil.which("deepspeed") or "deepspeed"


def _rank_stdout(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-STDERR_TAIL:] if path.exists() else ""


RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def forget_inherited_rank_env() -> None:
    """A training flow or stage flow is never a rank: drop rank settings inherited from a parent
    process (one that trained a world-1 update in-process keeps its group's port bound, so reusing
    MASTER_PORT fails with EADDRINUSE). Ranks get theirs from the launcher or the rank pool."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        for name in RANK_ENV:
            os.environ.pop(name, None)


_OWN_PORT: list = []  # the MASTER_PORT init_distributed set in this process (children do not inherit it)


def init_distributed(device: str = "cpu", timeout_s: float | None = None):
    """Initialise torch.distributed for this rank (gloo on CPU, nccl on CUDA), once. Inside a
    torchrun/deepspeed launch the env (RANK, WORLD_SIZE, MASTER_*) is already set; in-process
    (world 1) a one-process group on a free local port is made. `timeout_s`: the collectives'
    timeout (None: torch's default; a multi-node rank pool's idle ranks wait in one).
    Returns (rank, world)."""
    import datetime

    import torch
    import torch.distributed as dist

    from stages.ranks.deepspeed_ops import op_build_env

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    op_build_env()  # DeepSpeed's CPU comm op: the prebuilt one, else built with the environment's ninja
    # a one-process group of our own (no launcher env, or the env an earlier in-process group of
    # this process set: its store may still hold that port): a fresh free port every time
    own_port = "WORLD_SIZE" not in os.environ or os.environ.get("MASTER_PORT") in _OWN_PORT
    if own_port:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    extra = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    if own_port:  # one process: an in-memory store, no port to bind (a TCP store's port can be taken
        # by another process between choosing and binding it: EADDRINUSE); the env stays for DeepSpeed
        _OWN_PORT[:] = [os.environ["MASTER_PORT"]]
        dist.init_process_group(backend="nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, **extra)
    else:
        dist.init_process_group(backend="nccl" if cuda else "gloo", **extra)
    return dist.get_rank(), dist.get_world_size()


def rank_device(device: str = "cpu") -> str:
    """This rank's device string: cuda:LOCAL_RANK on GPU, else cpu."""
    if str(device).startswith("cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
