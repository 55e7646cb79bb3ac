"""rank_main for test_launch_deepspeed's launcher checks (run by stages.ranks.launch.run_ranks): an
all-reduce over the ranks, the launcher's environment as each rank sees it, rank_entry's context
sharing as on two hosts (the context only on rank 1's "machine"), and a failure on purpose."""
import os
from pathlib import Path


def rank_main(ctx, rank, world):
    import torch
    import torch.distributed as dist

    from stages.ranks.launch import init_distributed
    from stages.ranks.entry import share_payload

    init_distributed("cpu")
    if ctx.get("fail_rank") == rank:
        raise ValueError(f"rank {rank} fails on purpose")
    writer, shared = share_payload({"held_by": rank} if rank == 1 else None, Path("ctx.json"))
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {"rank": rank, "world": world, "sum": float(total), "writer": writer, "shared": shared,
            "local_size": os.environ.get("LOCAL_SIZE"), "torchelastic": "TORCHELASTIC_RUN_ID" in os.environ,
            "omp_threads": os.environ.get("OMP_NUM_THREADS")}
