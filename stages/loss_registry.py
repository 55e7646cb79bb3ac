"""What every policy loss shares: `agg_loss` (verl `agg_loss`), the registry of policy losses by
`actor.policy_loss.loss_mode` (verl `register_policy_loss` / `POLICY_LOSS_REGISTRY`) and the
config readers. stages.losses (vanilla, value loss) and stages.policy_losses (verl's other modes)
both register here; stages.losses re-exports the lot, and importing it fills the registry.

Normalisers. verl's legacy workers aggregate each micro-batch with its *local* token/row counts and
scale by rows_in_micro/rows_in_mini (docs/verl-semantics.md §4, "loss_agg_mode"), which for
token-mean is not the mini-batch's token mean. Here `agg_loss` also takes the mini-batch's global
counts: with `global_tokens` = valid tokens of the whole mini-batch over all ranks (or
`global_rows` = rows with >= 1 valid token, for the seq-mean modes) and `dp_size` = number of
ranks whose gradients are averaged, each micro-batch's loss is sum(L*m)/global_tokens*dp_size;
summing micro-batches and averaging ranks then gives exactly the single-call value over the
mini-batch, however it is split (verl's engine path, `global_batch_info`; docs/verl-semantics.md §4).

The policy-loss signature (verl's newer one, `PolicyLossFn`):
    fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
       config=None, rollout_is_weights=None, **agg) -> (pg_loss, metrics)
`config` is the actor's config section (actor_rollout_ref.actor as a dict: clip_ratio*, tau_*,
policy_loss.*; missing keys take verl's dataclass defaults), `agg` the normalisers above
(global_tokens, global_rows, dp_size, loss_scale_factor) and `metrics` a dict of floats named as
verl names them without the "actor/" prefix (pg_clipfrac, ppo_kl, pg_clipfrac_lower: each a
mean over the call's valid tokens).
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["AGG_MODES", "agg_loss", "POLICY_LOSSES", "register_policy_loss", "clip_range",
           "policy_loss_key"]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

POLICY_LOSSES: dict[str, Callable] = {}


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator: the policy loss for actor.policy_loss.loss_mode = name (verl register_policy_loss)."""
    def decorator(fn: Callable) -> Callable:
        POLICY_LOSSES[name] = fn
        return fn
    return decorator


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


def clip_range(config: dict | None) -> tuple[float, float]:
    """(ε_low, ε_high): clip_ratio_low / clip_ratio_high, each falling back to clip_ratio when null
    (verl: `config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio`)."""
    config = config or {}
    clip = config.get("clip_ratio", 0.2)
    low, high = config.get("clip_ratio_low"), config.get("clip_ratio_high")
    return (clip if low is None else low), (clip if high is None else high)


def policy_loss_key(config: dict | None, key: str, default: float, if_null: float | None = None) -> float:
    """actor.policy_loss.<key>: `default` when absent (verl's PolicyLossConfig default), `if_null`
    (verl's `x if x is not None else ...` in the loss function) when null."""
    section = (config or {}).get("policy_loss") or {}
    value = section.get(key, default)
    return (default if if_null is None else if_null) if value is None else value
