"""One rank of a persistent rank pool (stages.ranks.pool.RankPool starts it under torchrun):

    python -m torch.distributed.run --standalone --nproc_per_node=W -m stages.ranks.server <work_dir> <device> <owner_pid>
    deepspeed --hostfile H ... --module stages.ranks.server <work_dir> <device> <owner_pid> --multi-node

With --multi-node (a pool over a hostfile) ranks on machines that do not see work_dir are served
by the leader through collectives (serve_multi); when every rank sees it, as below.

Each rank initialises the process group once (gloo on CPU, nccl on CUDA), writes ready_<rank>,
then serves jobs in order: job_<id>.json in work_dir (written atomically by the client) holds
{"module", "payload"}; every rank reads the same file, runs `<module>.rank_main(ctx, rank, world)`
(stages.ranks.entry.run_job) and writes result_<id>_<rank>.json or error_<id>_<rank>.txt (its
traceback). Ranks watch the folder instead of blocking in a broadcast, so an idle pool holds no
pending collective (no gloo/NCCL timeout between steps, no spinning GPU kernel): a rank waits on
its doorbell wake_<rank> (stages.ranks.procs.Doorbell, a named pipe the client rings after writing
a job or the stop file), at most WAIT_S between looks at the folder, and rings `done` after
writing its result or error, which wakes the client. A `stop` file,
or the owner process disappearing, ends the loop. A thread touches heartbeat_<rank> every
HEARTBEAT_S; a rank whose heartbeat stops (frozen by SIGSTOP, swapped out, hung with the GIL held)
is reported by the client within its heartbeat timeout instead of at the job timeout. After each job the rank frees what the job
left (gc, CUDA cache) and freezes what survives (gc.freeze): a full collection scans the ~500 k
objects of torch/transformers/DeepSpeed and took 0.3-0.6 s per job, which delayed the next job;
after the freeze only new objects are scanned. Stages may keep state across jobs on purpose (the
update engine); one that drops such state calls gc.unfreeze() first so its cycles are collected.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

from stages.ranks.procs import Doorbell

HEARTBEAT_S = 2.0  # seconds between a rank's heartbeat touches
WAIT_S = 0.2  # an idle rank looks at the folder at least this often (a ring wakes it at once)


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def serve(work: Path, device: str, owner_pid: int, multi_node: bool = False) -> int:
    from stages.ranks.launch import destroy_distributed, init_distributed
    from stages.ranks.entry import launcher_ranks, run_job
    from stages.session import RunSession

    session = RunSession()  # what stages keep in this rank between jobs (the update's engines)
    rank, world = init_distributed(device, timeout_s=IDLE_TIMEOUT_S if multi_node else None)
    if multi_node:
        sees = launcher_ranks(work.is_dir())
        if not all(sees):  # ranks on other machines: see serve_multi
            try:
                return serve_multi(work, device, owner_pid, rank, world, sees, session)
            finally:
                session.close()
                destroy_distributed()
    next_file = work / "next_id"  # read before "ready": the client writes it only once all are ready
    job_id = int(next_file.read_text()) if next_file.exists() else 0
    bell = Doorbell(work / f"wake_{rank}")  # made before "ready": a job written after it rings it
    _start_heartbeat(work / f"heartbeat_{rank}")
    _write_atomic(work / f"ready_{rank}", str(os.getpid()))
    _preload()
    last_owner_check = time.monotonic()
    try:
        while True:
            job_file = work / f"job_{job_id}.json"
            if not job_file.exists():
                if (work / "stop").exists():
                    return 0
                if time.monotonic() - last_owner_check > 1.0:
                    if not _owner_alive(owner_pid):
                        print(f"rank pool: owner process {owner_pid} is gone; rank {rank} exits",
                              file=sys.stderr, flush=True)
                        return 0
                    last_owner_check = time.monotonic()
                bell.wait(WAIT_S)
                continue
            job = json.loads(job_file.read_text())
            try:
                result = run_job(job["module"], job["payload"], rank, world, session)
                _write_atomic(work / f"result_{job_id}_{rank}.json", json.dumps(result))
            except BaseException:  # noqa: BLE001 - reported to the client, the pool goes on
                text = traceback.format_exc()
                print(text, file=sys.stderr, flush=True)
                _write_atomic(work / f"error_{job_id}_{rank}.txt", text)
            finally:
                Doorbell.ring(work / "done")
                result = None
                job = None
                sys.stdout.flush()
                gc.collect()  # what the job left in cycles; then nothing alive now is scanned again
                gc.freeze()
                _empty_device_cache(device)
            job_id += 1
    finally:
        bell.close()
        session.close()
        destroy_distributed()


IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # a multi-node pool's idle ranks wait in a broadcast this long at most


def serve_multi(work: Path, device: str, owner_pid: int, rank: int, world: int, sees: list, session) -> int:
    """The pool's ranks on several machines (DeepSpeed's launcher over a hostfile): only the
    ranks on the pool's machine see work_dir. The leader (the lowest of them) watches it and sends
    each job (or "stop", when the stop file appears or the owner is gone) to every rank with a
    broadcast; every rank runs it; the leader gathers the results and writes every rank's result
    file, the ready files (a rank elsewhere: "remote HOST PID") and heartbeats for all. A job
    that fails on a rank ends that rank's process after its traceback is written (error file
    on the pool's machine) or printed (relayed by pdsh): the launch then ends on that host and
    the client stops the pool and starts a fresh one on its next job."""
    import socket

    import torch.distributed as dist

    from stages.ranks.entry import run_job

    leader = sees.index(True)
    here = [None] * world
    dist.all_gather_object(here, f"{socket.gethostname()} {os.getpid()}")
    job_id = 0
    if rank == leader:
        bell = Doorbell(work / f"wake_{rank}")
        session.on_close("stages.ranks.server: doorbell", bell.close)  # serve() closes the session
        next_file = work / "next_id"
        job_id = int(next_file.read_text()) if next_file.exists() else 0
        for r in range(world):
            _start_heartbeat(work / f"heartbeat_{r}")
        for r in range(world):
            _write_atomic(work / f"ready_{r}", str(os.getpid()) if r == rank else
                          (here[r].split()[1] if sees[r] else f"remote {here[r]}"))
    _preload()
    while True:
        box = [None]
        if rank == leader:
            box[0] = _next_job(work, job_id, owner_pid, bell)
        dist.broadcast_object_list(box, src=leader)
        job = box[0]
        if job == "stop":
            return 0
        try:
            payload = {**job["payload"], "ranks_on_launcher": sees}
            result = run_job(job["module"], payload, rank, world, session)
        except BaseException:  # noqa: BLE001 - reported, then this rank's process ends
            text = traceback.format_exc()
            if sees[rank]:
                _write_atomic(work / f"error_{job_id}_{rank}.txt", text)
                Doorbell.ring(work / "done")
            print(f"stagerl rank {rank} of {world} ({job['module']}) failed:\n{text}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)
        results = [None] * world if rank == leader else None
        dist.gather_object(result, results, dst=leader)
        if rank == leader:
            for r, res in enumerate(results):
                _write_atomic(work / f"result_{job_id}_{r}.json", json.dumps(res))
            Doorbell.ring(work / "done")
        result = results = job = None
        sys.stdout.flush()
        gc.collect()
        gc.freeze()
        _empty_device_cache(device)
        job_id += 1


def _next_job(work: Path, job_id: int, owner_pid: int, bell: Doorbell):
    """The leader's wait for job_<id>.json ({"module", "payload"}), or "stop"."""
    last_owner_check = time.monotonic()
    while True:
        job_file = work / f"job_{job_id}.json"
        if job_file.exists():
            return json.loads(job_file.read_text())
        if (work / "stop").exists():
            return "stop"
        if time.monotonic() - last_owner_check > 1.0:
            if not _owner_alive(owner_pid):
                print(f"rank pool: owner process {owner_pid} is gone; the ranks exit", file=sys.stderr, flush=True)
                return "stop"
            last_owner_check = time.monotonic()
        bell.wait(WAIT_S)


def _start_heartbeat(path: Path) -> None:
    """Touch `path` now and every HEARTBEAT_S in a daemon thread (it stops when the process
    is stopped or cannot run Python)."""
    import threading

    path.touch()

    def beat() -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                os.utime(path)
            except OSError:  # the work dir is gone: the pool is being removed
                return

    threading.Thread(target=beat, name="rank-heartbeat", daemon=True).start()


PRELOAD = ("deepspeed", "torch._dynamo", "transformers.models.auto.modeling_auto", "transformers.generation.utils",
           "stages.training.worker", "stages.logprob")


def _preload() -> None:
    """Import what the jobs need before the first one arrives (a few seconds of imports that
    otherwise land in the first step); a module that cannot be imported fails its job later."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - reported by the job that needs it
            pass


def _empty_device_cache(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def main(argv=None) -> int:
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    multi = "--multi-node" in argv
    argv = [a for a in argv if a != "--multi-node"]
    if len(argv) != 3:
        print("usage: python -m stages.ranks.server <work_dir> <device> <owner_pid> [--multi-node]", file=sys.stderr)
        return 2
    return serve(Path(argv[0]), argv[1], int(argv[2]), multi_node=multi)


if __name__ == "__main__":
    sys.exit(main())
