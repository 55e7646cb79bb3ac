"""Toy rank jobs for the rank pool tests (run inside the pool's rank processes)."""
import os
import time


def rank_main(ctx, rank, world):
    """Echo: which process ran which rank, and the context it got."""
    if ctx.get("fail_on_rank") == rank:
        raise ValueError(f"boom on rank {rank}: {ctx['message']}")
    if ctx.get("store_outage_on_rank") == rank:
        from storage.store import StoreError
        raise StoreError(f"s3://bucket/x: connection refused on rank {rank}")
    time.sleep(float(ctx.get("sleep_s", 0)))
    import torch

    return {"rank": rank, "world": world, "pid": os.getpid(), "ctx": ctx, "cwd": os.getcwd(),
            "cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}
