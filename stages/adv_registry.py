"""What every advantage estimator shares: the registry of `algorithm.adv_estimator` names (verl's
`register_adv_est` / `ADV_ESTIMATOR_REGISTRY`) with what each estimator declares it needs, verl's
masked statistics, and the grouping helpers. stages.advantages (verl's first estimators and the
lookup) and stages.advantages_more (verl's others) both register here; stages.advantages
re-exports the lot and imports stages.advantages_more, so importing stages.advantages gives the
complete registry. Read estimators through stages.advantages, never through this module.

A leaf: torch only (configs reads the declarations, tests/test_architecture.py PURE_REGISTRIES).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["ADV_ESTIMATORS", "NEEDS", "register_adv_estimator", "masked_mean", "masked_var", "masked_whiten",
           "float_mask", "group_rows", "group_ids"]


# --------------------------------------------------------------------------- masked statistics
def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask) / (sum(mask) + 1e-8), over `dim` or everything (verl's masked_mean)."""
    if dim is None:
        return (values * mask).sum() / (mask.sum() + 1e-8)
    return (values * mask).sum(dim) / (mask.sum(dim) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """masked_mean((x - masked_mean(x))^2) * n/(n-1) with n = sum(mask) (Bessel; verl's masked_var)."""
    centered = values - masked_mean(values, mask)
    variance = masked_mean(centered**2, mask)
    if unbiased:
        n = mask.sum()
        if n == 0:
            raise ValueError("masked_var: the mask selects no element; at least one must be 1 "
                             "(a batch with no valid response token)")
        if n == 1:
            raise ValueError("masked_var: the mask selects exactly one element, so the unbiased "
                             "variance n/(n-1) divides by zero (whitening needs >= 2 valid tokens)")
        variance = variance * (n / (n - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - masked_mean(x)) / sqrt(masked_var(x) + 1e-8) over all valid entries (verl's masked_whiten)."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


# --------------------------------------------------------------------------- helpers
def float_mask(response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if response_mask.shape != like.shape:
        raise ValueError(f"response_mask shape {tuple(response_mask.shape)} != rewards shape "
                         f"{tuple(like.shape)}")
    return response_mask.to(like.dtype)


def group_rows(index: Sequence, bs: int) -> dict:
    """uid -> list of row numbers, in first-seen order."""
    if index is None:
        raise ValueError("this estimator needs `index` (the uid of each row) to form groups")
    if len(index) != bs:
        raise ValueError(f"index has {len(index)} entries but the batch has {bs} rows")
    groups: dict = {}
    for row, uid in enumerate(index):
        groups.setdefault(uid.item() if hasattr(uid, "item") else uid, []).append(row)
    return groups


def group_ids(index: Sequence, bs: int) -> torch.Tensor:
    """(bs,) long tensor of group numbers 0..G-1, in first-seen order (verl's as_torch_index
    factorises the uids too; the numbering does not change any estimator's result)."""
    ids = torch.empty(bs, dtype=torch.long)
    for number, rows in enumerate(group_rows(index, bs).values()):
        ids[rows] = number
    return ids


# --------------------------------------------------------------------------- the registry
ADV_ESTIMATORS: dict[str, Callable] = {}
# What an estimator may need beyond rewards, mask and index, and who provides it:
NEEDS = (
    "values",          # critic values (bs, T): the plan adds the critic, the logprob stage computes them
    "baseline",        # reward_baselines (bs,): the rollout stage adds one greedy answer per prompt
                       # (rollout/baseline.parquet), the reward stage scores it (reward/baseline.parquet)
    "old_log_probs",   # the policy's log-probs (bs, T) at advantage time: the plan keeps the logprob
                       # stage's separate actor pass
    "sum_pi_squared",  # sum over the vocabulary of pi^2 per response token (bs, T): the logprob
                       # stage's actor pass stores it beside old_log_probs
)


def register_adv_estimator(name: str, needs: tuple[str, ...] = (), min_group: int = 1) -> Callable:
    """Register `fn` as algorithm.adv_estimator=name, declaring what it `needs` (see NEEDS). The
    plan and the stages read the declaration (stages.advantages.estimator_needs); nothing tests
    an estimator's name. The estimator receives the inputs it names in its signature:
    values, reward_baselines, old_log_probs, sum_pi_squared (and index, gamma, lam,
    norm_adv_by_std_in_grpo). `min_group`: the fewest answers per prompt it accepts (the plan
    refuses a smaller actor_rollout_ref.rollout.n, which verl only finds at the first step)."""
    unknown = set(needs) - set(NEEDS)
    if unknown:
        raise ValueError(f"estimator {name!r}: unknown needs {sorted(unknown)}; known: {', '.join(NEEDS)}")

    def register(fn: Callable) -> Callable:
        if ADV_ESTIMATORS.get(name, fn) is not fn:  # verl's register_adv_est refuses it too
            raise ValueError(f"adv_estimator {name!r} is already registered ({ADV_ESTIMATORS[name].__name__})")
        fn.needs = frozenset(needs)
        fn.min_group = int(min_group)
        ADV_ESTIMATORS[name] = fn
        return fn

    return register
