"""Files that an N-rank job's ranks write into a work folder of the launching machine (the
update's DeepSpeed checkpoint partitions and exported weights), when some ranks run on other
machines with no shared file system (DeepSpeed's launcher over a hostfile): the only path between
the machines is the store.

    shipped = ship_work_dir(ctx, work, "update")   # on every rank, after its files are written
    fetch_shipped(ctx, work, "update", results)    # on the launching machine, after run_ranks

A rank knows whether its machine is the launcher's from stages.ranks.entry (the ranks that found
ctx.json on their file system: payload "ranks_on_launcher"). When every rank is on it (one host,
the rank pool, a shared file system) nothing happens. Otherwise every rank waits at a barrier
(all files of every rank written), then one rank per other machine (LOCAL_RANK 0) uploads that
machine's copy of the work folder to layout.transfer(step, stage)/<host>/ and removes it; the
launching machine downloads them into its work folder (a file both have must be identical)
and deletes the transfer folder."""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path


def ranks_on_launcher(ctx) -> list | None:
    return (getattr(ctx, "extra", None) or {}).get("ranks_on_launcher")


def ship_work_dir(ctx, work: Path, stage: str, rank: int) -> dict | None:
    """Collective over the job's ranks when some are on other machines; returns what this rank
    uploaded ({"host", "prefix", "files"}) or None."""
    on = ranks_on_launcher(ctx)
    if not on or all(on):
        return None
    import torch.distributed as dist

    dist.barrier()  # every rank's files are written before a machine's folder is uploaded
    if on[rank] or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    host = socket.gethostname()
    prefix = f"{ctx.layout.transfer(ctx.step, stage)}/{host}"
    work = Path(work)
    files = sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file()) if work.is_dir() else []
    for rel in files:
        ctx.store.put_file(work / rel, f"{prefix}/{rel}")
    shutil.rmtree(work, ignore_errors=True)
    return {"host": host, "prefix": prefix, "files": files}


def fetch_shipped(ctx, work: Path, stage: str, results: list) -> list[str]:
    """Download what ranks on other machines shipped into `work`; returns the hosts fetched from."""
    hosts = []
    for result in results:
        shipped = (result or {}).get("shipped") if isinstance(result, dict) else None
        if not shipped:
            continue
        for rel in shipped["files"]:
            dst = Path(work) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if dst.exists():
                if dst.read_bytes() != ctx.store.read_bytes(f"{shipped['prefix']}/{rel}"):
                    raise RuntimeError(f"{rel} was written differently on {shipped['host']} and on the "
                                       f"launching machine")
                continue
            ctx.store.get_file(f"{shipped['prefix']}/{rel}", dst)
        hosts.append(shipped["host"])
    if hosts:
        ctx.store.delete(ctx.layout.transfer(ctx.step, stage), recursive=True)
    return hosts
