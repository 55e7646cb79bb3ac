"""Entry point of one rank of an N-rank job (started by torchrun or the deepspeed launcher):

    python -m stages.ranks.entry <module> <ctx.json> [device]

Joins the process group (gloo on CPU, nccl on CUDA; device from the argument, else ctx.json),
then:
1. ctx.json is shared over the group: the lowest rank whose machine has the file (the "writer",
   rank 0 when the launching machine is the first host) broadcasts it, so ranks on other hosts need
   no copy of it (when every rank has the file, nothing is sent);
   Whether each rank found the file (its machine is the launcher's) goes to the job as
   ctx.extra["ranks_on_launcher"] (stages.ranks.files ships files from the other machines);
2. `<module>.rank_main(ctx, rank, world)` runs with RANK and WORLD_SIZE from the launcher;
3. every rank's JSON return value is gathered to the writer, which writes them, by rank, to
   results.json beside ctx.json (stages.ranks.launch.run_ranks reads it).
A failing rank writes error_<rank>.txt beside ctx.json (when that folder is on its machine),
prints its traceback to stderr and exits 1; the launcher then stops the other ranks. The process
ends with os._exit (no interpreter teardown; see the end of this file).
`--local_rank=N` (added by launchers unless told not to) is ignored."""
from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path

from stages.ranks.launch import RESULTS_FILE, destroy_distributed, init_distributed
from stages.ranks.procs import context_from_payload


def run_job(module: str, payload: dict, rank: int, world: int, session=None):
    """Rebuild the context from its payload (stages.ranks.launch.context_payload + "device") and run
    `<module>.rank_main(ctx, rank, world)`; also used by the rank pool (stages.ranks.server), which
    passes its rank process's session (what a stage keeps between the pool's jobs)."""
    ctx = context_from_payload(payload)
    if payload.get("device") and hasattr(ctx, "extra"):
        ctx.extra.setdefault("device", payload["device"])
    if payload.get("ranks_on_launcher") is not None and hasattr(ctx, "extra"):
        ctx.extra["ranks_on_launcher"] = payload["ranks_on_launcher"]  # stages.ranks.files
    if hasattr(ctx, "extra"):
        ctx.session = session
    return importlib.import_module(module).rank_main(ctx, rank, world)


def share_payload(payload: dict | None, ctx_path: Path) -> tuple[int, dict]:
    """(writer rank, payload): the lowest rank holding ctx.json sends it to ranks without it."""
    import torch.distributed as dist

    has = [None] * dist.get_world_size()
    dist.all_gather_object(has, payload is not None)
    if not any(has):
        raise FileNotFoundError(f"{ctx_path} is on no rank's machine: run the launcher on one of the hosts")
    writer = has.index(True)
    if not all(has):
        box = [payload]
        dist.broadcast_object_list(box, src=writer)
        payload = box[0]
    return writer, payload


def launcher_ranks(here: bool) -> list[bool]:
    """For each rank, whether it found ctx.json: its machine is the launcher's (stages.ranks.files)."""
    import torch.distributed as dist

    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(here))
    return flags


def gather_results(result, writer: int, folder: Path) -> None:
    """Every rank's return value to the writer rank, which writes results.json (atomically)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    results = [None] * dist.get_world_size() if rank == writer else None
    dist.gather_object(result, results, dst=writer)
    if rank == writer:
        tmp = folder / f".{RESULTS_FILE}.tmp"
        tmp.write_text(json.dumps(results))
        os.replace(tmp, folder / RESULTS_FILE)


def main(argv=None) -> int:
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    if len(argv) not in (2, 3):
        print("usage: python -m stages.ranks.entry <module> <ctx.json> [device]", file=sys.stderr)
        return 2
    module, ctx_path = argv[0], Path(argv[1])
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        payload = json.loads(ctx_path.read_text()) if ctx_path.is_file() else None
        device = argv[2] if len(argv) == 3 else (payload or {}).get("device") or "cpu"
        init_distributed(device)
        here = payload is not None  # this rank's machine is the launching one (or shares its files)
        writer, payload = share_payload(payload, ctx_path)
        payload = {**payload, "ranks_on_launcher": launcher_ranks(here)}
        result = run_job(module, payload, rank, world)
        gather_results(result, writer, ctx_path.parent)
    except BaseException:
        text = traceback.format_exc()
        if ctx_path.parent.is_dir():
            (ctx_path.parent / f"error_{rank}.txt").write_text(text)
        print(f"stagerl rank {rank} of {world} ({module}) failed:\n{text}", file=sys.stderr, flush=True)
        return 1
    finally:
        sys.stdout.flush()
        destroy_distributed()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: the job's files are written and the group is destroyed, and
    # gloo's threads, torn down at exit after the object collectives, aborted a rank now and then
    # ("terminate called without an active exception", ~1 launch in 40 here; 0 in 90 with this).
    os._exit(code)
