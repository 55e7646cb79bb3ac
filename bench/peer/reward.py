"""The one reward function of the peer benchmark (bench/peer_trl.py), used by both sides.

stagerl loads it as `custom_reward_function.path` (verl's signature `compute_score(data_source,
solution_str, ground_truth, extra_info)`); TRL's GRPOTrainer gets `trl_reward`, the same rule
wrapped in TRL's `reward_funcs` signature. It imports nothing from stagerl or TRL, so it loads in
either virtual environment.

The rule is stagerl's arithmetic scorer (stages.scorers.compute_score_arith): 1.0 when the last
integer of the response equals the integer ground truth, else 0.0. Even an untrained tiny model
hits it now and then (its responses are random tokens, digits among them), so the advantages are
not all zero and both trainers do a real update.
"""
from __future__ import annotations

import re

_DIGITS = re.compile(r"\d+")


def last_integer(text: str) -> int | None:
    """Last integer in the text; a "-" or "+" right before it is its sign unless it follows a
    letter, digit or ")" (so "20-1=19" gives 19, "x = -19" gives -19)."""
    match = None
    for match in _DIGITS.finditer(text):
        pass
    if match is None:
        return None
    value, start = int(match.group()), match.start()
    if start > 0 and text[start - 1] in "+-":
        before = text[start - 2] if start > 1 else " "
        if not (before.isalnum() or before in ")_"):
            value = -value if text[start - 1] == "-" else value
    return value


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """verl's custom reward signature: {"score": 1.0 or 0.0, "acc": bool}."""
    answer = last_integer(solution_str)
    correct = answer is not None and answer == int(str(ground_truth).strip())
    return {"score": 1.0 if correct else 0.0, "acc": correct}


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
