"""The one reward function of the peer benchmark (bench/peer_trl.py), used by both sides.

stagerl loads it as `custom_reward_function.path` (verl's signature `compute_score(data_source,
solution_str, ground_truth, extra_info)`); TRL's GRPOTrainer gets `trl_reward`, the same rule
wrapped in TRL's `reward_funcs` signature. It imports only stages/scoring/scorers.py (standard library
only), so it loads in either virtual environment.

The rule is stagerl's arithmetic scorer (stages.scoring.scorers.compute_score_arith): 1.0 when the last
integer of the response equals the integer ground truth, else 0.0. Even an untrained tiny model
hits it now and then (its responses are random tokens, digits among them), so the advantages are
not all zero and both trainers do a real update.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: stages.scoring.scorers
from stages.scoring.scorers import compute_score_arith  # noqa: E402


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """verl's custom reward signature: {"score": 1.0 or 0.0, "acc": bool}."""
    return compute_score_arith(solution_str, ground_truth)


def completion_text(completion) -> str:
    """TRL passes a completion as text, or (conversational prompts) as a list of messages."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content") or "" for message in completion)


def trl_reward(prompts, completions, ground_truth, data_source=None, **kwargs) -> list[float]:
    """TRL's reward_funcs signature: dataset columns arrive as keyword lists, one per row."""
    sources = data_source or [None] * len(completions)
    return [float(compute_score(src, completion_text(c), gt)["score"])
            for src, c, gt in zip(sources, completions, ground_truth)]
