"""Advantage estimators as pure functions, registered by verl's `algorithm.adv_estimator` names.

Calling convention is verl's (`verl/trainer/ppo/core_algos.py`): padded
(bs, T) tensors, `response_mask` 1 on valid response tokens, `index` = the uid of each row (rows of
one prompt share it). Every estimator returns `(advantages, returns)`, both (bs, T) and zero on
padding. Outcome estimators use s_i = sum_t token_level_rewards[i, t].

This module is the complete registry: verl's first estimators are here, its others in
stages.advantages_more, both registering into stages.adv_registry; importing this module imports
both, and the lookups below (get_adv_estimator, estimator_needs, compute_advantage) read it.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

from stages.adv_registry import (ADV_ESTIMATORS, NEEDS, float_mask, group_rows, masked_mean, masked_var,
                                 masked_whiten, register_adv_estimator)
from stages.advantages_more import (compute_gpg_advantage, compute_grpo_passk_advantage,
                                    compute_grpo_vectorized_advantage, compute_opo_advantage,
                                    compute_optimal_token_baseline_advantage, compute_remax_advantage,
                                    compute_rloo_vectorized_advantage)

__all__ = [
    "ADV_ESTIMATORS", "NEEDS", "register_adv_estimator", "estimator_needs", "get_adv_estimator",
    "compute_advantage", "masked_mean", "masked_var", "masked_whiten", "compute_grpo_advantage",
    "compute_rloo_advantage", "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage", "compute_gae_advantage",
    # stages.advantages_more
    "compute_opo_advantage", "compute_grpo_passk_advantage", "compute_gpg_advantage",
    "compute_rloo_vectorized_advantage", "compute_grpo_vectorized_advantage", "compute_remax_advantage",
    "compute_optimal_token_baseline_advantage",
]


# --------------------------------------------------------------------------- estimators
@register_adv_estimator("grpo")
def compute_grpo_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                           norm_adv_by_std_in_grpo: bool = True):
    """A_i = (s_i - mean_g)/(std_g + eps), std unbiased; group of 1: mean 0, std 1; Dr.GRPO: s_i - mean_g."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = torch.empty_like(scores)
        for rows in group_rows(index, scores.shape[0]).values():
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
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = scores.clone()
        for rows in group_rows(index, scores.shape[0]).values():
            k = len(rows)
            if k > 1:
                adv[rows] = scores[rows] * k / (k - 1) - scores[rows].mean() * k / (k - 1)
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(token_level_rewards, response_mask, gamma: float = 1.0):
    """G_t = r_t + gamma*G_{t+1} (running return reset by mask); A = masked_whiten(G) * mask; returns = G."""
    mask = float_mask(response_mask, token_level_rewards)
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
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        centered = scores.clone()
        for rows in group_rows(index, scores.shape[0]).values():
            if len(rows) > 1:
                centered[rows] = scores[rows] - scores[rows].mean()
        adv = centered.unsqueeze(-1).expand_as(mask) * mask
        adv = masked_whiten(adv, mask) * mask
    return adv, adv


@register_adv_estimator("gae", needs=("values",))
def compute_gae_advantage(token_level_rewards, response_mask, values, gamma: float = 1.0,
                          lam: float = 1.0):
    """delta_t = r_t + gamma*V_{t+1} - V_t, A_t = delta_t + gamma*lam*A_{t+1}; returns = A + V; A whitened."""
    mask = float_mask(response_mask, token_level_rewards)
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


def estimator_needs(name: str) -> frozenset:
    """What estimator `name` declared it needs (a subset of NEEDS)."""
    return get_adv_estimator(name).needs


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
