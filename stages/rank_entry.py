"""Entry point of one rank of an N-rank job (started by torchrun or the deepspeed launcher):

    python -m stages.rank_entry <module> <ctx.json>

Rebuilds the context from ctx.json, calls `<module>.rank_main(ctx, rank, world)` with RANK and
WORLD_SIZE from the launcher's environment, and writes the JSON return value to
result_<rank>.json beside ctx.json (or error_<rank>.txt with the traceback, then exits 1)."""
from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path


def run_job(module: str, payload: dict, rank: int, world: int):
    """Rebuild the context from its payload (stages.launch.context_payload + "device") and run
    `<module>.rank_main(ctx, rank, world)`; also used by the rank pool (stages.rank_server)."""
    from stages.launch import context_from_payload

    ctx = context_from_payload(payload)
    if payload.get("device") and hasattr(ctx, "extra"):
        ctx.extra.setdefault("device", payload["device"])
    return importlib.import_module(module).rank_main(ctx, rank, world)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python -m stages.rank_entry <module> <ctx.json>", file=sys.stderr)
        return 2
    module, ctx_path = argv[0], Path(argv[1])
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        result = run_job(module, json.loads(ctx_path.read_text()), rank, world)
        tmp = ctx_path.parent / f".result_{rank}.json.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, ctx_path.parent / f"result_{rank}.json")
    except BaseException:
        (ctx_path.parent / f"error_{rank}.txt").write_text(traceback.format_exc())
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        from stages.launch import destroy_distributed

        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
