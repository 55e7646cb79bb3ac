"""PPO losses as pure functions (verl `verl/trainer/ppo/core_algos.py`).

Normalisers. verl's legacy workers aggregate each micro-batch with its *local* token/row counts and
scale by rows_in_micro/rows_in_mini (docs/verl-semantics.md §4, "loss_agg_mode"), which for token-mean is not the mini-batch's token mean.
Here `agg_loss` also takes the mini-batch's global counts: with `global_tokens` = valid tokens of the
whole mini-batch over all ranks (or `global_rows` = rows with >= 1 valid token, for the seq-mean
modes) and `dp_size` = number of ranks whose gradients are averaged, each micro-batch's loss is
sum(L*m)/global_tokens*dp_size; summing micro-batches and averaging ranks then gives exactly the
single-call value over the mini-batch, however it is split (verl's engine path; docs/verl-semantics.md §4).
"""
from __future__ import annotations

from typing import Callable

import torch

from stages.advantages import masked_mean

__all__ = ["AGG_MODES", "agg_loss", "compute_policy_loss_vanilla", "entropy_from_logits",
           "compute_value_loss", "POLICY_LOSSES", "get_policy_loss"]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *,
             global_tokens: float | None = None, global_rows: float | None = None,
             dp_size: int = 1, loss_scale_factor: float | None = None) -> torch.Tensor:
    """Aggregate a (bs, T) loss matrix: token-mean, seq-mean-token-{sum,mean}, seq-mean-token-sum-norm (docs/verl-semantics.md §4).

    token-mean:              sum(L*m) / (global_tokens or sum(m)) * dp_size
    seq-mean-token-sum:      sum_i sum_t L*m / (global_rows or #rows with tokens) * dp_size
    seq-mean-token-mean:     sum_i [sum_t L*m / (n_i + 1e-8)] / (global_rows or #rows) * dp_size
    seq-mean-token-sum-norm: sum_i sum_t L*m / (loss_scale_factor or T) * dp_size
    Deviation: verl 0.7 ignores dp_size in the -norm mode; with the default dp_size=1 they agree,
    with dp_size>1 ours keeps the rank-averaged value equal to the single-call value.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        tokens = mask.sum() if global_tokens is None else global_tokens
        return (loss_mat * mask).sum() / tokens * dp_size
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        tokens_per_row = mask.sum(dim=-1)
        seq_losses = (loss_mat * mask).sum(dim=-1)
        if mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (tokens_per_row + 1e-8)
        row_has_tokens = (tokens_per_row > 0).to(loss_mat.dtype)
        rows = row_has_tokens.sum() if global_rows is None else global_rows
        return (seq_losses * row_has_tokens).sum() / rows * dp_size
    if mode == "seq-mean-token-sum-norm":
        norm = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return (loss_mat * mask).sum(dim=-1).sum() / norm * dp_size
    raise ValueError(f"Invalid loss_agg_mode: {mode}. Known modes: {', '.join(AGG_MODES)}")


def compute_policy_loss_vanilla(old_logp, logp, advantages, mask, clip_ratio_low: float = 0.2,
                                clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                                loss_agg_mode: str = "token-mean", rollout_is_weights=None,
                                **agg_kwargs):
    """PPO clip: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), for A<0 capped at -A c (dual clip).

    r = exp(clamp(logp - old_logp, -20, 20)). `agg_kwargs` (global_tokens, global_rows, dp_size,
    loss_scale_factor) go to agg_loss. Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower).
    """
    if not clip_ratio_c > 1.0:
        raise AssertionError("The lower bound of the clip_ratio_c for dual-clip PPO should be "
                             f"greater than 1.0, but get the value: {clip_ratio_c}.")
    mask = mask.to(logp.dtype)
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).to(logp.dtype), mask)

    loss_dual = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((torch.gt(loss_clip, loss_dual) & negative).to(logp.dtype), mask)
    pg_losses = torch.where(negative, torch.minimum(loss_clip, loss_dual), loss_clip)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, **agg_kwargs)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) * z over the last dim (verl's entropy_from_logits)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def compute_value_loss(vpreds, returns, values, mask, cliprange_value: float = 0.5,
                       loss_agg_mode: str = "token-mean", **agg_kwargs):
    """0.5 * agg(max((v - R)^2, (clamp(v, v_old - c, v_old + c) - R)^2)); returns (vf_loss, vf_clipfrac)."""
    mask = mask.to(vpreds.dtype)
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), mask, loss_agg_mode,
                             **agg_kwargs)
    vf_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).to(vpreds.dtype), mask)
    return vf_loss, vf_clipfrac


POLICY_LOSSES: dict[str, Callable] = {"vanilla": compute_policy_loss_vanilla}

# registered in verl but not provided here: refused by name rather than silently replaced
_VERL_ONLY_POLICY_LOSSES = ("gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo",
                            "bypass_mode")


def get_policy_loss(name: str) -> Callable:
    """The policy loss for actor.policy_loss.loss_mode = name."""
    if name in POLICY_LOSSES:
        return POLICY_LOSSES[name]
    if name in _VERL_ONLY_POLICY_LOSSES:
        raise NotImplementedError(f"policy loss_mode {name!r} exists in verl but is not implemented "
                                  f"in stagerl; available: {', '.join(POLICY_LOSSES)}")
    raise ValueError(f"Unknown policy loss_mode {name!r}; available: {', '.join(POLICY_LOSSES)}")
