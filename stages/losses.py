"""PPO losses as pure functions (verl `verl/trainer/ppo/core_algos.py`): the vanilla policy loss,
the value loss, entropy, and the policy-loss registry by loss_mode.

`agg_loss` (with its global normalisers), `POLICY_LOSSES` and `register_policy_loss` live in
stages.loss_registry (docstring there: the normalisers and the policy-loss signature) and are
re-exported here; verl's other loss modes are in stages.policy_losses, imported at the end of this
module so that importing it always gives the complete registry.
"""
from __future__ import annotations

from typing import Callable

import torch

from stages.advantages import masked_mean
from stages.loss_registry import AGG_MODES, POLICY_LOSSES, agg_loss, clip_range, register_policy_loss

__all__ = ["AGG_MODES", "agg_loss", "compute_policy_loss_vanilla", "entropy_from_logits",
           "compute_value_loss", "POLICY_LOSSES", "register_policy_loss", "get_policy_loss",
           "policy_losses"]


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, *,
                                loss_agg_mode: str = "token-mean", config: dict | None = None,
                                rollout_is_weights=None, **agg):
    """PPO clip: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), for A<0 capped at -A c (dual clip).

    verl `compute_policy_loss_vanilla`. r = exp(clamp(logp - old_logp, -20, 20)); eps_low/eps_high
    from config clip_ratio_low/high (clip_ratio where null), c = config clip_ratio_c (default 3,
    must be > 1). The per-token losses (times rollout_is_weights) are aggregated by agg_loss with
    loss_agg_mode and the normalisers in `agg`. Metrics: pg_clipfrac (clipped tokens),
    pg_clipfrac_lower (dual-clipped tokens), ppo_kl = mean(-log r), over valid tokens.
    """
    config = config or {}
    clip_ratio_low, clip_ratio_high = clip_range(config)
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    if not clip_ratio_c > 1.0:
        raise AssertionError("The lower bound of the clip_ratio_c for dual-clip PPO should be "
                             f"greater than 1.0, but get the value: {clip_ratio_c}.")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).to(mask.dtype), mask)

    loss_dual = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((torch.gt(loss_clip, loss_dual) & negative).to(mask.dtype), mask)
    pg_losses = torch.where(negative, torch.minimum(loss_clip, loss_dual), loss_clip)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, **agg)
    return pg_loss, {"pg_clipfrac": pg_clipfrac.item(), "ppo_kl": ppo_kl.item(),
                     "pg_clipfrac_lower": pg_clipfrac_lower.item()}


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


# registered in verl but not provided here: refused by name rather than silently replaced
# (bypass_mode needs verl's rollout-correction helper: rollout log-probs as the old ones, IS and
# rejection masks inside the loss)
_VERL_ONLY_POLICY_LOSSES = ("bypass_mode",)


def get_policy_loss(name: str) -> Callable:
    """The policy loss for actor.policy_loss.loss_mode = name."""
    if name in POLICY_LOSSES:
        return POLICY_LOSSES[name]
    if name in _VERL_ONLY_POLICY_LOSSES:
        raise NotImplementedError(f"policy loss_mode {name!r} exists in verl but is not implemented "
                                  f"in stagerl; available: {', '.join(POLICY_LOSSES)}")
    raise ValueError(f"Unknown policy loss_mode {name!r}; available: {', '.join(POLICY_LOSSES)}")


from stages import policy_losses  # noqa: E402  (last: it registers verl's other loss modes)
