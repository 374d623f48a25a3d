"""The rewards of the published recipes, on completions as models write them (and break them)."""

from __future__ import annotations

import pytest

from relax_hpc.rollout.rewards import (
    REWARDS,
    boxed_math_reward,
    dapo_math_reward,
    geo3k_reward,
    minerva_normalize,
    multiple_choice_reward,
    resolve_reward,
)

DAPO_PROMPT_TAIL = 'Remember to put your answer on its own line after "Answer:".'
LONG_REASONING = "Let me think about this carefully. " * 40  # > 300 characters


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("The roots sum to 7, so 3 + 4 = 7.\nAnswer: 34", "34", 1.0),
        ("So the total is $1,000.\nAnswer: $1,000$", "1000", 1.0),
        ("Hence the ratio.\nAnswer: \\frac12", "\\frac{1}{2}", 1.0),
        ("Therefore x = 5.\nanswer : 5 degrees", "5", 1.0),
        ("First guess.\nAnswer: 12\nWait, I made an error.\nAnswer: 13", "13", 1.0),
        ("First guess.\nAnswer: 12\nWait, I made an error.\nAnswer: 13", "12", -1.0),
        ("Answer: 34\n" + LONG_REASONING, "34", -1.0),  # the answer line is not in the tail
        (LONG_REASONING + "\nAnswer: 34", "34", 1.0),
        ("The answer is \\boxed{34}.", "34", -1.0),  # DAPO reads Answer: lines only
        ("", "34", -1.0),
        ("Answer:", "34", -1.0),
        ("Answer: \\boxed{34", "34", -1.0),  # unbalanced braces do not crash the reward
        ("I think it is 2\\sqrt{3}.\nAnswer: 2\\sqrt3", "2\\sqrt{3}", 1.0),
    ],
)
def test_dapo_math_scores_one_or_minus_one_on_the_last_answer_line(completion, answer, score):
    result = dapo_math_reward(completion, answer, {})
    assert result.score == score, result
    assert result.details["acc"] is (score == 1.0)


def test_minerva_normalisation_matches_dapo_on_typical_answers():
    assert minerva_normalize("$\\boxed{\\text{(B)}}$") == "(B)"
    assert minerva_normalize("x = 10 \\text{ cm}") == "10"
    assert minerva_normalize("12,345") == "12345"
    assert minerva_normalize("90^\\circ") == "90"


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("<think>...</think> The answer is $\\boxed{\\dfrac{3}{4}}$.", "0.75", 1.0),
        ("\\boxed{2} is wrong, so \\boxed{3}", "3", 1.0),
        ("Answer: 3", "3", 0.0),  # no box: boxed_math does not read Answer: lines
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("\\boxed{\\frac{1}{2}", "1/2", 0.0),  # never closed
        ("\\boxed{}", "0", 0.0),
        ("\\boxed{\\text{no idea}}", "4", 0.0),
    ],
)
def test_boxed_math_verifies_the_last_box(completion, answer, score):
    assert boxed_math_reward(completion, answer, {}).score == score


@pytest.mark.parametrize(
    ("completion", "answer", "metadata", "score"),
    [
        ("Comparing the options, the answer is (C).", "C", {}, 1.0),
        ("Answer: B", "(B)", {}, 1.0),
        ("Option A looks tempting, but the correct choice is D.\nAnswer: D", "D", {}, 1.0),
        ("Therefore \\boxed{\\text{B}}", "B", {}, 1.0),
        ("I am torn between them.", "B", {}, 0.0),
        ("The answer is A. On reflection, the answer is C.", "C", {}, 1.0),
        ("The answer is C", "B", {}, 0.0),
        ("Final answer:\n(b)", "B", {}, 1.0),
        ("The answer is 42", "42", {"options": ["17", "42", "9"]}, 0.0),
        ("The answer is B", "42", {"options": ["17", "42", "9"]}, 1.0),
        ("The answer is B", "B. 42", {}, 1.0),
    ],
)
def test_multiple_choice_compares_letters(completion, answer, metadata, score):
    assert multiple_choice_reward(completion, answer, metadata).score == score


def test_multiple_choice_with_an_unreadable_reference_is_a_recorded_failure():
    from relax_hpc.rollout.rewards import call_reward

    result = call_reward(multiple_choice_reward, "The answer is B", "forty-two", {})
    assert result.score == 0.0 and "neither a letter" in result.failed


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("<think>AB = 2 x 6 = 12</think> The length is \\boxed{12}.", "12", 1.0),
        ("The length is \\boxed{12}.", "12", 0.9),  # correct, no think block
        ("<think>similar triangles</think> \\boxed{7}", "12", 0.1),  # formatted, wrong
        ("<think>angles sum to 180</think> so x = \\boxed{60^\\circ}", "60", 1.0),
        ("<think>h = 2\\sqrt{3}</think>\\boxed{2 \\sqrt { 3 }}", "2\\sqrt{3}", 1.0),
        ("<think>never finished", "12", 0.0),
        ("", "12", 0.0),
    ],
)
def test_geo3k_is_ninety_percent_accuracy_ten_percent_format(completion, answer, score):
    assert geo3k_reward(completion, answer, {}).score == pytest.approx(score)


def test_every_builtin_reward_resolves_and_survives_garbage():
    garbage = ["", "\\boxed{", "}}}{{{", "Answer:\n\n", "\x00\ufffd" * 50, "A" * 5000]
    for name in REWARDS:
        fn = resolve_reward(name)
        for completion in garbage:
            result = fn(completion, "B" if name == "multiple_choice" else "12", {})
            assert -1.0 <= result.score <= 1.0, (name, completion[:20])


def test_the_reward_process_imports_no_torch():
    """The scorer's child process imports this package: it must start light."""
    import subprocess
    import sys

    code = "import sys, relax_hpc.rollout.rewards; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
