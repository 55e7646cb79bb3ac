"""Rule-based reward scorers, chosen by data_source (verl's `default_compute_score`).

Pure functions, no third-party imports. GSM8K and the \\boxed{} math scorer reproduce verl's
`verl/utils/reward_score/gsm8k.py` and `math_reward.py` rule for rule (quirks included), so a
reward computed here equals the one verl computes for the same response and ground truth.
Every registered scorer returns {"score": float, "acc": bool}; the score is verl's value.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from storage.registry import register_in

# ---------------------------------------------------------------------------------------------
# The registry: rule scorers by data_source (verl's default_compute_score dispatch)

SCORERS: dict[str, Callable[..., dict]] = {}


def register_scorer(*data_sources: str) -> Callable[[Callable], Callable]:
    """Decorator: `fn(solution_str, ground_truth, extra_info=None, **kwargs) -> {"score", "acc"}`
    scores the rows whose data_source is one of `data_sources`."""
    return register_in(SCORERS, data_sources, "reward scorer")


# ---------------------------------------------------------------------------------------------
# GSM8K (verl gsm8k.py)

GSM8K_CLIP_CHARS = 300  # verl searches only the tail of the response
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer verl reads from a response, or None.

    strict: the last "#### <number>" ("," and "$" removed); flexible: the last run of
    digits/dots/commas that is not "." (commas kept; when every run is invalid verl's loop
    leaves the first one, which is reproduced here).
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"GSM8K extraction method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _GSM8K_NUMBER.findall(tail)
    if not found:
        return None
    valid = [text for text in found if text not in ("", ".")]
    return valid[-1] if valid else found[0]


def compute_score_gsm8k(solution_str: str, ground_truth: str, method: str = "strict",
                        format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's GSM8K score: `score` on a string-equal answer, `format_score` on another answer,
    0 when no answer is found."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score


@register_scorer("openai/gsm8k")
def _gsm8k_scorer(solution_str, ground_truth, extra_info=None, method="strict",
                  format_score=0.0, score=1.0) -> dict:
    answer = extract_solution(solution_str, method=method)
    value = compute_score_gsm8k(solution_str, ground_truth, method, format_score, score)
    return {"score": float(value), "acc": answer is not None and answer == ground_truth}


# ---------------------------------------------------------------------------------------------
# \boxed{} math answers (verl math_reward.py, after lm-evaluation-harness hendrycks_math)

def last_boxed_only_string(string: str) -> str | None:
    """The last "\\boxed{...}" (braces balanced) or "\\boxed ..." span, else the last "\\fbox{...}"."""
    if "\\boxed " in string:  # verl checks the space form first, wherever it occurs
        return "\\boxed " + string.split("\\boxed ")[-1].split("$")[0]
    start = string.rfind("\\boxed")
    if start < 0:
        start = string.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for position in range(start, len(string)):
        if string[position] == "{":
            depth += 1
        elif string[position] == "}":
            depth -= 1
            if depth == 0:
                return string[start:position + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """Content of a "\\boxed{...}" or "\\boxed ..." span; anything else (e.g. \\fbox) raises."""
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise ValueError(f"not a boxed answer: {boxed!r}")
        return boxed[len("\\boxed "):]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(f"not a boxed answer: {boxed!r}")
    return boxed[len("\\boxed{"):-1]


def _fix_fracs(string: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}; raises on a bare trailing \\frac."""
    head, *pieces = string.split("\\frac")
    out = head
    for piece in pieces:
        out += "\\frac"
        if piece[0] == "{":  # IndexError on "" is verl's behaviour (caught by is_equiv)
            out += piece
            continue
        if len(piece) < 2:
            return string
        first, second, rest = piece[0], piece[1], piece[2:]
        out += "{" + first + "}" + (second if second == "{" else "{" + second + "}") + rest
    return out


def _fix_a_slash_b(string: str) -> str:
    """"3/4" -> "\\frac{3}{4}" when both sides are plain integers written canonically."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    if string != f"{numerator}/{denominator}":
        return string
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def _remove_right_units(string: str) -> str:
    if "\\text{ " not in string:
        return string
    parts = string.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError(f"more than one '\\text{{ ' unit in {string!r}")
    return parts[0]


def _fix_sqrt(string: str) -> str:
    """\\sqrt3 -> \\sqrt{3}; raises on a bare trailing \\sqrt (as verl does)."""
    if "\\sqrt" not in string:
        return string
    head, *pieces = string.split("\\sqrt")
    return head + "".join(
        "\\sqrt" + piece if piece[0] == "{" else "\\sqrt{" + piece[0] + "}" + piece[1:]
        for piece in pieces)


def strip_string(string: str) -> str:
    """verl's normalisation of a LaTeX answer before string comparison (same steps, same order)."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""),
                     ("\\$", "")):
        string = string.replace(old, new)
    string = _remove_right_units(string)
    for old, new in (("\\\\%", ""), ("\\%", ""), (" .", " 0."), ("{.", "{0.")):
        string = string.replace(old, new)
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    sides = string.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # drop a short "k = " prefix
        string = sides[1]
    string = _fix_sqrt(string).replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


def is_equiv(str1: str | None, str2: str | None) -> bool:
    """Equal after strip_string; if normalising raises, equal as raw strings."""
    if str1 is None or str2 is None:
        return str1 is None and str2 is None
    try:
        return strip_string(str1) == strip_string(str2)
    except Exception:
        return str1 == str2


def compute_score_math(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer is equivalent to the ground truth, else 0.0."""
    try:
        boxed = last_boxed_only_string(solution_str)
        if boxed is not None and is_equiv(remove_boxed(boxed), ground_truth):
            return 1.0
    except Exception:  # verl prints and scores 0
        pass
    return 0.0


@register_scorer("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
def _math_scorer(solution_str, ground_truth, extra_info=None) -> dict:
    value = compute_score_math(solution_str, ground_truth)
    return {"score": value, "acc": value == 1.0}


# ---------------------------------------------------------------------------------------------
# The synthetic arithmetic task (`stagerl data arith`)

_DIGITS = re.compile(r"\d+")


def extract_last_integer(text: str) -> int | None:
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


def compute_score_arith(solution_str: str, ground_truth: str, format_score: float = 0.0) -> dict:
    """1.0 when the last integer of the response equals the integer ground truth, else
    `format_score`."""
    answer = extract_last_integer(solution_str)
    correct = answer is not None and answer == int(str(ground_truth).strip())
    return {"score": 1.0 if correct else float(format_score), "acc": correct}


@register_scorer("stagerl/arith")
def _arith_scorer(solution_str, ground_truth, extra_info=None, format_score=0.0) -> dict:
    return compute_score_arith(solution_str, ground_truth, format_score)


@register_scorer("stagerl/arith-tool")
def _arith_tool_scorer(solution_str, ground_truth, extra_info=None) -> dict:
    """The calculator task (stages.data.tools.make_tool_arith_dataset): 1.0 when the last
    "#### <number>" equals the ground truth (verl's strict GSM8K rule), so the number the tool
    answered, also in the response (masked), earns nothing unless the model writes it after ####."""
    answer = extract_solution(solution_str, method="strict")
    correct = answer is not None and answer == str(ground_truth).strip()
    return {"score": 1.0 if correct else 0.0, "acc": correct}


# ---------------------------------------------------------------------------------------------
# Dispatch

class UnknownDataSourceError(NotImplementedError):
    """No rule scorer is registered for a data_source (verl raises NotImplementedError too)."""


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict | None = None, **scorer_kwargs) -> dict:
    """Score one response with the rule scorer registered for its data_source.

    `scorer_kwargs` go to the scorer (e.g. method="flexible" for GSM8K, verl's
    reward.compute_score_kwargs). Returns {"score": float, "acc": bool}.
    """
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise UnknownDataSourceError(
            f"no reward scorer for data_source={data_source!r}; known data sources: "
            f"{', '.join(sorted(SCORERS))} (or set custom_reward_function.path)")
    return scorer(solution_str, ground_truth, extra_info, **scorer_kwargs)
