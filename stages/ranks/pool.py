"""A persistent pool of N ranks: one torchrun job per training run, reused by every N-rank stage
(logprob, update) of every step, instead of one launch (6-13 s + imports + engine set-up) per call.
On one CPU machine with a fork server (stages.ranks.zygote, the run session's `spawner`) the ranks are
forked from it (torch, transformers and DeepSpeed already imported) in place of torchrun. There a
pool may have one rank (`world=1`): a one-rank run whose rollout engine is a forked worker trains
in a rank forked beside it instead of in the flow's process (flows.train.start_rank_pool).

    with RankPool(world=2, device="cpu") as pool:     # starts `stages.ranks.server` under torchrun
        session.rank_pool = pool                        # run_ranks(...) with ctx.session submits to it
        ... steps ...                                   # close() (or the with-exit) stops it
    results = pool.submit("stages.logprob", ctx)        # [rank 0's return value, rank 1's, ...]

- Jobs are files in the pool's work_dir (see stages.ranks.server): submit writes job_<id>.json
  and rings each rank's doorbell (stages.ranks.procs.Doorbell), waits for
  result_<id>_<rank>.json / error_<id>_<rank>.txt of every rank (woken by the `done` doorbell the
  ranks ring, at most WAIT_S between looks), relays the ranks' new stdout lines, and removes the
  job's files. Submits are serialised (a thread lock plus a
  file lock on work_dir/submit.lock, so another process attached by work dir may submit too).
- A failing job raises RuntimeError with the failing rank's traceback; the pool goes on when
  every rank reported. If a rank is stuck (its peer failed before a collective: the others
  did not report within `grace_s`), or frozen (its heartbeat file, touched every 2 s by a
  thread of the rank, is older than `heartbeat_timeout_s`: SIGSTOP, a hang holding the GIL), or
  a job runs past its timeout, or a rank process died (the launcher then stops the others), the
  pool is stopped, the error raised naming the rank, and the next submit starts a fresh pool.
- A run's pool is passed, not found: the training flow sets its session's `rank_pool`
  (stages.session), and stages.ranks.launch.run_ranks submits a context's N-rank jobs there when world
  and device match. Another process may submit to a pool it is given the work dir of
  (RankPool.attach; it cannot restart it).
- close() writes a stop file, waits for the launcher (torchrun or the forked leader) to exit, then kills its process group; an
  atexit hook closes pools left open.
"""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from stages.scratch import scratch_dir
from stages.ranks.procs import REPO_ROOT, Doorbell, context_payload, dead_rank, free_port, job_error, kill_group

ERROR_TAIL = 4000
WAIT_S = 0.05  # the client looks at a job's files (and its ranks' health) at least this often


class RankPool:
    def __init__(self, world: int, device: str = "cpu", work_dir=None, start_timeout_s: float = 600,
                 grace_s: float = 30.0, heartbeat_timeout_s: float = 60.0, hostfile=None, spawner=None,
                 threads: int = 1, cpus=None):
        if world < 2 and spawner is None:
            raise ValueError(f"a rank pool of world {world} needs a fork server to fork its rank from "
                             f"(world 1 otherwise runs in-process)")
        self.world, self.device = int(world), str(device)
        self.hostfile = hostfile  # None: torchrun on this machine; else DeepSpeed's launcher over it
        self.spawner = spawner  # stages.ranks.zygote.Zygote: CPU ranks forked from it instead of torchrun
        self.threads = int(threads)  # each rank's torch threads (OMP_NUM_THREADS)
        self.cpus = tuple(cpus) if cpus else None  # the cores forked ranks run on (None: the server's)
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir else scratch_dir("pool")
        self.start_timeout_s, self.grace_s = start_timeout_s, grace_s
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self.proc: subprocess.Popen | None = None
        self.owner = True
        self.starts = 0  # how many times torchrun was started (restarts after a dead rank count)
        self._lock = threading.Lock()
        self._out_offset = 0
        self._done: Doorbell | None = None  # woken by the ranks when they finish a job

    # ---- life cycle ---------------------------------------------------------------------------
    @classmethod
    def attach(cls, work_dir) -> "RankPool":
        """A client of a pool started by another process (submit only; no restart, no close)."""
        info = json.loads((Path(work_dir) / "pool.json").read_text())
        pool = cls(info["world"], info["device"], work_dir, hostfile=info.get("hostfile"))
        pool.owner, pool._own_dir, pool._pid = False, False, info["pid"]
        return pool

    def __enter__(self) -> "RankPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, wait: bool = True) -> None:
        """Start torchrun with the rank servers and wait until every rank has its process group
        (wait=False: return at once; the first submit waits, so the ranks' start-up overlaps
        whatever the caller does first, e.g. a training run's first rollout)."""

        if not self.owner:
            raise RuntimeError(f"rank pool {self.work_dir} belongs to another process; it cannot be started here")
        if self.alive():
            return
        self._stop_process()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for f in [*self.work_dir.glob("ready_*"), *self.work_dir.glob("heartbeat_*"), self.work_dir / "stop"]:
            f.unlink(missing_ok=True)
        server = ["stages.ranks.server", str(self.work_dir), self.device, str(os.getpid())]
        if self.hostfile is not None:  # pdsh over ssh on every host of the hostfile (stages.ranks.launch)
            from stages.ranks.launch import deepspeed_command

            cmd = deepspeed_command(server + ["--multi-node"], self.world, self.hostfile, self.work_dir, free_port())
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.world}",
                   "-m"] + server
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(self.threads)
        env["MASTER_PORT"] = str(free_port())
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        out = (self.work_dir / "stdout.txt").open("ab")
        err = (self.work_dir / "stderr.txt").open("ab")
        self._out_offset = (self.work_dir / "stdout.txt").stat().st_size
        try:
            self._forked = self.forked()
            if self._forked:  # torchrun's job done by a fork of the run's fork server: no imports
                self.proc = self.spawner.popen_group(self.world, "stages.ranks.server:main", server[1:], env,
                                                     int(env["MASTER_PORT"]), stdout=out, stderr=err,
                                                     new_session=True, cpus=self.cpus)
            else:
                self.proc = subprocess.Popen(cmd, cwd=os.getcwd(), env=env, stdout=out, stderr=err,
                                             start_new_session=True)
        finally:
            out.close()
            err.close()
        self.starts += 1
        self._err_offset = (self.work_dir / "stderr.txt").stat().st_size
        if self._forked:  # a forked group's pid is known once the fork server forked it: wait_ready
            (self.work_dir / "pool.json").unlink(missing_ok=True)
        else:
            self._write_pool_json()
        _OPEN.add(self)
        self._started_at = time.monotonic()
        if wait:
            self.wait_ready()

    def _write_pool_json(self) -> None:
        (self.work_dir / "pool.json").write_text(json.dumps(
            {"pid": self.proc.pid, "world": self.world, "device": self.device, "hostfile": self.hostfile}))

    def forked(self) -> bool:
        """True when the ranks are forked from the fork server (CPU, one machine) instead of torchrun."""
        return (self.spawner is not None and self.hostfile is None and self.device == "cpu"
                and self.spawner.alive())

    def wait_ready(self) -> None:
        """Wait until every rank of the started pool has its process group (or fail naming why)."""
        deadline = getattr(self, "_started_at", time.monotonic()) + self.start_timeout_s
        while not all((self.work_dir / f"ready_{r}").exists() for r in range(self.world)):
            if self.proc.poll() is not None:
                raise RuntimeError(f"rank pool did not start (launcher exit code {self.proc.returncode}); "
                                   f"stderr tail:\n{self._stderr_tail()}")
            if time.monotonic() > deadline:
                waiting, blocked = self.not_ready()
                for pid in blocked:  # first: torchrun would wait for a stopped rank to act on its TERM
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self._stop_process()
                raise RuntimeError(f"rank pool: {waiting} not ready {self.start_timeout_s:g} s after the start "
                                   f"(orchestration.rank_start_timeout_s): blocked in its set-up (imports, "
                                   f"the process group with its peers); the pool was stopped. "
                                   f"stderr tail:\n{self._stderr_tail()}")
            time.sleep(0.05)
        if not (self.work_dir / "pool.json").exists():
            self._write_pool_json()

    def not_ready(self) -> tuple[str, list]:
        """The ranks without their ready file, named: "rank 1 (pid P, host H, process state T
        (stopped))" (the pid of a rank process found under the launcher on this machine), and
        their pids."""
        pids = self._launcher_ranks()
        host = socket.gethostname()
        named, blocked = [], []
        for rank in range(self.world):
            if (self.work_dir / f"ready_{rank}").exists():
                continue
            pid = pids.get(rank)
            blocked += [pid] if pid else []
            named.append(f"rank {rank} (pid {pid}, host {host}, process state {process_state(pid)})" if pid
                         else f"rank {rank} (host {host if self.hostfile is None else 'of ' + str(self.hostfile)})")
        return ", ".join(named) or "no rank", blocked

    def _launcher_ranks(self) -> dict:
        """launcher_ranks of this pool's launcher ({} for a multi-node one or none started)."""
        if self.proc is None or self.hostfile is not None:
            return {}
        pid = self.proc._pid if hasattr(self.proc, "_pid") else self.proc.pid  # a fork not made yet: None
        return launcher_ranks(pid) if pid else {}

    def alive(self) -> bool:
        if not self.owner:
            try:
                os.kill(self._pid, 0)
                return True
            except ProcessLookupError:
                return False
        return self.proc is not None and self.proc.poll() is None

    def rank_pids(self) -> list[int]:
        """PIDs of the rank processes on this machine (from their ready files; a rank on another
        machine of a multi-node pool has "remote HOST PID" there)."""
        pids = []
        for r in range(self.world):
            path = self.work_dir / f"ready_{r}"
            text = path.read_text().strip() if path.exists() else ""
            if text.isdigit() and int(text) > 1:
                pids.append(int(text))
        return pids

    def close(self, timeout_s: float = 30) -> None:
        """Stop the ranks (stop file, then the process group) and remove a work dir made here."""
        if self._done is not None:  # a submit that runs after this makes it again
            self._done.close()
            self._done = None
        if not self.owner:
            return
        self._join_background()
        if self.proc is not None and self.proc.poll() is None:
            (self.work_dir / "stop").write_text("")
            self._ring_ranks()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self._stop_process()
        _OPEN.discard(self)
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def _ring_ranks(self) -> None:
        for rank in range(self.world):
            Doorbell.ring(self.work_dir / f"wake_{rank}")

    def _stop_process(self) -> None:

        if self.proc is not None:
            started = self._launcher_ranks() if self.proc.poll() is None else {}  # ready or not yet
            ranks = set(self.rank_pids()) | set(started.values())
            kill_group(self.proc)  # also reaps ranks left in the session after torchrun exited
            self.proc = None
            for pid in ranks:  # torchrun runs each rank in its own process group: a stopped
                try:           # (SIGSTOP) rank never acts on the TERM torchrun sends it
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # ---- jobs ---------------------------------------------------------------------------------
    def submit_background(self, module: str, ctx, timeout_s: float = 1800) -> None:
        """submit() in a thread, for work that may overlap what the caller does next (a run's
        first DeepSpeed set-up while its first rollout samples). The next submit waits for it;
        its failure is only printed (the job it prepared is then done by the next one)."""
        def run():
            try:
                self.submit(module, ctx, timeout_s)
            except Exception as exc:  # noqa: BLE001 - see the docstring
                print(f"rank pool: background job {module} failed ({type(exc).__name__}: {exc}); "
                      f"the next job does its work", file=sys.stderr, flush=True)

        self._join_background()
        self._background = threading.Thread(target=run, name=f"pool-{module}", daemon=True)
        self._background.start()

    def _join_background(self) -> None:
        thread = getattr(self, "_background", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
            self._background = None

    def submit(self, module: str, ctx, timeout_s: float = 1800) -> list:
        """Run `module.rank_main(ctx, rank, world)` on every rank of the pool; results by rank."""

        self._join_background()
        payload = context_payload(ctx)
        payload["device"] = self.device
        with self._lock, (self.work_dir / "submit.lock").open("a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            if not self.alive():
                if not self.owner:
                    raise RuntimeError(f"rank pool {self.work_dir} is not running (its owner must restart it)")
                if self.starts:
                    print(f"rank pool: ranks are gone (last stderr:\n{self._stderr_tail()[-800:]}); restarting",
                          file=sys.stderr, flush=True)
                self.start()
            elif self.owner:
                self.wait_ready()
            next_file = self.work_dir / "next_id"
            job_id = int(next_file.read_text()) if next_file.exists() else 0
            next_file.write_text(str(job_id + 1))
            job = self.work_dir / f"job_{job_id}.json"
            tmp = self.work_dir / f".job_{job_id}.json.tmp"
            tmp.write_text(json.dumps({"module": module, "payload": payload}))
            if self._done is None:  # before the job exists: its ranks ring it when they finish
                self._done = Doorbell(self.work_dir / "done")
            os.replace(tmp, job)
            self._ring_ranks()
            try:
                return self._collect(module, job_id, timeout_s)
            finally:
                self._relay_stdout()
                for f in [job] + [self.work_dir / f"{kind}_{job_id}_{r}.{ext}" for r in range(self.world)
                                  for kind, ext in (("result", "json"), ("error", "txt"))]:
                    f.unlink(missing_ok=True)

    def _collect(self, module: str, job_id: int, timeout_s: float) -> list:
        results = [self.work_dir / f"result_{job_id}_{r}.json" for r in range(self.world)]
        errors = [self.work_dir / f"error_{job_id}_{r}.txt" for r in range(self.world)]
        deadline = time.monotonic() + timeout_s
        first_error, last_beat_check = None, time.monotonic()
        while True:
            done = [res.exists() or err.exists() for res, err in zip(results, errors)]
            if all(done):
                break
            if any(e.exists() for e in errors) and first_error is None:
                first_error = time.monotonic()
            stuck = first_error is not None and time.monotonic() - first_error > self.grace_s
            late = time.monotonic() > deadline
            frozen = lost = None
            if time.monotonic() - last_beat_check > 1.0:
                frozen, lost, last_beat_check = self.frozen_rank(), self.lost_host(), time.monotonic()
            dead = not self.alive() or lost
            if stuck or dead or late or frozen:
                why = ("a rank failed and the others did not finish within "
                       f"{self.grace_s} s (waiting in a collective?)" if stuck else
                       lost if lost else self.dead_rank() if dead else frozen if frozen else
                       f"the job did not finish in {timeout_s} s")
                detail = self._error_detail(errors)
                if self.owner:
                    self._stop_process()  # the next submit starts a fresh pool
                message = (f"{module} on the rank pool ({self.world} ranks): {why}; the pool was "
                           f"stopped and restarts on the next job.\n{detail}"
                           f"--- pool stderr tail ---\n{self._stderr_tail()}")
                if self.hostfile is None or (lost and "exit code 255" in lost):
                    raise RuntimeError(message)
                from stages.ranks.launch import relayed_errors  # a rank's storage error elsewhere stays retryable

                raise job_error(message, [e.read_text() for e in errors if e.exists()] +
                                relayed_errors(self.work_dir / "stderr.txt"))
            self._done.wait(WAIT_S)
        if any(e.exists() for e in errors):
            raise job_error(f"{module} failed on the rank pool ({self.world} ranks).\n{self._error_detail(errors)}",
                            [e.read_text() for e in errors if e.exists()])
        return [json.loads(res.read_text()) for res in results]

    def lost_host(self) -> str | None:
        """A multi-node pool: the host whose pdsh session ended with an error since the start."""
        if self.hostfile is None:
            return None
        from stages.ranks.launch import PDSH_EXIT

        path = self.work_dir / "stderr.txt"
        if not path.exists():
            return None
        with path.open("rb") as f:
            f.seek(getattr(self, "_err_offset", 0))
            found = PDSH_EXIT.search(f.read().decode(errors="replace"))
        if found and int(found.group(2)) != 0:
            return f"host {found.group(1)}'s ranks ended (pdsh: ssh exited with exit code {found.group(2)})"
        return None

    def dead_rank(self) -> str:
        """Which rank process died: "rank R (pid P, host H) died (killed by SIGKILL)", as its
        launcher (torchrun, the forked group's leader) reported the first failure on stderr; else
        the ranks that were running (their pids and host)."""
        path = self.work_dir / "stderr.txt"
        text = ""
        if path.exists():
            with path.open("rb") as f:
                f.seek(getattr(self, "_err_offset", 0))
                text = f.read().decode(errors="replace")
        found = dead_rank(text)
        if found:
            return found
        running = ", ".join(f"rank {r} pid {pid}" for r, pid in enumerate(self._ready_pids()) if pid)
        return f"a rank process died ({running or 'no rank was ready'}; host {socket.gethostname()})"

    def _ready_pids(self) -> list:
        out = []
        for r in range(self.world):
            path = self.work_dir / f"ready_{r}"
            out.append(path.read_text().strip() if path.exists() else None)
        return out

    def frozen_rank(self) -> str | None:
        """Why a rank counts as frozen (its heartbeat older than heartbeat_timeout_s), or None."""
        now = time.time()
        for rank in range(self.world):
            beat = self.work_dir / f"heartbeat_{rank}"
            try:
                age = now - beat.stat().st_mtime
                pid = int((self.work_dir / f"ready_{rank}").read_text())
            except (FileNotFoundError, ValueError):
                continue  # not started yet: wait_ready covers the start
            if age > self.heartbeat_timeout_s:
                return (f"rank {rank} (pid {pid}, process state {process_state(pid)}) sent no heartbeat "
                        f"for {age:.0f} s (timeout {self.heartbeat_timeout_s:.0f} s): frozen "
                        f"(SIGSTOP?) or hung")
        return None

    def _error_detail(self, errors) -> str:
        return "".join(f"--- error rank {r} ---\n{e.read_text()[-ERROR_TAIL:]}\n"
                       for r, e in enumerate(errors) if e.exists())

    def _relay_stdout(self) -> None:
        path = self.work_dir / "stdout.txt"
        if not self.owner or not path.exists():
            return
        with path.open("rb") as f:
            f.seek(self._out_offset)
            data = f.read()
        self._out_offset += len(data)
        if data:
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()

    def _stderr_tail(self) -> str:
        path = self.work_dir / "stderr.txt"
        return path.read_text(errors="replace")[-ERROR_TAIL:] if path.exists() else ""


def launcher_ranks(launcher_pid: int) -> dict:
    """{rank: pid} of the rank processes a launcher on this machine started: its child processes
    (torchrun's, or a forked group leader's), each rank read from its RANK environment variable,
    else (forked children keep the leader's environment block) from their order."""
    children = []
    for task in sorted(Path(f"/proc/{launcher_pid}/task").glob("*")):  # a child of any of its threads
        try:
            children += [int(p) for p in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    out = {}
    for i, pid in enumerate(children):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), i)
        except (OSError, ValueError):
            rank = i
        out.setdefault(rank, pid)
    return out


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat with its meaning (T: stopped), or "unknown"."""
    names = {"R": "running", "S": "sleeping", "D": "disk sleep", "T": "stopped", "t": "traced",
             "Z": "zombie", "X": "dead"}
    try:
        letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"
    return f"{letter} ({names.get(letter, '?')})"


_OPEN: set = set()


@atexit.register
def _close_open_pools() -> None:
    for pool in list(_OPEN):
        pool.close(timeout_s=10)
