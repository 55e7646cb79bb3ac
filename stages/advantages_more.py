"""verl's further advantage estimators (verl/trainer/ppo/core_algos.py, volcengine/verl b178a3c):
opo, grpo_passk, gpg, rloo_vectorized, grpo_vectorized, remax, optimal_token_baseline. Each is
verl's formula (the function it follows is named in its docstring) in verl's calling convention:
padded (bs, T) tensors, `response_mask` 1 on valid response tokens, `index` the uid of each row;
returns (advantages, returns). s_i = sum_t token_level_rewards[i, t]. Registered into
stages.adv_registry; read them through stages.advantages (which imports this module).

Where verl differs between two estimators that look alike, these follow verl, not each other:
- rloo_vectorized gives a prompt answered once (a group of 1) the advantage 0; rloo gives it s_i.
- grpo_vectorized floors the group variance at epsilon (std = sqrt(max(var, eps))); grpo does not.
  Both give 0 to groups whose rewards are all equal, and s_i/(1 + eps) to groups of 1.
"""
from __future__ import annotations

import torch

from stages.adv_registry import float_mask, group_ids, group_rows, register_adv_estimator


def _group_sums(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-group sums (G,) of a (bs,) tensor (verl: index_add_ / bincount with weights)."""
    groups = int(ids.max()) + 1 if ids.numel() else 0
    return torch.zeros(groups, dtype=values.dtype).index_add_(0, ids, values)


@register_adv_estimator("grpo_vectorized")
def compute_grpo_vectorized_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                                      norm_adv_by_std_in_grpo: bool = True):
    """verl compute_grpo_vectorized_outcome_advantage (with verl.utils.groupwise.group_mean_std):
    per group, in float32, mean = S1/c and std = sqrt(max((S2 - S1^2/c)/max(c-1, 1), eps)), S1 = sum s,
    S2 = sum s^2; groups of 1: mean 0, std 1. A_i = (s_i - mean)/(std + eps), or s_i - mean when
    norm_adv_by_std_in_grpo is false; broadcast over the valid tokens."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).to(torch.float32)
        ids = group_ids(index, scores.shape[0])
        count = _group_sums(torch.ones_like(scores), ids)
        s1, s2 = _group_sums(scores, ids), _group_sums(scores * scores, ids)
        mean = s1 / count.clamp_min(1.0)
        var = (s2 - s1 * s1 / count.clamp_min(1.0)) / (count - 1.0).clamp_min(1.0)
        std = torch.sqrt(torch.clamp(var, min=epsilon))
        single = count <= 1.0
        mean, std = torch.where(single, 0.0, mean), torch.where(single, 1.0, std)
        if norm_adv_by_std_in_grpo:
            scalars = (scores - mean[ids]) / (std[ids] + epsilon)
        else:
            scalars = scores - mean[ids]
        adv = scalars.to(token_level_rewards.dtype).unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("rloo_vectorized")
def compute_rloo_vectorized_advantage(token_level_rewards, response_mask, index):
    """verl compute_rloo_vectorized_outcome_advantage: with c the group's size and S its score sum,
    A_i = (c*s_i - S)/max(c-1, 1) * [c > 1] (= s_i minus the mean of the other c-1); a group of 1
    gets 0 (rloo gives it s_i)."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        ids = group_ids(index, scores.shape[0])
        c = _group_sums(torch.ones_like(scores), ids)[ids]
        adv = ((c * scores - _group_sums(scores, ids)[ids]) / (c - 1).clamp_min(1)) * (c > 1)
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("opo")
def compute_opo_advantage(token_level_rewards, response_mask, index):
    """verl compute_opo_outcome_advantage (OPO, arXiv 2505.23585): the group's length-weighted mean
    b = sum_j L_j s_j / sum_j L_j (L_j = valid tokens of row j) is the baseline, A_i = s_i - b;
    a group of 1: b = 0. A group of several rows with no valid token at all (verl: 0/0 = NaN) is
    refused."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        lengths = mask.sum(dim=-1)
        scores = token_level_rewards.sum(dim=-1)
        adv = scores.clone()
        for uid, rows in group_rows(index, scores.shape[0]).items():
            if len(rows) == 1:
                continue
            total = lengths[rows].sum()
            if total == 0:
                raise ValueError(f"opo: the {len(rows)} responses of group {uid!r} have no valid token; "
                                 "the length-weighted baseline is 0/0")
            adv[rows] = scores[rows] - (lengths[rows] * scores[rows]).sum() / total
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("grpo_passk", min_group=2)
def compute_grpo_passk_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                                 norm_adv_by_std_in_grpo: bool = True):
    """verl compute_grpo_passk_outcome_advantage (Pass@k training, arXiv 2503.19595): in each group
    only the best answer (torch.topk's first) gets a non-zero advantage, r_max - r_second_max,
    divided by (std of the group's scores (unbiased) + eps) when norm_adv_by_std_in_grpo; every
    other answer gets 0. A group needs at least 2 answers (actor_rollout_ref.rollout.n >= 2)."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = torch.zeros_like(scores)
        for uid, rows in group_rows(index, scores.shape[0]).items():
            group = scores[rows]
            if len(rows) < 2:
                raise ValueError(f"grpo_passk needs at least 2 samples per group (actor_rollout_ref.rollout.n "
                                 f">= 2); group {uid!r} has {len(rows)}")
            top, top_idx = torch.topk(group, 2)
            advantage = top[0] - top[1]
            if norm_adv_by_std_in_grpo:
                advantage = advantage / (torch.std(group) + epsilon)
            adv[rows[int(top_idx[0])]] = advantage
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("gpg")
def compute_gpg_advantage(token_level_rewards, response_mask, index, f_norm: float = 1.0):
    """verl compute_gpg_outcome_advantage (GPG, arXiv 2504.02546): alpha = bs / max(M, 1) with M the
    number of rows of the whole batch whose score is non-zero; A_i = alpha * (s_i - mean_g) / f_norm,
    mean_g the group's mean (a group of 1: 0). verl's trainer never passes f_norm (1.0) and
    overwrites its `alpha` argument, so neither is a config key."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
        adv = scores.clone()
        for rows in group_rows(index, scores.shape[0]).values():
            mean = scores[rows].mean() if len(rows) > 1 else 0.0
            adv[rows] = alpha * (scores[rows] - mean) / f_norm
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("remax", needs=("baseline",))
def compute_remax_advantage(token_level_rewards, response_mask, reward_baselines):
    """verl compute_remax_outcome_advantage (ReMax, arXiv 2310.10505): returns G_t = sum_{t'>=t}
    r_t' * m_t' (reward-to-go of the masked rewards), A_t = G_t - b * m_t with b = reward_baselines,
    the score of a greedy answer to the same prompt (one per row: that row's prompt's). With an
    outcome reward (and no KL in reward) G_t = s_i on every valid token, so A = s_i - b."""
    mask = float_mask(response_mask, token_level_rewards)
    baselines = torch.as_tensor(reward_baselines, dtype=token_level_rewards.dtype)
    if baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(f"remax: reward_baselines has shape {tuple(baselines.shape)}, expected one per row "
                         f"({token_level_rewards.shape[0]},)")
    with torch.no_grad():
        returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - baselines.unsqueeze(-1) * mask
    return advantages, returns


@register_adv_estimator("optimal_token_baseline", needs=("old_log_probs", "sum_pi_squared"))
def compute_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs,
                                             sum_pi_squared, rollout_is_weights=None,
                                             handle_zero_tail: bool = False, epsilon: float = 1e-8):
    """verl compute_optimal_token_baseline_advantage (OTB, verl docs/algo/otb.md): G_t = reward-to-go
    of the masked rewards; per token w_t = 1 - 2*pi_t + sum_v pi_v^2 (pi_t = exp(old_log_prob_t)),
    times rho_t^2 with rollout IS weights; W_t = sum_{j<=t} w_j m_j. Per group and position t:
    B_t = sum_i G_t W_t m_t / (sum_i W_t m_t + eps); A_t = (G_t - B_t) m_t; returns G. A group of 1
    has no baseline (A = G). handle_zero_tail (verl's default False; its trainer never sets it):
    the part of a group's single longest answer past the second longest gets B = 0."""
    mask = float_mask(response_mask, token_level_rewards)
    for name, value in (("old_log_probs", old_log_probs), ("sum_pi_squared", sum_pi_squared)):
        if value is None or value.shape != token_level_rewards.shape:
            raise ValueError(f"optimal_token_baseline needs `{name}` of shape (bs, T) like the rewards")
    with torch.no_grad():
        returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
        if rollout_is_weights is not None:
            w = w * rollout_is_weights ** 2
        w_cum = (w * mask).cumsum(dim=-1)
        baselines = torch.zeros_like(returns)
        for rows in group_rows(index, returns.shape[0]).values():
            if len(rows) == 1:
                continue
            g, wc, m = returns[rows], w_cum[rows], mask[rows]
            baselines[rows] = ((g * wc * m).sum(dim=0) / ((wc * m).sum(dim=0) + epsilon)).expand(len(rows), -1)
            if handle_zero_tail:
                lengths = m.sum(dim=-1)
                ordered = torch.sort(lengths).values
                longest, second = int(ordered[-1]), int(ordered[-2])
                at_max = (lengths == longest).nonzero(as_tuple=True)[0]
                if at_max.numel() == 1 and longest > second:
                    baselines[rows[int(at_max[0])], second:] = 0.0
        advantages = (returns - baselines) * mask
    return advantages, returns
