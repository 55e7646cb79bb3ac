"""One rank of a persistent rank pool (stages.rank_pool.RankPool starts it under torchrun):

    python -m torch.distributed.run --standalone --nproc_per_node=W -m stages.rank_server <work_dir> <device> <owner_pid>

Each rank initialises the process group once (gloo on CPU, nccl on CUDA), writes ready_<rank>,
then serves jobs in order: job_<id>.json in work_dir (written atomically by the client) holds
{"module", "payload"}; every rank reads the same file, runs `<module>.rank_main(ctx, rank, world)`
(stages.rank_entry.run_job) and writes result_<id>_<rank>.json or error_<id>_<rank>.txt (its
traceback). Ranks poll the folder instead of blocking in a broadcast, so an idle pool holds no
pending collective (no gloo/NCCL timeout between steps, no spinning GPU kernel). A `stop` file,
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

HEARTBEAT_S = 2.0  # seconds between a rank's heartbeat touches
POLL_S = 0.005  # job pick-up latency; an idle rank costs ~200 stat calls a second


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


def serve(work: Path, device: str, owner_pid: int) -> int:
    from stages.launch import destroy_distributed, init_distributed
    from stages.rank_entry import run_job
    from stages.session import RunSession

    session = RunSession()  # what stages keep in this rank between jobs (the update's engines)
    rank, world = init_distributed(device)
    next_file = work / "next_id"  # read before "ready": the client writes it only once all are ready
    job_id = int(next_file.read_text()) if next_file.exists() else 0
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
                time.sleep(POLL_S)
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
                result = None
                job = None
                sys.stdout.flush()
                gc.collect()  # what the job left in cycles; then nothing alive now is scanned again
                gc.freeze()
                _empty_device_cache(device)
            job_id += 1
    finally:
        session.close()
        destroy_distributed()


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


PRELOAD = ("deepspeed", "transformers.models.auto.modeling_auto", "stages.update_worker", "stages.logprob")


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
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 3:
        print("usage: python -m stages.rank_server <work_dir> <device> <owner_pid>", file=sys.stderr)
        return 2
    return serve(Path(argv[0]), argv[1], int(argv[2]))


if __name__ == "__main__":
    sys.exit(main())
