"""Reward functions for the fork and rescore tests (custom_reward_function.path): scores that
depend on the sampled text, so that even the untrained tiny model's groups have advantages."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A spread of scores in [0, 1] (what the source run trains with)."""
    return (sum(map(ord, solution_str)) % 5) / 4


def parity(data_source, solution_str, ground_truth, extra_info=None):
    """The changed reward a rescore compares: 1 for an even character sum, else 0."""
    return float(sum(map(ord, solution_str)) % 2)
