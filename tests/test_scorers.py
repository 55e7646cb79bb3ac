"""Rule scorers: verl's GSM8K and \\boxed{} math rules, the arith task, dispatch by data_source."""
import pytest

from stages.scoring.scorers import (
    GSM8K_CLIP_CHARS, UnknownDataSourceError, compute_score_arith, compute_score_gsm8k,
    compute_score_math, default_compute_score, extract_last_integer, extract_solution, is_equiv,
    last_boxed_only_string, remove_boxed, strip_string)


# --- GSM8K -----------------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    ("Adding up gives 72.\n#### 72", "72"),
    ("#### 72.", "72."),                     # trailing dot is part of the match
    ("#### $1,000", None),                   # "$" before the digits: no strict match
    ("#### 1,000", "1000"),                  # commas removed
    ("#### -3", "-3"),
    ("#### 72 wait, no: #### 73", "73"),     # last match counts
    ("####72", None),                        # the space after #### is required
    ("The answer is 72", None),
])
def test_gsm8k_strict_extraction(response, expected):
    assert extract_solution(response, "strict") == expected


@pytest.mark.parametrize("response, ground_truth, score", [
    ("#### 72", "72", 1.0),
    ("#### 72.", "72", 0.0),
    ("#### $1,000", "1000", 0.0),
    ("#### 72 ... then #### 73", "73", 1.0),
    ("#### 72 ... then #### 73", "72", 0.0),
    ("The answer is 72", "72", 0.0),
])
def test_gsm8k_score(response, ground_truth, score):
    assert compute_score_gsm8k(response, ground_truth) == score


def test_gsm8k_only_the_last_300_characters_are_searched():
    inside = "#### 72" + "x" * (GSM8K_CLIP_CHARS - len("#### 72"))
    assert len(inside) == GSM8K_CLIP_CHARS and extract_solution(inside) == "72"
    outside = "#### 72" + "x" * (GSM8K_CLIP_CHARS - len("#### 72") + 1)
    assert extract_solution(outside) is None
    assert compute_score_gsm8k(outside, "72") == 0
    # A marker cut in half by the clip no longer matches.
    assert extract_solution("#### 72" + "x" * (GSM8K_CLIP_CHARS - 6)) is None


def test_gsm8k_format_score_and_custom_score():
    assert compute_score_gsm8k("#### 71", "72", format_score=0.1) == 0.1
    assert compute_score_gsm8k("no answer", "72", format_score=0.1) == 0
    assert compute_score_gsm8k("#### 72", "72", score=2.0) == 2.0


@pytest.mark.parametrize("response, expected", [
    ("so 3 + 4 = 7", "7"),
    ("total 1,000 dollars", "1,000"),        # flexible keeps commas
    ("it is 72.", "72."),                    # dot is part of the run
    ("12 apples. .", "12"),                  # lone "." runs are skipped
    ("x = -5 end", "-5"),
    ("no digits here", None),
    ("only a dot .", "."),                   # all runs invalid: verl's loop leaves the first
])
def test_gsm8k_flexible_extraction(response, expected):
    assert extract_solution(response, "flexible") == expected


def test_gsm8k_flexible_score_and_bad_method():
    assert compute_score_gsm8k("the answer: 72", "72", method="flexible") == 1.0
    assert compute_score_gsm8k("the answer: 1,000", "1000", method="flexible") == 0.0
    with pytest.raises(ValueError, match="strict.*flexible"):
        extract_solution("#### 1", "loose")


# --- \boxed{} math ---------------------------------------------------------------------------

def test_last_boxed_only_string_and_remove_boxed():
    text = "first \\boxed{1} then \\boxed{\\frac{1}{2}} done"
    assert last_boxed_only_string(text) == "\\boxed{\\frac{1}{2}}"
    assert remove_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed_only_string("$\\boxed 5$ more") == "\\boxed 5"
    assert remove_boxed("\\boxed 5") == "5"
    assert last_boxed_only_string("\\boxed{unclosed") is None
    assert last_boxed_only_string("no box") is None
    assert last_boxed_only_string("\\fbox{3}") == "\\fbox{3}"
    with pytest.raises(ValueError):
        remove_boxed("\\fbox{3}")


@pytest.mark.parametrize("answer, truth", [
    ("\\frac{1}{2}", "\\frac12"),
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("0.5", "\\frac{1}{2}"),
    ("1/2", "\\frac{1}{2}"),
    ("x = 5", "5"),
    ("10^{\\circ}", "10"),
    ("\\sqrt3", "\\sqrt{3}"),
    ("5\\text{ cm}", "5"),
    ("\\left(1, 2\\right)", "(1,2)"),
    (".5", "0.5"),
    ("50\\%", "50"),
])
def test_is_equiv_normalisation(answer, truth):
    assert is_equiv(answer, truth)


@pytest.mark.parametrize("answer, truth", [
    ("\\frac{1}{3}", "\\frac12"), ("2", "3"), ("01/2", "\\frac{1}{2}"), ("5 cm", "5"),
])
def test_is_equiv_rejects(answer, truth):
    assert not is_equiv(answer, truth)


def test_strip_string_falls_back_to_raw_comparison_when_normalising_fails():
    with pytest.raises(IndexError):
        strip_string("2\\frac")                       # bare trailing \frac, as in verl
    assert is_equiv("2\\frac", "2\\frac") and not is_equiv("2\\frac", "2")
    assert is_equiv(None, None) and not is_equiv(None, "1")


def test_compute_score_math():
    assert compute_score_math("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac12") == 1.0
    assert compute_score_math("\\boxed{3} no wait \\boxed{4}", "4") == 1.0
    assert compute_score_math("\\boxed{3} no wait \\boxed{4}", "3") == 0.0
    assert compute_score_math("the answer is 4", "4") == 0.0
    assert compute_score_math("\\fbox{4}", "4") == 0.0   # verl's remove_boxed rejects \fbox


# --- arith -----------------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    ("#### 19", 19), ("12 + 7 = 19", 19), ("20-1=19", 19), ("x = -19", -19), ("-4", -4),
    ("(3)-4", 4), ("answer: +7", 7), ("nothing", None), ("1,000", 0),
])
def test_extract_last_integer(response, expected):
    assert extract_last_integer(response) == expected


def test_compute_score_arith():
    assert compute_score_arith("#### 19", "19") == {"score": 1.0, "acc": True}
    assert compute_score_arith("... = 19", " 19 ") == {"score": 1.0, "acc": True}
    assert compute_score_arith("= -3", "-3") == {"score": 1.0, "acc": True}
    assert compute_score_arith("= 18", "19") == {"score": 0.0, "acc": False}
    assert compute_score_arith("no idea", "19", format_score=0.1) == {"score": 0.1, "acc": False}


# --- dispatch --------------------------------------------------------------------------------

def test_default_compute_score_dispatches_by_data_source():
    assert default_compute_score("openai/gsm8k", "#### 72", "72") == {"score": 1.0, "acc": True}
    assert default_compute_score("openai/gsm8k", "#### 71", "72") == {"score": 0.0, "acc": False}
    assert default_compute_score("openai/gsm8k", "is 72", "72", method="flexible")["score"] == 1.0
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert default_compute_score(source, "\\boxed{\\frac{1}{2}}", "\\frac12") == {"score": 1.0, "acc": True}
    assert default_compute_score("stagerl/arith", "= 19", "19", {"index": 0}) == {"score": 1.0, "acc": True}


def test_unknown_data_source_names_it_and_lists_known():
    with pytest.raises(UnknownDataSourceError) as info:
        default_compute_score("my/dataset", "#### 1", "1")
    message = str(info.value)
    assert "'my/dataset'" in message
    for known in ("openai/gsm8k", "lighteval/MATH", "HuggingFaceH4/MATH-500", "stagerl/arith"):
        assert known in message
    assert isinstance(info.value, NotImplementedError)   # verl's exception type
