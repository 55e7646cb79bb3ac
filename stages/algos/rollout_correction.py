"""Engine–trainer mismatch: truncated importance sampling (TIS) and off-policy diagnostics, as
verl's `verl/trainer/ppo/rollout_corr_helper.py` (compute_rollout_correction_weights,
compute_offpolicy_metrics).

The rollout engine (vLLM, or transformers in another process and dtype) samples from π_rollout;
the trainer's forward gives π_old for the same tokens. They differ (kernels, precision, sampling
tricks), so the sampled tokens are slightly off-policy for the trainer. With
`actor_rollout_ref.rollout.calculate_log_probs=true` the rollout stage stores the engine's own
per-token log-probs (rollout_log_probs); then

  algorithm.rollout_correction.rollout_is = token:     w_t = min(exp(old_t - rollout_t), threshold)
                                          = sequence:  w   = min(exp(sum_t (old_t - rollout_t)), threshold)

(log-ratios clamped to ±20 before exp) multiplies each token's policy loss, detached. The weights
depend only on a row's own tokens, so computing them per micro-batch inside the update equals
verl's computing them once over the batch (verl's optional batch normalisation to mean 1, which
needs the whole batch, is not offered).

offpolicy_metrics gives verl's `rollout_corr/*` diagnostics (KL, k3 KL, perplexities, χ²); the
update stage records them every step rollout log-probs exist, so `stagerl inspect` and `stagerl
plot` show the mismatch whether or not the correction is on.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

SAFETY_BOUND = 20.0  # verl: exp(±20) bounds the weights before truncation
IS_LEVELS = ("token", "sequence")


def _masked_mean(values, mask, dim=None):
    if dim is None:
        return (values * mask).sum() / (mask.sum() + 1e-8)
    return (values * mask).sum(dim) / (mask.sum(dim) + 1e-8)


def rollout_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       rollout_is: str = "token", rollout_is_threshold: float = 2.0) -> torch.Tensor:
    """(bs, T) truncated IS weights π_old/π_rollout, zero on padding, detached (verl's
    compute_rollout_correction_weights without batch normalisation)."""
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={rollout_is!r}: one of {', '.join(IS_LEVELS)} or null")
    if not rollout_is_threshold > 0:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold must be positive, got {rollout_is_threshold}")
    mask = response_mask.to(old_log_prob.dtype)
    log_ratio = old_log_prob - rollout_log_prob
    if rollout_is == "token":
        weights = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        seq = (log_ratio * mask).sum(dim=-1, keepdim=True)
        weights = torch.exp(torch.clamp(seq, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    return (weights * mask).clamp(max=rollout_is_threshold).detach()


def offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                      response_mask: torch.Tensor) -> dict[str, float]:
    """verl's compute_offpolicy_metrics, prefixed rollout_corr/: kl = E[rollout - old] (KL(π_rollout ‖
    π_old)), k3_kl = E[ρ - log ρ - 1] with ρ = π_old/π_rollout, training/rollout perplexity (batch
    mean of per-sequence exp(-mean log p)), log_ppl_diff (rollout mean log p − old mean log p, per
    sequence: mean, |mean|, max, min), ppl_ratio, chi2_token = E[ρ²] − 1, chi2_seq = E[(Πρ)²] − 1."""
    mask = response_mask.to(old_log_prob.dtype)
    if not bool(mask.any()):
        raise ValueError("offpolicy_metrics: the batch has no valid response token")
    mean_old = _masked_mean(old_log_prob, mask, -1)  # per sequence (an empty one: 0, as in verl)
    mean_rollout = _masked_mean(rollout_log_prob, mask, -1)
    log_ratio = old_log_prob - rollout_log_prob
    log_ppl_diff = mean_rollout - mean_old
    seq_sum = torch.clamp((log_ratio * mask).sum(-1), -SAFETY_BOUND, SAFETY_BOUND)
    out = {
        "training_ppl": torch.exp(-mean_old).mean(), "training_log_ppl": (-mean_old).mean(),
        "kl": _masked_mean(rollout_log_prob - old_log_prob, mask),
        "k3_kl": _masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
        "rollout_ppl": torch.exp(-mean_rollout).mean(), "rollout_log_ppl": (-mean_rollout).mean(),
        "log_ppl_diff": log_ppl_diff.mean(), "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(), "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "chi2_token": _masked_mean(torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)).square(), mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * seq_sum).mean() - 1.0,
    }
    return {f"rollout_corr/{k}": float(v) for k, v in out.items()}


def pad_rows(rows: list, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token lists (one per row, their own lengths) -> (values, mask), right-padded (bs, T)
    float32. One numpy scatter of the flattened values, not a tensor per row (720 rows of 48
    tokens: ~14 -> ~2 ms, on the update's critical path at trainer.staleness >= 1)."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    width = width or (int(lengths.max()) if len(rows) else 0)
    if len(rows) and int(lengths.max()) > width:
        raise ValueError(f"pad_rows: a row of {int(lengths.max())} values is longer than the width {width}")
    mask = np.arange(max(width, 1))[None, :] < lengths[:, None]
    values = np.zeros(mask.shape, dtype=np.float32)
    values[mask] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.float32, count=int(lengths.sum()))
    return torch.from_numpy(values), torch.from_numpy(mask.astype(np.float32))
