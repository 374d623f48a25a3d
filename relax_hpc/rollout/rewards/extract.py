"""Finding the final answer in a completion: ``\\boxed{}``, ``Answer:`` lines, choice letters.

Pure string functions shared by the built-in rewards. Models write answers sloppily (an
unclosed brace, a second ``Answer:`` after second thoughts, ``(B)`` or ``B.``), so each
extractor takes the *last* well-formed answer and returns ``None`` rather than guessing.

Must not: import torch or anything heavy; the reward process imports this module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

# The tail of a response where a DAPO-style "Answer:" line counts; earlier text is reasoning.
# DAPO keeps the last 300 characters ("the longest answer in MATH-500 has 159").
ANSWER_TAIL_CHARS = 300
_ANSWER_LINE = re.compile(r"Answer\s*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
CHOICE_LETTERS = "ABCDEFGHIJ"


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, begin = 0, start + len("\\boxed{")
        for position in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            if depth < 0:
                return text[begin:position]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


def last_answer_line(completion: str, tail_chars: int = ANSWER_TAIL_CHARS) -> str | None:
    """The text after the last ``Answer:`` in the completion's last ``tail_chars`` characters."""
    lines = _ANSWER_LINE.findall(completion[-tail_chars:])
    return lines[-1] if lines else None


def final_answer(completion: str) -> str | None:
    """The content of the last ``\\boxed{...}``, else of the last ``Answer:`` line in the tail."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    return last_answer_line(completion)


def as_boxed(expression: str) -> str:
    return expression if "\\boxed" in expression else f"\\boxed{{{expression}}}"


# Minerva's answer normalisation (Lewkowycz et al. 2022, appendix D), which DAPO's reward
# applies to both the prediction and the reference before comparing them as strings.
_MINERVA_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_MINERVA_REMOVED = (
    *("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units"),
    *("\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm"),
    *("gm", "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples"),
    *("\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}"),
    *("\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots"),
)
_MINERVA_UNWRAP = tuple(
    re.compile(pattern)
    for pattern in (r"\\text\{(.*?)\}", r"\\textbf\{(.*?)\}", r"\\overline\{(.*?)\}")
)


def minerva_normalize(answer: str) -> str:
    """A final answer reduced to the string DAPO compares (``"\\$1,000"`` -> ``"1000"``)."""
    text = answer.split("=")[-1]
    for old, new in _MINERVA_SUBSTITUTIONS:
        text = text.replace(old, new)
    for expression in _MINERVA_REMOVED:
        text = text.replace(expression, "")
    text = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", text)  # the first $...$ only
    for pattern in _MINERVA_UNWRAP:
        text = pattern.sub(r"\1", text)
    text = re.sub(r"\\boxed\{(.*)\}", r"\1", text)
    text = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", text)  # \frac12 -> \frac{1}{2}
    text = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", text)  # \sqrt2 -> \sqrt{2}
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


# A choice the model commits to: "Answer: (B)", "answer is C", "\boxed{D}", "**B**".
_CHOICE_STATEMENTS = (
    re.compile(r"answer\s*(?:is|:)?\s*:?\s*\(?\**\s*([A-J])\b\)?", re.IGNORECASE),
    re.compile(r"(?:option|choice)\s*\(?([A-J])\b\)?", re.IGNORECASE),
)
_LONE_CHOICE = re.compile(r"^\W*\(?([A-J])\)?[.:)]?\W*$")


def choice_letter(completion: str) -> str | None:
    """The letter the completion finally chooses, or None when it names none unambiguously."""
    boxed = last_boxed(completion)
    if boxed is not None:
        inner = re.sub(r"\\text\{(.*?)\}", r"\1", boxed).strip(" ().*")
        return inner.upper() if len(inner) == 1 and inner.upper() in CHOICE_LETTERS else None
    tail = completion[-ANSWER_TAIL_CHARS:]
    found = [m for pattern in _CHOICE_STATEMENTS for m in pattern.finditer(tail)]
    if found:
        return max(found, key=lambda match: match.start()).group(1).upper()
    lines = [line for line in tail.strip().splitlines() if line.strip()]
    lone = _LONE_CHOICE.match(lines[-1]) if lines else None
    return lone.group(1).upper() if lone else None


def reference_letter(answer: str, metadata: Mapping[str, Any]) -> str | None:
    """The reference choice: the text of one of the row's options (``metadata["options"]``
    or ``["choices"]``, in letter order), else a letter (``"B"``, ``"(B)"``, ``"B. 42"``)."""
    text = str(answer).strip()
    options = metadata.get("options") or metadata.get("choices")
    if isinstance(options, Sequence) and not isinstance(options, str):
        for index, option in enumerate(options[: len(CHOICE_LETTERS)]):
            if str(option).strip() == text:
                return CHOICE_LETTERS[index]
    letter = re.match(r"^\(?([A-Ja-j])\)?(?:[.:)]|\s|$)", text)
    return letter.group(1).upper() if letter else None
