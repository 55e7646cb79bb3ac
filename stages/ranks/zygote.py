"""A fork server for a run's CPU worker processes: one Python imports torch, transformers and
DeepSpeed once, and the rank pool's ranks and the hf rollout workers are forked from it instead of
each starting a fresh interpreter that imports them again.

    spawner = Zygote.start()                          # owned by the run's session (stages.session)
    proc = spawner.popen("stages.ranks.server:main", [work_dir, "cpu", pid], env, stdout=f, stderr=f)
    proc.poll(), proc.wait(timeout), proc.kill()      # as subprocess.Popen's
    group = spawner.popen_group(2, "stages.ranks.server:main", [...], env, ...)   # torchrun's job
    spawner.close()

Why: on the 2-core demo machine a 2-rank run started five Pythons in its first step (torchrun's
launcher, two ranks, two rollout workers), each importing torch (+ transformers, + DeepSpeed):
2-3 s of CPU each, all at once. Forked from one process that did it once, they cost milliseconds.

What a child gets, as from `python -m`: the environment it is given (torch's intra-op threads set
from its OMP_NUM_THREADS: libgomp read the variable when the zygote imported torch), the working
directory, stdin from /dev/null, stdout/stderr on the given files, its own session when asked
(`new_session`, as Popen's start_new_session), the cores asked for (`cpus`; else the server's),
and fds passed to it (their numbers in the child replace "{fd0}", "{fd1}", ... in its arguments). It dies with the zygote (PR_SET_PDEATHSIG), and
the zygote dies with its owner (PDEATHSIG, and its socket's end). Its exit code reaches the owner
through a pipe the zygote writes when it reaps it. A group (`popen_group`) is one forked leader
that forks the ranks with RANK/WORLD_SIZE/MASTER_* set, waits for them and, when one fails, stops
the others and exits with its code (what `torchrun --standalone` does for us on one machine).

Only for CPU work: nothing here initialises CUDA, but a GPU run's processes keep their launchers
(torchrun, DeepSpeed's) and fresh interpreters."""
from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PRELOAD = ("torch", "torch._dynamo", "transformers", "transformers.models.auto.modeling_auto",
           "transformers.generation.utils", "deepspeed", "stages.training.worker", "stages.logprob",
           "stages.engines.hf", "stages.engines.worker", "stages.ranks.server")
ENGINE_PRELOAD = ("torch", "torch._dynamo", "transformers", "transformers.models.auto.modeling_auto",
                  "transformers.generation.utils", "stages.engines.hf", "stages.engines.worker")  # no ranks to fork
# vLLM's import (~9.5 s of CPU on the demo machine) once in the server, not once in each vLLM worker
VLLM_PRELOAD = ("vllm", "vllm.entrypoints.llm", "stages.engines.vllm_engine")
REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_MESSAGE = 1 << 20
MAX_FDS = 16
HANDOVER_ENV = "STAGERL_FORK_SERVER"  # fd:server pid:owner pid (Zygote.hand_over / adopt)


def wanted(cfg: dict, plan: dict) -> bool:
    """Whether a run forks CPU processes: ranks of a pool on this machine (no DeepSpeed launcher)
    or hf rollout workers (more than one replica, or one in its own process:
    stages.engines.in_own_process), in local mode on the CPU, with orchestration.fork_server on."""
    if not _local_cpu(cfg):
        return False
    workers = (cfg["actor_rollout_ref"]["rollout"]["name"] == "hf"
               and (int((plan.get("rollout") or {}).get("num_replicas") or 1) > 1 or hf_own_process(cfg)))
    return bool(forks_ranks(cfg, plan["n_gpus"]) or workers)


def forks_ranks(cfg: dict, world: int) -> bool:
    """Ranks of a pool forked on this machine: two or more, not started by DeepSpeed's launcher."""
    return world > 1 and cfg["trainer"].get("launcher") != "deepspeed"


def forks_one_rank(cfg: dict, plan: dict) -> bool:
    """A one-rank run on this machine's CPU whose rollout engine is a forked worker (`wanted`):
    its rank is forked from the same server too (flows.train.start_rank_pool), not run in the
    flow's process."""
    trainer = cfg["trainer"]
    return (plan["n_gpus"] == 1 and wanted(cfg, plan) and trainer.get("launcher") != "deepspeed"
            and not trainer.get("hostfile"))


def preload(cfg: dict, world: int) -> tuple:
    """What the fork server imports: the ranks' modules when it forks ranks, else the engine's;
    vLLM's too where the rollout engine is vLLM (its CPU workers are then forked as well:
    stages.engines.worker)."""
    modules = PRELOAD if forks_ranks(cfg, world) else ENGINE_PRELOAD
    return modules + VLLM_PRELOAD if cfg["actor_rollout_ref"]["rollout"]["name"] == "vllm" else modules


def engine_cpus(cfg: dict, world: int) -> tuple:
    """The cores the server itself runs on: a pinned rollout engine's
    (`actor_rollout_ref.rollout.cpu_affinity`) when it forks no pool of ranks, only that engine's
    workers (which pin themselves there anyway) and a one-rank pool's rank (forked onto the flow's
    cores: `forks_one_rank`), so that its imports run beside the run's start-up on the engine's
    cores, not on the training's (the first rollout waited ~1.5 s for them); () else."""
    if forks_ranks(cfg, world):
        return ()
    return tuple(int(c) for c in (cfg["actor_rollout_ref"]["rollout"].get("cpu_affinity") or ()))


def hf_own_process(cfg: dict) -> bool:
    """One hf engine in a worker process of its own (stages.engines.in_own_process)."""
    from stages.engines import in_own_process

    return in_own_process(cfg["trainer"].get("staleness"), cfg["actor_rollout_ref"]["rollout"].get("cpu_affinity"))


def _local_cpu(cfg: dict) -> bool:
    trainer, orch = cfg["trainer"], cfg["orchestration"]
    return bool(orch.get("fork_server", True)) and orch["mode"] == "local" and str(trainer["device"]) == "cpu"


def prestart(cfg: dict) -> "Zygote | None":
    """For a launcher (`stagerl train`): start the run's fork server as soon as the config is
    read, before the plan, Prefect and the flow, and offer it to the flow (Zygote.hand_over;
    flows.train adopts it when zygote.wanted). On the config alone: more than one rank on the CPU,
    or an hf engine in its own process. The launcher closes it after the flow (a no-op then: the
    flow's session closed it)."""
    trainer = cfg["trainer"]
    hf_worker = cfg["actor_rollout_ref"]["rollout"]["name"] == "hf" and hf_own_process(cfg)
    world = int(trainer["n_gpus_per_node"]) * int(trainer["nnodes"])
    if not _local_cpu(cfg) or not (forks_ranks(cfg, world) or hf_worker):
        return None
    server = start_for(cfg, world)
    server.hand_over()
    return server


def start_for(cfg: dict, world: int) -> "Zygote":
    """A server for this run: what it imports (`preload`) and the cores it runs on (`engine_cpus`)."""
    return Zygote.start(preload=preload(cfg, world), cpus=engine_cpus(cfg, world))


class Zygote:
    """The owner's handle on the fork server."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, preload: tuple = ()):
        import threading

        self.proc, self.sock = proc, sock
        self.preload = tuple(preload)  # what its children find imported
        self._pending: list = []  # ForkedProcess handles whose reply (pid) has not been read, in order
        self._lock = threading.Lock()

    @classmethod
    def start(cls, preload=PRELOAD, env: dict | None = None, cpus: tuple = ()) -> "Zygote":
        """Start the server; it imports `preload` in the background (the first popen waits).
        `cpus`: the cores it runs on (its children inherit them), else this process's."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if "vllm" in preload:  # vLLM reads some of its settings when imported: its workers' values
            from stages.engines.vllm_engine import import_env

            env = import_env(env)
        proc = subprocess.Popen([sys.executable, "-m", "stages.ranks.zygote_server", str(theirs.fileno()), ",".join(preload)],
                                pass_fds=(theirs.fileno(),), env=env, cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # children get their own
        theirs.close()
        if cpus:
            try:
                os.sched_setaffinity(proc.pid, cpus)
            except OSError:  # a core this machine lacks: the plan names it; the server runs anywhere
                pass
        return cls(proc, ours, preload)

    def hand_over(self) -> None:
        """Offer this server to a run that starts later in this process (`stagerl train` starts
        it before Prefect, so its imports overlap Prefect's start-up): a copy of the socket and
        the pids go in the environment (HANDOVER_ENV) until `adopt` takes them."""
        fd = os.dup(self.sock.fileno())
        self._offered = fd
        os.environ[HANDOVER_ENV] = f"{fd}:{self.proc.pid}:{os.getpid()}"

    @classmethod
    def adopt(cls, preload: tuple = ()) -> "Zygote | None":
        """The server this process was offered (hand_over), taken once; None if there is none,
        it was offered to another process (the variable is inherited, the fd is not) or it died.
        `preload`: what it was started with (both sides derive it from the config: `preload`)."""
        value = os.environ.pop(HANDOVER_ENV, "")
        try:
            fd, pid, owner = (int(x) for x in value.split(":"))
        except ValueError:
            return None
        if owner != os.getpid():
            return None
        sock = socket.socket(fileno=fd)
        server = cls(_Started(pid), sock, preload)
        if not server.alive():
            server.close()
            return None
        return server

    def alive(self) -> bool:
        return self.proc.poll() is None

    def forks_engine(self, spec) -> bool:
        """Whether a rollout worker for `spec` (stages.engines.EngineSpec) is forked from here: an
        hf engine on the CPU, or vLLM's CPU engine without tensor parallelism (its own worker
        processes keep vLLM's start) when this server imported vLLM."""
        if spec.device != "cpu" or not self.alive():
            return False
        return spec.engine == "hf" or (spec.engine == "vllm" and "vllm" in self.preload
                                       and int(spec.setting("tensor_model_parallel_size") or 1) == 1)

    def popen(self, target: str, args: list, env: dict, stdout=None, stderr=None, pass_fds=(), cwd=None,
              new_session: bool = False, group: dict | None = None, cpus=None) -> "ForkedProcess":
        """Fork `target` ("module:function", called with `args`; its return value is the exit
        code) with `env`; stdout/stderr: open files (None: the zygote's); `cpus`: the cores it
        runs on (None: the server's, which it inherits). Returns at once, also
        while the zygote still imports: the handle learns its pid when it is first needed. It
        runs in `cwd`, by default the caller's working directory, as every process a run starts
        on its host: relative paths in the config (storage.root, custom_reward_function.path)
        mean the same in all of them."""
        request = {"target": target, "args": [str(a) for a in args], "env": dict(env),
                   "cwd": str(cwd or os.getcwd()), "new_session": bool(new_session), "group": group,
                   "cpus": sorted(int(c) for c in cpus) if cpus else None,
                   "n_pass": len(pass_fds), "has_out": stdout is not None, "has_err": stderr is not None}
        fds = [f.fileno() for f in (stdout, stderr) if f is not None] + [int(fd) for fd in pass_fds]
        with self._lock:
            try:
                socket.send_fds(self.sock, [pickle.dumps(request)], fds)
            except OSError as exc:
                raise RuntimeError(f"the fork server (pid {self.proc.pid}) is gone: {exc}") from None
            handle = ForkedProcess(self, target)
            self._pending.append(handle)
        return handle

    def resolve(self, handle: "ForkedProcess", block: bool = True) -> bool:
        """Read the zygote's replies (pids, in request order) until `handle` has its own;
        block=False: only those already there. True when `handle` is resolved."""
        with self._lock:
            while handle._pid is None:
                if not block and not select.select([self.sock], [], [], 0)[0]:
                    return False
                try:
                    data, got, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
                except OSError:
                    data, got = b"", []
                if not data:
                    raise RuntimeError(f"the fork server (pid {self.proc.pid}) exited (code {self.proc.poll()}) "
                                       f"before it started {handle.target}")
                self._pending.pop(0)._started(pickle.loads(data)["pid"], got[0])
            return True

    def popen_group(self, world: int, target: str, args: list, env: dict, master_port: int, **kw) -> "ForkedProcess":
        """`world` ranks of `target` on this machine under one leader (torchrun's role)."""
        return self.popen(target, args, env, group={"world": int(world), "master_port": int(master_port)}, **kw)

    def close(self) -> None:
        offered = getattr(self, "_offered", None)
        if offered is not None and os.environ.get(HANDOVER_ENV, "").startswith(f"{offered}:"):
            os.environ.pop(HANDOVER_ENV)  # never adopted: our copy of the socket is still ours
            os.close(offered)
        try:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # the server sees its end, whoever else holds a copy
            except OSError:
                pass
            self.sock.close()
        finally:
            try:  # idle, it exits at once; still importing its preload it cannot: nothing to lose
                self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _Started:
    """Popen's poll/wait/kill for an adopted server (started, and reaped, by another handle of
    this process)."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return 0
        return 0 if state in ("Z", "X") else None

    def wait(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork server pid {self.pid}", timeout)
            time.sleep(0.02)
        return 0

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ForkedProcess:
    """subprocess.Popen's interface for a process the zygote forked (it is the zygote's child, so
    its exit code comes through a pipe the zygote writes when it reaps it)."""

    def __init__(self, zygote: Zygote, target: str):
        self.zygote, self.target = zygote, target
        self._pid, self.returncode, self._status = None, None, None

    def _started(self, pid: int, status_fd: int) -> None:
        self._pid, self._status = pid, status_fd
        os.set_blocking(status_fd, False)

    @property
    def pid(self) -> int | None:
        """The child's pid (waits for the zygote to fork it)."""
        if self._pid is None:
            self.zygote.resolve(self)
        return self._pid

    def poll(self):
        if self._pid is None and not self.zygote.resolve(self, block=False):
            if self.zygote.alive():
                return None  # being forked (the zygote may still import)
            self.zygote.resolve(self)  # raises: the zygote is gone
        if self.returncode is None:
            try:
                data = os.read(self._status, 64)
            except BlockingIOError:
                return None
            if data:
                self.returncode = int(data.decode())
            elif self._gone():  # the zygote died without reporting: the child died with it
                self.returncode = -signal.SIGKILL
            else:
                return None
            os.close(self._status)
        return self.returncode

    def wait(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self._pid} ({self.target})", timeout)
            if self._status is not None:
                select.select([self._status], [], [], 0.05)
            else:
                time.sleep(0.05)
        return self.returncode

    def _gone(self) -> bool:
        try:
            os.kill(self.pid, 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False

    def send_signal(self, sig) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---- the server ---------------------------------------------------------------------------------
