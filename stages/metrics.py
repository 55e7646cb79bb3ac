"""Step data metrics with verl's names (`verl/trainer/ppo/metric_utils.py::compute_data_metrics`)
and `reduce_metrics` (`verl/utils/metric/utils.py`)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

__all__ = ["compute_data_metrics", "reduce_metrics"]


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.float()
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(),
            f"{prefix}/min": x.min().item()}


def compute_data_metrics(token_level_scores, token_level_rewards, advantages, returns,
                         response_mask, attention_mask, values=None) -> dict[str, float]:
    """critic/{score,rewards,advantages,returns,values}/*, vf_explained_var = 1 - Var(R-V)/(Var(R)+1e-5), lengths.

    `attention_mask` is the full (bs, prompt_len + response_len) mask; its last response_len
    columns give response lengths, the rest prompt lengths (as verl). Score and reward statistics
    cover non-aborted rows (response length > 0); advantages/returns/values cover valid tokens.
    """
    max_response_length = response_mask.shape[-1]
    prompt_mask = attention_mask[:, :-max_response_length]
    prompt_length = prompt_mask.sum(-1).float()
    response_length = attention_mask[:, -max_response_length:].sum(-1).float()
    valid = response_mask.bool()
    aborted = response_length == 0
    if bool(aborted.all()):
        raise ValueError("All samples are aborted (every response is empty); no data metrics.")

    metrics = {
        **_stats("critic/score", token_level_scores.sum(-1)[~aborted]),
        **_stats("critic/rewards", token_level_rewards.sum(-1)[~aborted]),
        **_stats("critic/advantages", torch.masked_select(advantages, valid)),
        **_stats("critic/returns", torch.masked_select(returns, valid)),
    }
    if values is not None:
        valid_returns = torch.masked_select(returns, valid).float()
        valid_values = torch.masked_select(values, valid).float()
        metrics.update(_stats("critic/values", valid_values))
        explained = 1.0 - torch.var(valid_returns - valid_values) / (torch.var(valid_returns) + 1e-5)
        metrics["critic/vf_explained_var"] = explained.item()

    non_aborted_length = response_length[~aborted]
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = (response_length == max_response_length).float().mean().item()
    metrics.update(_stats("response_length_non_aborted", non_aborted_length))
    metrics["response_length_non_aborted/clip_ratio"] = (
        (non_aborted_length == max_response_length).float().mean().item())
    metrics["response/aborted_ratio"] = aborted.float().mean().item()
    metrics.update(_stats("prompt_length", prompt_length))
    metrics["prompt_length/clip_ratio"] = (prompt_length == prompt_mask.shape[-1]).float().mean().item()
    return metrics


def reduce_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Per key: max if the name contains "max", min if it contains "min", else mean (verl's rule)."""
    reduced = {}
    for key, vals in metrics.items():
        if "max" in key:
            reduced[key] = float(np.max(vals))
        elif "min" in key:
            reduced[key] = float(np.min(vals))
        else:
            reduced[key] = float(np.mean(vals))
    return reduced
