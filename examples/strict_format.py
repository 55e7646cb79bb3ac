"""A stricter reward for the arithmetic task (the README tour's `stagerl rescore`): 1.0 only when
the response gives the right answer in the format the prompt asks for, "#### <answer>", as its
last line; the built-in scorer (stages/scoring/scorers.py) accepts the last integer anywhere.
verl's custom_reward_function signature: compute_score(data_source, solution_str, ground_truth,
extra_info)."""
import re

_FINAL = re.compile(r"####\s*(-?\d+)\s*$")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    match = _FINAL.search(solution_str or "")
    correct = match is not None and int(match.group(1)) == int(str(ground_truth).strip())
    return {"score": 1.0 if correct else 0.0, "acc": correct}
