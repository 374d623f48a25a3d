"""What a judge reads (templates) and how its answer becomes a score (verdict parsers).

A template is a built-in name (``JUDGE_TEMPLATES``) or text with ``{response}`` and any of
``{prompt}``, ``{reference}`` and the row's columns (``{source}``...); literal braces are
doubled. A verdict parser turns the judge's answer into a ``RewardResult``; an answer it
cannot read is *failed* with the reason and the answer's start, never guessed:

| verdict | reads | score |
|---|---|---|
| ``yes_no`` | the first yes/no (or true/false, correct/incorrect) after any ``<think>`` block | 1 / 0 |
| ``score`` | ``Score: 7`` (or an answer that is one number) within ``score_range`` | 0..1 |
| ``letter`` | ``[[B]]``, ``Answer: B`` or a lone letter, looked up in ``letter_scores`` | as given |

Must not: import torch or the engines (the judge server and the rollout both use it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relax_hpc.rollout.rewards.result import RewardResult, failed

JUDGE_TEMPLATES = {
    # grpo_tiny_judge's verifier reads "37+48=58?" (tasks/verifier.py trains on it)
    "addition_verifier": "{prompt}{response}?",
    "correctness": (
        "You are grading a response to a problem against the reference answer.\n\n"
        "Problem:\n{prompt}\n\nReference answer: {reference}\n\nResponse:\n{response}\n\n"
        "Is the response's final answer equivalent to the reference answer? "
        "Reply with one word: yes or no."
    ),
    "quality_score": (
        "Rate how well the response answers the problem, from 0 (useless) to 10 (perfect).\n\n"
        "Problem:\n{prompt}\n\nResponse:\n{response}\n\nReply in the form: Score: <0-10>"
    ),
    "correctness_letter": (
        "Problem:\n{prompt}\n\nReference answer: {reference}\n\nResponse:\n{response}\n\n"
        "Is the response correct? Reply [[A]] if it is, [[B]] if it is not."
    ),
}
EXCERPT_CHARS = 80  # of a judge answer quoted in a failure reason

Verdict = Callable[[str], RewardResult]

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_YES_NO = re.compile(r"\b(yes|no|true|false|correct|incorrect)\b", re.IGNORECASE)
_YES_WORDS = ("yes", "true", "correct")
_SCORE = re.compile(r"score\s*[:=]?\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_LONE_NUMBER = re.compile(r"^\W*(-?\d+(?:\.\d+)?)\W*$")
_BRACKETED_LETTER = re.compile(r"\[\[\s*([A-Za-z])\s*\]\]")
_ANSWER_LETTER = re.compile(r"answer\s*(?:is|:)\s*\(?([A-Za-z])\b", re.IGNORECASE)
_LONE_LETTER = re.compile(r"^\W*\(?([A-Za-z])\)?\W*$")


class TemplateError(ValueError):
    """A template names a field the row does not have, or is not a usable format string."""


def template_text(template: str) -> str:
    """A built-in template's text, or ``template`` itself (it must mention ``{response}``)."""
    text = JUDGE_TEMPLATES.get(template, template)
    if "{response}" not in text:
        raise TemplateError(
            f"judge.template {template!r} is neither a built-in template (known: "
            f"{', '.join(JUDGE_TEMPLATES)}) nor text with {{response}}"
        )
    return text


def render(
    template: str, prompt: str, response: str, reference: str, metadata: Mapping[str, Any]
) -> str:
    """``template`` (text) filled in; ``TemplateError`` naming a field the row lacks."""
    fields = {**{str(k): v for k, v in metadata.items()}}
    fields.update(prompt=prompt, response=response, reference=reference)
    try:
        return template.format_map(fields)
    except KeyError as err:
        raise TemplateError(
            f"the judge template needs {{{err.args[0]}}}, which this row does not have "
            f"(columns: {', '.join(sorted(map(str, metadata))) or 'none'})"
        ) from None
    except (IndexError, ValueError) as err:
        raise TemplateError(f"the judge template is not a format string: {err}") from None


def _excerpt(answer: str) -> str:
    flat = " ".join(answer.split())
    return repr(flat[:EXCERPT_CHARS] + ("..." if len(flat) > EXCERPT_CHARS else ""))


def _visible(answer: str) -> str:
    """The answer without its reasoning block (an unclosed ``<think>`` hides the rest)."""
    return _THINK.sub(" ", answer)


def parse_yes_no(answer: str) -> RewardResult:
    match = _YES_NO.search(_visible(answer))
    if match is None:
        return failed(f"the judge's answer has no yes/no verdict: {_excerpt(answer)}")
    word = match.group(1).lower()
    return RewardResult(float(word in _YES_WORDS), {"verdict": word})


def score_parser(score_range: Sequence[float]) -> Verdict:
    low, high = float(score_range[0]), float(score_range[1])

    def parse_score(answer: str) -> RewardResult:
        visible = _visible(answer)
        found = _SCORE.findall(visible) or _LONE_NUMBER.findall(visible)
        if not found:
            return failed(f"the judge's answer has no score: {_excerpt(answer)}")
        value = float(found[-1])
        if not low <= value <= high:
            return failed(
                f"the judge's score {value:g} is outside judge.score_range [{low:g}, {high:g}]"
            )
        return RewardResult((value - low) / (high - low), {"verdict": value})

    return parse_score


def letter_parser(letter_scores: Mapping[str, float]) -> Verdict:
    scores = {letter.upper(): float(value) for letter, value in letter_scores.items()}

    def parse_letter(answer: str) -> RewardResult:
        visible = _visible(answer)
        match = (
            _BRACKETED_LETTER.search(visible)
            or _ANSWER_LETTER.search(visible)
            or _LONE_LETTER.match(visible)
        )
        if match is None:
            return failed(f"the judge's answer names no letter: {_excerpt(answer)}")
        letter = match.group(1).upper()
        if letter not in scores:
            return failed(
                f"the judge chose {letter}, which judge.letter_scores does not score "
                f"(known: {', '.join(scores)})"
            )
        return RewardResult(scores[letter], {"verdict": letter})

    return parse_letter


def build_verdict(
    name: str, score_range: Sequence[float] = (0.0, 10.0), letter_scores: Mapping | None = None
) -> Verdict:
    """``judge.verdict`` as a parser; ``ValueError`` naming the known ones."""
    if name == "yes_no":
        return parse_yes_no
    if name == "score":
        return score_parser(score_range)
    if name == "letter":
        return letter_parser(letter_scores or {"A": 1.0, "B": 0.0})
    raise ValueError(f"judge.verdict {name!r} is not one of yes_no, score, letter")
