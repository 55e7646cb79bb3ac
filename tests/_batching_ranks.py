"""rank_main for test_batching's 2-rank all-reduce check (run by stages.launch.run_ranks)."""


def rank_main(ctx, rank, world):
    import torch.distributed as dist

    from stages.batching import token_budget_micro_batches
    from stages.launch import init_distributed

    init_distributed("cpu")
    lens = ctx["lens"][rank]
    local = token_budget_micro_batches(lens, ctx["budget"], all_reduce=False)
    reduced = token_budget_micro_batches(lens, ctx["budget"], group=dist.group.WORLD)
    return {"local": len(local), "reduced": len(reduced), "micro_batches": reduced}
