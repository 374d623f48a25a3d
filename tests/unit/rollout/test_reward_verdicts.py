"""Judge templates and verdict parsers: yes/no, a score, a letter; garbage is failed, not guessed."""

from __future__ import annotations

import pytest

from relax_hpc.rollout.rewards.verdicts import (
    JUDGE_TEMPLATES,
    TemplateError,
    build_verdict,
    letter_parser,
    parse_yes_no,
    render,
    score_parser,
    template_text,
)
from relax_hpc.tasks.verifier import verification_text


@pytest.mark.parametrize(
    ("answer", "score", "verdict"),
    [
        ("yes", 1.0, "yes"),
        ("No.", 0.0, "no"),
        ("<think>is it? no wait</think> Yes, it is correct.", 1.0, "yes"),
        ("The answer is incorrect", 0.0, "incorrect"),
        ("TRUE", 1.0, "true"),
    ],
)
def test_yes_no_reads_the_first_verdict_after_the_reasoning(answer, score, verdict):
    result = parse_yes_no(answer)
    assert (result.score, result.details["verdict"], result.failed) == (score, verdict, None)


@pytest.mark.parametrize("answer", ["", "maybe", "<think>yes", "yesterday nothing", "ye"])
def test_yes_no_without_a_verdict_is_failed_with_the_answer_quoted(answer):
    result = parse_yes_no(answer)
    assert result.score == 0.0
    assert result.failed.startswith("the judge's answer has no yes/no verdict: ")
    assert repr(" ".join(answer.split())[:80]) in result.failed


def test_score_is_mapped_from_its_range_and_rejected_outside_it():
    parse = score_parser([0, 10])
    assert parse("Score: 7").score == pytest.approx(0.7)
    assert parse("  8  ").score == pytest.approx(0.8)
    assert parse("first 3... final score = 10").score == 1.0
    assert parse("Score: 12").failed == (
        "the judge's score 12 is outside judge.score_range [0, 10]"
    )
    assert "has no score" in parse("excellent work").failed
    assert score_parser([1, 5])("Score: 3").score == pytest.approx(0.5)


def test_letter_is_looked_up_and_unknown_letters_are_failed():
    parse = letter_parser({"A": 1.0, "B": 0.0, "c": 0.5})
    assert parse("[[A]]").score == 1.0
    assert parse("Answer: b").details == {"verdict": "B"}
    assert parse("(C)").score == 0.5
    assert "does not score" in parse("[[D]]").failed
    assert "names no letter" in parse("I think so").failed


def test_build_verdict_names_the_known_parsers():
    assert build_verdict("yes_no")("yes").score == 1.0
    assert build_verdict("letter", letter_scores={"Y": 1})("[[Y]]").score == 1.0
    with pytest.raises(ValueError, match="yes_no, score, letter"):
        build_verdict("stars")


def test_templates_fill_prompt_response_reference_and_row_columns():
    text = render("{source}: {prompt}|{response}|{reference}", "2+2=", "4", "4", {"source": "gsm"})
    assert text == "gsm: 2+2=|4|4"
    # braces in a response are kept as they are, never parsed as fields
    assert render("{response}", "", "\\boxed{x}", "", {}) == "\\boxed{x}"
    with pytest.raises(TemplateError, match=r"needs \{difficulty\}.*columns: source"):
        render("{difficulty} {response}", "", "r", "", {"source": "x"})


def test_built_in_templates_resolve_and_others_need_a_response_field():
    assert template_text("correctness") == JUDGE_TEMPLATES["correctness"]
    assert template_text("Grade: {response}") == "Grade: {response}"
    with pytest.raises(TemplateError, match="neither a built-in template"):
        template_text("corectness")


def test_the_verifier_is_trained_on_what_the_addition_template_renders():
    rendered = render(template_text("addition_verifier"), "37+48=", "58", "58", {})
    assert rendered == verification_text(37, 48, "58") == "37+48=58?"
