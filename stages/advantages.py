"""Advantage estimators as pure functions, registered by verl's `algorithm.adv_estimator` names.

Calling convention is verl's (`verl/trainer/ppo/core_algos.py`): padded
(bs, T) tensors, `response_mask` 1 on valid response tokens, `index` = the uid of each row (rows of
one prompt share it). Every estimator returns `(advantages, returns)`, both (bs, T) and zero on
padding. Outcome estimators use s_i = sum_t token_level_rewards[i, t].
"""
from __future__ import annotations

import inspect
from typing import Callable, Sequence

import torch

__all__ = [
    "ADV_ESTIMATORS", "register_adv_estimator", "estimator_needs", "get_adv_estimator", "compute_advantage", "masked_mean", "masked_var",
    "masked_whiten", "compute_grpo_advantage", "compute_rloo_advantage",
    "compute_reinforce_plus_plus_advantage", "compute_reinforce_plus_plus_baseline_advantage",
    "compute_gae_advantage",
]


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
def _float_mask(response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if response_mask.shape != like.shape:
        raise ValueError(f"response_mask shape {tuple(response_mask.shape)} != rewards shape "
                         f"{tuple(like.shape)}")
    return response_mask.to(like.dtype)


def _groups(index: Sequence, bs: int) -> dict:
    """uid -> list of row numbers, in first-seen order."""
    if index is None:
        raise ValueError("this estimator needs `index` (the uid of each row) to form groups")
    if len(index) != bs:
        raise ValueError(f"index has {len(index)} entries but the batch has {bs} rows")
    groups: dict = {}
    for row, uid in enumerate(index):
        groups.setdefault(uid.item() if hasattr(uid, "item") else uid, []).append(row)
    return groups


# --------------------------------------------------------------------------- the registry
ADV_ESTIMATORS: dict[str, Callable] = {}
NEEDS = ("values", "baseline")  # critic values (bs, T); a greedy baseline rollout's score per row


def register_adv_estimator(name: str, needs: tuple[str, ...] = ()) -> Callable:
    """Register `fn` as algorithm.adv_estimator=name. `needs` declares its inputs beyond rewards,
    mask and index: "values" (the critic runs: the plan adds it, the logprob stage computes values)
    or "baseline" (the rollout stage adds one greedy answer per prompt, the reward stage scores it).
    The plan and the stages read the declaration (estimator_needs); nothing tests the name."""
    unknown = set(needs) - set(NEEDS)
    if unknown:
        raise ValueError(f"estimator {name!r}: unknown needs {sorted(unknown)}; known: {', '.join(NEEDS)}")

    def register(fn: Callable) -> Callable:
        fn.needs = frozenset(needs)
        ADV_ESTIMATORS[name] = fn
        return fn

    return register


def estimator_needs(name: str) -> frozenset:
    """What estimator `name` declared it needs (a subset of NEEDS)."""
    return get_adv_estimator(name).needs


# --------------------------------------------------------------------------- estimators
@register_adv_estimator("grpo")
def compute_grpo_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                           norm_adv_by_std_in_grpo: bool = True):
    """A_i = (s_i - mean_g)/(std_g + eps), std unbiased; group of 1: mean 0, std 1; Dr.GRPO: s_i - mean_g."""
    mask = _float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = torch.empty_like(scores)
        for rows in _groups(index, scores.shape[0]).values():
            group = scores[rows]
            if len(rows) == 1:
                mean, std = torch.tensor(0.0), torch.tensor(1.0)
            else:
                mean, std = group.mean(), group.std()  # torch.std is unbiased (n - 1)
            adv[rows] = (group - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else group - mean
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("rloo")
def compute_rloo_advantage(token_level_rewards, response_mask, index):
    """A_i = s_i*K/(K-1) - mean_g*K/(K-1) (= s_i - mean of the other K-1 rows); K = 1: A_i = s_i."""
    mask = _float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = scores.clone()
        for rows in _groups(index, scores.shape[0]).values():
            k = len(rows)
            if k > 1:
                adv[rows] = scores[rows] * k / (k - 1) - scores[rows].mean() * k / (k - 1)
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(token_level_rewards, response_mask, gamma: float = 1.0):
    """G_t = r_t + gamma*G_{t+1} (running return reset by mask); A = masked_whiten(G) * mask; returns = G."""
    mask = _float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            running = token_level_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = running * mask[:, t]  # reset past EOS
        adv = masked_whiten(returns, mask) * mask
    return adv, returns * mask


@register_adv_estimator("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_advantage(token_level_rewards, response_mask, index):
    """A = masked_whiten((s_i - mean_g) broadcast * mask) * mask; group of 1: mean 0; returns = A."""
    mask = _float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        centered = scores.clone()
        for rows in _groups(index, scores.shape[0]).values():
            if len(rows) > 1:
                centered[rows] = scores[rows] - scores[rows].mean()
        adv = centered.unsqueeze(-1).expand_as(mask) * mask
        adv = masked_whiten(adv, mask) * mask
    return adv, adv


@register_adv_estimator("gae", needs=("values",))
def compute_gae_advantage(token_level_rewards, response_mask, values, gamma: float = 1.0,
                          lam: float = 1.0):
    """delta_t = r_t + gamma*V_{t+1} - V_t, A_t = delta_t + gamma*lam*A_{t+1}; returns = A + V; A whitened."""
    mask = _float_mask(response_mask, token_level_rewards)
    if values is None or values.shape != token_level_rewards.shape:
        raise ValueError("gae needs `values` (the critic's, shape (bs, T) like the rewards)")
    with torch.no_grad():
        next_value = torch.zeros_like(token_level_rewards[:, 0])
        last_gae = torch.zeros_like(next_value)
        reversed_adv = []
        for t in reversed(range(token_level_rewards.shape[1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            # padding positions carry the next valid value / advantage through unchanged
            next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
            last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
            reversed_adv.append(last_gae)
        adv = torch.stack(reversed_adv[::-1], dim=1)
        returns = adv + values
        adv = masked_whiten(adv, mask)
    return adv * mask, returns * mask


def get_adv_estimator(name: str) -> Callable:
    """The registered estimator function for `algorithm.adv_estimator` = name."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"Unknown adv_estimator {name!r}; registered estimators: "
                         f"{', '.join(sorted(ADV_ESTIMATORS))} (Dr.GRPO is 'grpo' with "
                         "norm_adv_by_std_in_grpo=false)")
    return ADV_ESTIMATORS[name]


def compute_advantage(name: str, token_level_rewards, response_mask, **kwargs):
    """Call estimator `name`, passing only the keyword arguments it declares (index, values, gamma, ...)."""
    fn = get_adv_estimator(name)
    params = inspect.signature(fn).parameters
    return fn(token_level_rewards, response_mask, **{k: v for k, v in kwargs.items() if k in params})
