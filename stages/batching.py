"""Row balancing over ranks, micro-batches (by row count or token budget), padding and load lines.

verl's semantics (reference/verl-semantics.md §2 step 4 and §3.2-§3.3, verl/utils/seqlen_balancing.py):
- `balance_partitions`: balance_batch — Karmarkar-Karp (largest differencing) with equal-size
  partitions on workloads, then inside each partition sort by (workload, idx) and lay out even
  positions followed by odd positions reversed.
- `token_budget_micro_batches`: rearrange_micro_batches — num_micro = min(rows, ceil(tokens /
  budget)), all-reduced MAX over a group when given, KK without equal sizes on workloads, then
  heaviest-first order folded so lighter micro-batches sit at both ends.
Pure Python except `collate`/`pad_per_token`/`unpad` (torch tensors) and the optional all-reduce."""
from __future__ import annotations

import heapq
from math import ceil

WORKLOAD_COEFF = 24576


def workload(seqlen: int) -> int:
    """verl's calculate_workload: a linear (MLP) term plus a quadratic (attention) term."""
    return WORKLOAD_COEFF * int(seqlen) + int(seqlen) * int(seqlen)


# ---- Karmarkar-Karp (largest differencing) -------------------------------------------------
class _Set:
    __slots__ = ("sum", "items")

    def __init__(self):
        self.sum = 0
        self.items: list[tuple[int, int]] = []  # (idx, value)

    def add(self, idx: int, value: int) -> None:
        self.items.append((idx, value))
        self.sum += value

    def merge(self, other: "_Set") -> None:
        for idx, value in other.items:
            self.add(idx, value)

    def key(self):
        return (self.sum, len(self.items), self.items)

    def __lt__(self, other: "_Set") -> bool:
        return self.key() < other.key()


class _State:
    """k sets, kept sorted largest first; the heap pops the state with the largest spread."""

    def __init__(self, items: list[tuple[int, int]], k: int):
        self.k = k
        self.sets = [_Set() for _ in range(k)]
        for i, (idx, value) in enumerate(items):
            self.sets[i].add(idx, value)
        self.sets.sort(reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0].sum - self.sets[-1].sum

    def merge(self, other: "_State") -> None:
        for i in range(self.k):  # largest set of one with the smallest of the other
            self.sets[i].merge(other.sets[self.k - 1 - i])
        self.sets.sort(reverse=True)

    def __lt__(self, other: "_State") -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0].key() > other.sets[0].key()


def karmarkar_karp(values: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """Partition indices of `values` into k sets with close sums (each index list sorted)."""
    if k <= 0:
        raise ValueError(f"number of partitions must be >= 1, got {k}")
    if len(values) < k:
        raise ValueError(f"cannot split {len(values)} rows into {k} non-empty partitions")
    if equal_size and len(values) % k:
        raise ValueError(f"{len(values)} rows do not split into {k} equal partitions")
    ordered = sorted((v, i) for i, v in enumerate(values))
    heap: list[_State] = []
    if equal_size:
        for off in range(0, len(ordered), k):
            heapq.heappush(heap, _State([(i, v) for v, i in ordered[off:off + k]], k))
    else:
        for v, i in ordered:
            heapq.heappush(heap, _State([(i, v)], k))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.merge(second)
        heapq.heappush(heap, first)
    parts = [sorted(idx for idx, _ in s.items) for s in heap[0].sets]
    if any(not p for p in parts):
        raise ValueError(f"Karmarkar-Karp left an empty partition ({len(values)} rows, k={k})")
    return parts


def balance_partitions(seqlens: list[int], k: int) -> list[list[int]]:
    """verl's balance_batch: rank r gets row indices partitions[r] (equal counts)."""
    if k <= 0:
        raise ValueError(f"number of ranks must be >= 1, got {k}")
    if len(seqlens) % k:
        raise ValueError(f"{len(seqlens)} rows are not divisible by {k} ranks: balance_batch needs "
                         f"equal rows per rank")
    loads = [workload(s) for s in seqlens]
    parts = karmarkar_karp(loads, k, equal_size=True)
    out = []
    for part in parts:
        part = sorted(part, key=lambda i: (loads[i], i))
        out.append(part[::2] + part[1::2][::-1])
    return out


# ---- micro-batches ---------------------------------------------------------------------------
def static_micro_batches(n_rows: int, micro: int) -> list[list[int]]:
    """Consecutive chunks of `micro` rows (the last may be short)."""
    if micro is None or micro <= 0:
        raise ValueError(f"micro-batch size must be a positive number of rows, got {micro!r}")
    return [list(range(s, min(s + micro, n_rows))) for s in range(0, n_rows, micro)]


def check_budget(lengths: list[int], budget: int | None, key: str) -> int:
    """The longest sequence, if it fits the token budget (a sequence is never split)."""
    longest = max(lengths)
    if budget is None or budget < longest:
        raise ValueError(f"token budget {key}={budget} is below the longest sequence ({longest} "
                         f"tokens, row {lengths.index(longest)}): a sequence is never split")
    return longest


def token_budget_micro_batches(seqlens: list[int], budget: int, group=None,
                               all_reduce: bool = True) -> list[list[int]]:
    """verl's rearrange_micro_batches on (prompt+response) lengths; returns index lists in
    execution order. With a torch.distributed `group` (or all_reduce and an initialised default
    group) every rank runs the same number of micro-batches (all-reduce MAX)."""
    if not seqlens:
        return []
    check_budget(seqlens, budget, "log_prob/ppo max_token_len_per_gpu")
    num_micro = min(len(seqlens), ceil(sum(seqlens) / budget))
    num_micro = _max_over_group(num_micro, group, all_reduce)
    if num_micro > len(seqlens):
        raise ValueError(f"another rank needs {num_micro} micro-batches but this rank has only "
                         f"{len(seqlens)} rows (ranks must hold similar row counts)")
    loads = [workload(s) for s in seqlens]
    parts = karmarkar_karp(loads, num_micro, equal_size=False)
    parts.sort(key=lambda p: (sum(loads[i] for i in p), p[0] if p else 0), reverse=True)
    return parts[::2][::-1] + parts[1::2]


def _max_over_group(value: int, group, all_reduce: bool) -> int:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return value
    if group is None and not (all_reduce and dist.is_available() and dist.is_initialized()):
        return value
    if not dist.is_initialized():
        return value
    import torch

    backend = dist.get_backend(group)
    device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def restore_order(chunks: list, micro_batches: list[list[int]]) -> list:
    """Flatten per-micro-batch outputs (lists in micro-batch row order) back to index order."""
    n = sum(len(mb) for mb in micro_batches)
    out = [None] * n
    for mb, values in zip(micro_batches, chunks):
        if len(values) != len(mb):
            raise ValueError(f"micro-batch output has {len(values)} rows, expected {len(mb)}")
        for i, v in zip(mb, values):
            out[i] = v
    return out


# ---- padding ---------------------------------------------------------------------------------
def collate(rows: list[dict], pad_id: int, device="cpu") -> dict:
    """Tensors for a forward pass: prompts left-padded to the longest prompt in `rows`, responses
    right-padded to the longest response (verl's layout: prompt_width P, response_width R)."""
    import torch

    if not rows:
        raise ValueError("collate needs at least one row")
    for n, r in enumerate(rows):
        if len(r["prompt_ids"]) == 0:
            raise ValueError(f"row {n} has an empty prompt_ids")
    P = max(len(r["prompt_ids"]) for r in rows)
    R = max(max(len(r["response_ids"]) for r in rows), 1)
    bs = len(rows)
    input_ids = torch.full((bs, P + R), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros((bs, P + R), dtype=torch.long)
    for n, r in enumerate(rows):
        p, resp = list(r["prompt_ids"]), list(r["response_ids"])
        input_ids[n, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        attention_mask[n, P - len(p):P] = 1
        if resp:
            input_ids[n, P:P + len(resp)] = torch.tensor(resp, dtype=torch.long)
            attention_mask[n, P:P + len(resp)] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
             "response_mask": attention_mask[:, P:].clone()}
    batch = {k: v.to(device) for k, v in batch.items()}
    batch.update(prompt_width=P, response_width=R,
                 response_lengths=[len(r["response_ids"]) for r in rows])
    return batch


def pack(rows: list[dict], device="cpu") -> dict:
    """All rows of a micro-batch as one unpadded sequence (verl's use_remove_padding): input_ids
    and position_ids (1, T) with positions restarting at 0 per row (transformers then attends
    block-diagonally), `pred_index` (flat positions whose logits predict each response token,
    rows concatenated) and `targets` (those tokens). No padding: T = sum of row lengths."""
    import torch

    if not rows:
        raise ValueError("pack needs at least one row")
    ids, pos, pred, targets, start = [], [], [], [], 0
    for n, r in enumerate(rows):
        p, resp = list(r["prompt_ids"]), list(r["response_ids"])
        if not p:
            raise ValueError(f"row {n} has an empty prompt_ids")
        ids += p + resp
        pos += list(range(len(p) + len(resp)))
        pred += range(start + len(p) - 1, start + len(p) - 1 + len(resp))
        targets += resp
        start += len(p) + len(resp)
    lengths = [len(r["response_ids"]) for r in rows]
    return {"packed": True, "input_ids": torch.tensor([ids], dtype=torch.long, device=device),
            "position_ids": torch.tensor([pos], dtype=torch.long, device=device),
            "pred_index": torch.tensor(pred, dtype=torch.long, device=device),
            "targets": torch.tensor(targets, dtype=torch.long, device=device),
            "response_lengths": lengths, "response_width": max(max(lengths), 1)}


def pad_per_token(values: list[list[float]], width: int, dtype=None, pad_value=0.0, device="cpu"):
    """(bs, width) tensor from per-row lists, right-padded with `pad_value`."""
    import torch

    dtype = dtype or torch.float32
    out = torch.full((len(values), width), pad_value, dtype=dtype)
    for n, v in enumerate(values):
        if len(v) > width:
            raise ValueError(f"row {n} has {len(v)} values, more than the width {width}")
        if len(v):
            out[n, :len(v)] = torch.as_tensor(list(v), dtype=dtype)
    return out.to(device)


def unpad(tensor, lengths) -> list[list]:
    """Per-row Python lists of the first lengths[i] entries of a (bs, R) tensor."""
    data = tensor.detach().cpu().tolist()
    return [row[:int(n)] for row, n in zip(data, lengths)]


# ---- load lines ------------------------------------------------------------------------------
def micro_batch_load(seqlens: list[int], micro_batches: list[list[int]], prompt_lengths=None,
                     packed: bool = False) -> dict:
    """Rows, micro-batches, real and padded tokens of one rank. Padded tokens: each micro-batch is
    padded to its longest row, or, with `prompt_lengths`, to (longest prompt + longest response)
    as `collate` lays it out; `packed` (see `pack`) has no padding."""
    padded, widest = 0, 0
    for mb in micro_batches:
        if not mb:
            continue
        if packed:
            width = sum(seqlens[i] for i in mb) / len(mb)
        elif prompt_lengths is None:
            width = max(seqlens[i] for i in mb)
        else:
            width = (max(prompt_lengths[i] for i in mb)
                     + max(seqlens[i] - prompt_lengths[i] for i in mb))
        padded += round(width * len(mb))
        widest = max(widest, round(width * len(mb)))
    real = sum(seqlens[i] for mb in micro_batches for i in mb)
    return {"rows": sum(len(mb) for mb in micro_batches), "micro_batches": len(micro_batches),
            "real_tokens": real, "padded_tokens": padded, "max_tokens_per_micro_batch": widest,
            "max_real_tokens_per_micro_batch": max((sum(seqlens[i] for i in mb)
                                                    for mb in micro_batches), default=0),
            "padding_fraction": (padded - real) / padded if padded else 0.0}


def format_load_line(rank: int, load: dict) -> str:
    """`rank 1: 360 rows, 12 micro-batches, 17,280 tokens (max 1,536 per micro-batch, padding 3 %)`."""
    return (f"rank {rank}: {load['rows']:,} rows, {load['micro_batches']:,} micro-batches, "
            f"{load['real_tokens']:,} tokens (max {load['max_tokens_per_micro_batch']:,} per "
            f"micro-batch, padding {round(100 * load['padding_fraction'])} %)")
